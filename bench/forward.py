"""bench/forward: what a fleet's front door adds when it forwards a request to the app's owner.

One app (MobileNetV2 3x64x64 float32, as bench/oip) on a real node started in this process, with two
front doors beside it:

- ``direct``: the node's own front door (rows into its packet pool), as bench/oip runs it;
- ``forwarded``: a front door that hosts no app and has the fleet's routing table
  (``fleet_routes``, served here by the agents' own routes server class). It takes the request,
  checks and decodes it, and sends its rows to the owner's UDP ingest over the wire format
  (orchestrator/frontdoor/forward.py): what any other node of a fleet does for an app it does not host.

A driver process sends one request per way in turn (direct-HTTP, forwarded-HTTP, direct-gRPC,
forwarded-gRPC, the order rotated), one at a time with gaps, so the requests of a round meet the same
node and background load. ``added.<http|grpc>.p50_ms`` is the median over rounds of (forwarded -
direct) latency, with its 90th percentile; issue 25's target is 0.3 ms p50. On one machine the
forwarding door shares the node's process and cores, as a second node would share nothing; the wire
hop is loopback UDP. Each door times its requests per stage (``<forwarding|direct>_door_stages.*``,
orchestrator/frontdoor/transport.py): the forwarded request's wire hop is inside its ``node`` stage.

Run: ``python3 -m bench.forward [--quick] [--rounds N] [--engine onnxruntime]``. Reports, never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np

from bench import serving as sv
from bench.common import write_result
from bench.oip import _on_cores, _take
from gpuprims.cpushare import available_cores
from orchestrator.fleet.routes import RoutesServer
from orchestrator.frontdoor import start_frontdoor
from orchestrator.frontdoor.forward import route_model

SHAPE = (3, 64, 64)
SLO_MS = 200.0
APP, APP_ID = "classify", 1
WAYS = ("direct-http", "forwarded-http", "direct-grpc", "forwarded-grpc")
CLIENT_TIMEOUT_S = 5.0


def route_table(entry: dict[str, Any], udp_port: int) -> dict[str, Any]:
    """The table a fleet's controller would push: the app on this node, no standby."""
    owner = {"host": "127.0.0.1", "udp_port": udp_port, "http_port": 0, "node": "owner", "gpu": 0}
    return {"version": 1, "apps": {APP: {"app_id": APP_ID, "slo_ms": SLO_MS, "primary": owner, "standby": None,
                                         "model": route_model(entry)}}}


async def _rounds_async(targets: dict[str, str], n: int, gap_s: float) -> dict[str, Any]:
    import tritonclient.grpc as gmod
    import tritonclient.grpc.aio as gaio
    import tritonclient.http as hmod
    import tritonclient.http.aio as haio

    x = np.random.default_rng(2).random((1, *SHAPE), dtype=np.float32)
    clients = {"direct-http": haio.InferenceServerClient(targets["direct-http"]),
               "forwarded-http": haio.InferenceServerClient(targets["forwarded-http"]),
               "direct-grpc": gaio.InferenceServerClient(targets["direct-grpc"]),
               "forwarded-grpc": gaio.InferenceServerClient(targets["forwarded-grpc"])}
    hi = hmod.InferInput("input", list(x.shape), "FP32")
    hi.set_data_from_numpy(x, binary_data=True)
    gi = gmod.InferInput("input", list(x.shape), "FP32")
    gi.set_data_from_numpy(x)

    def call(way: str) -> Any:
        c = clients[way]
        return c.infer(APP, [hi]) if way.endswith("http") else c.infer(APP, [gi], client_timeout=CLIENT_TIMEOUT_S)

    lat: dict[str, list[float]] = {w: [] for w in WAYS}
    failed = 0
    try:
        for k in range(n + 5):  # the first 5 rounds warm up
            row = {}
            for way in WAYS[k % 4:] + WAYS[:k % 4]:
                t = time.perf_counter_ns()
                try:
                    await call(way)
                    row[way] = (time.perf_counter_ns() - t) / 1e6
                except Exception:
                    row[way] = float("nan")
                await asyncio.sleep(gap_s)
            if k >= 5:
                failed += sum(np.isnan(v) for v in row.values())
                for way in WAYS:
                    lat[way].append(row[way])
    finally:
        for c in clients.values():
            await c.close()
    return {"latency_ms": lat, "failed": int(failed)}


def _rounds(targets: dict[str, str], n: int, gap_s: float, out: Any, cores: list[int]) -> None:
    _on_cores(cores)
    try:
        out.put(asyncio.run(_rounds_async(targets, n, gap_s)))
    except BaseException as e:
        out.put({"error": repr(e)})


def summarise(lat: dict[str, list[float]]) -> dict[str, Any]:
    """Per way p50/p99, and per protocol the paired difference forwarded - direct (p50, p90)."""
    out: dict[str, Any] = {}
    for way, v in lat.items():
        a = np.asarray(v, float)
        a = a[np.isfinite(a)]
        out[f"{way}.p50_ms"] = round(float(np.median(a)), 3) if a.size else None
        out[f"{way}.p99_ms"] = round(float(np.percentile(a, 99)), 3) if a.size else None
    for proto in ("http", "grpc"):
        d = np.asarray(lat[f"forwarded-{proto}"], float) - np.asarray(lat[f"direct-{proto}"], float)
        d = d[np.isfinite(d)]
        out[f"added.{proto}.p50_ms"] = round(float(np.median(d)), 3) if d.size else None
        out[f"added.{proto}.p90_ms"] = round(float(np.percentile(d, 90)), 3) if d.size else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few rounds (a smoke test, not a result)")
    ap.add_argument("--rounds", type=int, default=400, help="rounds of the four ways")
    ap.add_argument("--engine", default="eager", choices=["eager", "onnxruntime"])
    ap.add_argument("--name", default="forward", help="stem of the result file")
    args = ap.parse_args()
    n = 20 if args.quick else args.rounds
    load_before = os.getloadavg()
    entry = sv.app(APP, "mobilenet_v2", APP_ID, shape=SHAPE, slo_ms=SLO_MS, gpu_pct=50, max_batch=8, max_wait_ms=2.0)
    entry["engine"] = args.engine
    cfg = sv.node_config([entry])
    cores = available_cores()
    ctx = mp.get_context("spawn")
    with sv.running_node(cfg) as node:
        port = sv.port_of(node)
        table = route_table(entry, port)
        routes = RoutesServer(lambda: table)  # an agent's routes server, as the agent runs it
        direct = start_frontdoor(cfg.apps, ("127.0.0.1", port), http_port=0, grpc_port=0, ingest=node.ingest)
        fwd = start_frontdoor([], ("127.0.0.1", port), http_port=0, grpc_port=0, fleet_routes=[routes.url])
        try:
            assert direct.http_url and direct.grpc_target and fwd.http_url and fwd.grpc_target
            targets = {"direct-http": direct.http_url.removeprefix("http://"),
                       "forwarded-http": fwd.http_url.removeprefix("http://"),
                       "direct-grpc": direct.grpc_target, "forwarded-grpc": fwd.grpc_target}
            out = ctx.Queue()
            proc = ctx.Process(target=_rounds, args=(targets, n, 0.02, out, cores), daemon=True)
            proc.start()
            res = _take(node, (proc, None, out), n * 4 * (CLIENT_TIMEOUT_S + 1) + 120)
            proc.join(timeout=10)
            stages = {"forwarding_door": fwd.stages(), "direct_door": direct.stages()}
            forwarder = fwd.core.forwarder if fwd.core is not None else None
            counts = {"forwarded_rows": forwarder.forwarded if forwarder else None,
                      "failovers": forwarder.failovers if forwarder else None}
        finally:
            fwd.close()
            direct.close()
            routes.close()
    summary = summarise(res["latency_ms"]) | {"rounds": n, "failed": res["failed"], "engine": args.engine, **counts}
    for door, by_protocol in stages.items():
        for protocol, st in by_protocol.items():
            for stage, v in st.items():
                if isinstance(v, dict):
                    summary[f"{door}_stages.{protocol}.{stage}.p50_ms"] = v.get("p50_ms")
    path = write_result("forward", "cpu", summary, {"latency_ms": res["latency_ms"]},
                        notes="Paired rounds, one request at a time (module docstring). Both front doors run in "
                              "the node's process on this machine; the forwarded request's extra hop is loopback "
                              "UDP to the node's ingest.",
                        load_avg_before=load_before, name=("forward-quick" if args.quick else args.name))
    print(path)
    for k, v in summary.items():
        print(f"{k:>45}: {v}")


if __name__ == "__main__":
    main()
