"""bench/overload: goodput and admitted p99 under overload, over UDP, HTTP and gRPC (issue 42, "Speed").

One app (MobileNetV2, 3x64x64 float32, SLO 200 ms, gpu_pct 50, max_batch 8; ``--engine onnxruntime``
for the issue's peer model runtime) on a real node started in this process with its front door
(orchestrator/frontdoor, the node's packet-pool transport) beside it, as ``bench/oip`` runs it. The
app has two priority levels (``admission:``, default level 1), so the front door's admission
(orchestrator/frontdoor/admission.py) and its priority levels are what is measured.

1. Capacity: UDP at a quarter, a half and all of ``--probe-rate`` (far above what the node serves),
   ``--probe`` seconds each; the capacity is the best goodput measured there (OK answers within the
   SLO per second). ``--capacity`` skips the probe.
2. Each path (udp, http, grpc) at 0.5x, 1x, 1.5x, 2x and 3x of that capacity, open loop (each request
   starts at its scheduled time, whatever the earlier ones do), one driver process per path.
3. Priority: over HTTP and over gRPC, a high-priority stream (priority 1) at ``--high-share`` of
   capacity beside a low-priority stream (priority 2) making the total 3x capacity, both at once.

Per path and load: ``goodput_rps`` (OK within the SLO per second), ``throughput_rps`` (OK),
``admitted_p99_ms``/``admitted_p50_ms`` (latency of OK answers), ``refused`` (503/429/UNAVAILABLE, and
UDP's OVERLOADED), ``refusal_p50_ms``/``refusal_p99_ms`` (how fast a refusal came back), ``late``
(DEADLINE_MISSED / 504 / DEADLINE_EXCEEDED), ``lost``, ``goodput_share_of_peak`` (goodput over the
path's best goodput of the run). Samples: every request's status and latency. The load average
before and after is in ``machine``. Writes ``bench/results/<machine>/overload.json``.

Run alone: ``python3 -m bench.overload [--engine onnxruntime]``; ``--quick`` is a smoke run, not a result.
Reports, never asserts. Peers (LitServe, Ray Serve, MLServer) are not driven here yet.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import resource
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import serving as sv
from bench.common import write_result
from bench.oip import _on_cores, _take
from gpuprims.cpushare import available_cores
from orchestrator.frontdoor import start_frontdoor

SHAPE = (3, 64, 64)
SLO_MS = 200.0
APP, APP_ID = "classify", 1
PATHS = ("udp", "http", "grpc")
LOADS = (0.5, 1.0, 1.5, 2.0, 3.0)
CLIENT_TIMEOUT_S = 5.0


def classify(path: str, code: str) -> str:
    """One answer's kind from its transport's status: ok, refused, late, lost or error_<code>."""
    if code in ("ok", "lost"):
        return code
    if code in ("OVERLOADED", "error_503", "error_429", "error_StatusCode.UNAVAILABLE"):
        return "refused"
    if code in ("DEADLINE_MISSED", "error_504", "error_StatusCode.DEADLINE_EXCEEDED"):
        return "late"
    return code if code.startswith("error_") else f"error_{code}"


async def _client(path: str, target: str, x: np.ndarray, priority: int) -> tuple[Any, Any]:
    """A client of ``path`` and its one-call coroutine function (returns the answer's kind)."""
    if path == "udp":
        from gpuprims.client import AsyncClient, RequestLost

        host, port = target.rsplit(":", 1)
        client: Any = await AsyncClient((host, int(port)), timeout_s=CLIENT_TIMEOUT_S).open()

        async def call() -> str:
            try:
                r = await client.infer(APP_ID, x[0])
            except RequestLost:
                return "lost"
            return classify(path, "ok" if r.ok else r.status.name)

        return client, call
    from tritonclient.utils import InferenceServerException

    if path == "http":
        import tritonclient.http as mod
        import tritonclient.http.aio as aio

        client = aio.InferenceServerClient(target, conn_limit=1000)
        inp = mod.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        kw: dict[str, Any] = {"priority": priority}
    else:
        import tritonclient.grpc as mod
        import tritonclient.grpc.aio as aio

        client = aio.InferenceServerClient(target)
        inp = mod.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        # No client_timeout: a gRPC call's own deadline counts as the request's timeout at admission.
        kw = {"priority": priority}

    async def call() -> str:
        try:
            r = await asyncio.wait_for(client.infer(APP, [inp], **kw), CLIENT_TIMEOUT_S)
            r.as_numpy("logits")
        except InferenceServerException as e:
            return classify(path, f"error_{e.status()}")
        except asyncio.TimeoutError:
            return "lost"
        return "ok"

    return client, call


async def _drive_async(path: str, target: str, rate: float, duration_s: float, warmup_s: float, seed: int,
                       priority: int) -> dict[str, Any]:
    x = np.random.default_rng(seed).random((1, *SHAPE), dtype=np.float32)
    client, call = await _client(path, target, x, priority)
    loop = asyncio.get_running_loop()
    n_warm, n = round(warmup_s * rate), round((warmup_s + duration_s) * rate)
    lat = np.full(n, np.nan)
    lag = np.zeros(n)
    status = [""] * n

    async def one(k: int, at: float) -> None:
        lag[k] = loop.time() - at
        t = time.perf_counter_ns()
        status[k] = await call()
        lat[k] = (time.perf_counter_ns() - t) / 1e6

    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = loop.time() + 0.1
    tasks = []
    for k in range(n):
        at = t0 + k / rate
        delay = at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(k, at)))
    await asyncio.gather(*tasks)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    res = client.close()
    if asyncio.iscoroutine(res):
        await res
    m = slice(n_warm, n)
    return {"latency_ms": lat[m].tolist(), "status": status[m], "lag_ms": (lag[m] * 1e3).tolist(),
            "span_s": duration_s, "driver_cpu_s": (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)}


def _driver(path: str, target: str, seed: int, cmds: Any, out: Any, cores: list[int]) -> None:
    """Child process: serves ("run", rate, duration_s, warmup_s, priority) commands until ("stop",)."""
    _on_cores(cores)
    while True:
        cmd = cmds.get()
        if cmd[0] == "stop":
            return
        _, rate, duration_s, warmup_s, priority = cmd
        try:
            out.put(asyncio.run(_drive_async(path, target, rate, duration_s, warmup_s, seed, priority)))
        except BaseException as e:
            out.put({"error": repr(e)})


def summarise(run: dict[str, Any], slo_ms: float = SLO_MS) -> dict[str, Any]:
    """Goodput, admitted and refusal latencies and counts of one driver run."""
    lat = np.asarray(run["latency_ms"], dtype=float)
    st = np.asarray(run["status"])
    ok, refused = st == "ok", st == "refused"
    sent = len(st)

    def pct(mask: np.ndarray, p: float) -> float | None:
        return round(float(np.percentile(lat[mask], p)), 3) if mask.any() else None

    span = max(run["span_s"], 1e-9)
    good = int((ok & (lat <= slo_ms)).sum())
    others = {str(k): int(c) for k, c in zip(*np.unique(st[~(ok | refused)], return_counts=True))} \
        if (~(ok | refused)).any() else {}
    return {"sent": sent, "offered_rps": round(sent / span, 2), "goodput_rps": round(good / span, 2),
            "throughput_rps": round(int(ok.sum()) / span, 2), "admitted_p50_ms": pct(ok, 50),
            "admitted_p99_ms": pct(ok, 99), "slo_attainment": round(good / sent, 4) if sent else None,
            "refused": int(refused.sum()), "refusal_p50_ms": pct(refused, 50), "refusal_p99_ms": pct(refused, 99),
            "late": others.pop("late", 0), "lost": others.pop("lost", 0), "other": others,
            "driver_lag_p99_ms": round(float(np.percentile(run["lag_ms"], 99)), 3) if sent else None,
            "driver_cpu_ms_per_request": round(run["driver_cpu_s"] * 1e3 / max(sent, 1), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny runs (a smoke test, not a result)")
    ap.add_argument("--duration", type=float, default=10.0, help="measured seconds per path and load")
    ap.add_argument("--probe", type=float, default=5.0, help="seconds of each step of the capacity probe")
    ap.add_argument("--probe-rate", type=float, default=None,
                    help="offered rate of the capacity probe, req/s (default 600 on eager, 2000 on onnxruntime)")
    ap.add_argument("--capacity", type=float, default=None, help="capacity in req/s (skips the probe)")
    ap.add_argument("--loads", type=float, nargs="+", default=list(LOADS), help="multiples of capacity")
    ap.add_argument("--high-share", type=float, default=0.3, help="the high-priority stream, share of capacity")
    ap.add_argument("--engine", default="eager", choices=["eager", "onnxruntime"], help="the app's engine")
    ap.add_argument("--name", default="overload", help="stem of the result file")
    ap.add_argument("--out", type=Path, default=None, help="directory of the result (default bench/results/<machine>)")
    args = ap.parse_args()
    duration, warmup = (1.5, 0.3) if args.quick else (args.duration, 1.0)
    probe_s = 1.5 if args.quick else args.probe
    loads = args.loads[:2] if args.quick else args.loads
    load_before = os.getloadavg()
    t_start = time.monotonic()
    app = sv.app(APP, "mobilenet_v2", APP_ID, shape=SHAPE, slo_ms=SLO_MS, gpu_pct=50, max_batch=8, max_wait_ms=2.0)
    app["engine"] = args.engine
    # Two levels; a request without a priority is level 1 (the goodput curves), the priority runs' background
    # stream asks for level 2, which is admitted only while it leaves half the deadline to level 1.
    app["admission"] = {"priority_levels": 2, "default_priority_level": 1}
    cfg = sv.node_config([app])
    cores = available_cores()
    ctx = mp.get_context("spawn")
    results: dict[str, dict[str, Any]] = {}
    samples: dict[str, Any] = {}
    with sv.running_node(cfg) as node:
        port = sv.port_of(node)
        # The node's own statistics records, as the node gives its front door: admission learns the batch
        # latency and the instances' queue from their heartbeats there.
        door = start_frontdoor(cfg.apps, ("127.0.0.1", port), http_port=0, grpc_port=0, ingest=node.ingest,
                               statistics={name: a.stats for name, a in node.apps.items()})
        try:
            assert door.http_url is not None and door.grpc_target is not None
            targets = {"udp": f"127.0.0.1:{port}", "http": door.http_url.removeprefix("http://"),
                       "grpc": door.grpc_target}
            drivers: dict[str, tuple[Any, Any, Any]] = {}
            for name, path in (*((p, p) for p in PATHS), ("http_high", "http"), ("grpc_high", "grpc")):
                cmds, out = ctx.Queue(), ctx.Queue()
                proc = ctx.Process(target=_driver, args=(path, targets[path], 1, cmds, out, cores), daemon=True)
                proc.start()
                drivers[name] = (proc, cmds, out)

            def run(name: str, rate: float, priority: int = 0, secs: float = duration) -> dict[str, Any]:
                proc, cmds, out = drivers[name]
                cmds.put(("run", rate, secs, warmup, priority))
                return _take(node, (proc, cmds, out), warmup + secs + CLIENT_TIMEOUT_S + 120)

            def start(name: str, rate: float, priority: int) -> None:
                drivers[name][1].put(("run", rate, duration, warmup, priority))

            try:
                for path in PATHS:  # warm-up, discarded
                    run(path, 20.0, secs=1.0)
                if args.capacity is None:
                    # A quarter, a half and all of the probe rate: the best goodput is the capacity (one
                    # rate alone could sit where a backlog already costs goodput, and understate it).
                    probe_rate = args.probe_rate or (2000.0 if args.engine == "onnxruntime" else 600.0)
                    for share in (0.25, 0.5, 1.0):
                        r = run("udp", share * probe_rate, secs=probe_s)
                        results[f"probe.{share:g}"] = summarise(r)
                        samples[f"probe.{share:g}"] = {"latency_ms": [round(v, 3) for v in r["latency_ms"]],
                                                       "status": r["status"]}
                    capacity = max(1.0, *(results[f"probe.{s:g}"]["goodput_rps"] for s in (0.25, 0.5, 1.0)))
                else:
                    capacity = args.capacity
                print(f"capacity {capacity:g} req/s", flush=True)
                for mult in loads:
                    for path in PATHS:
                        key = f"{path}.{mult:g}x"
                        r = run(path, mult * capacity)
                        results[key] = summarise(r)
                        samples[key] = {"latency_ms": [round(v, 3) for v in r["latency_ms"]], "status": r["status"]}
                        print(f"{key}: {json.dumps(results[key])}", flush=True)
                high_rate = args.high_share * capacity
                for path in ("http", "grpc"):  # both streams at once: high at a share, default to 3x total
                    start(f"{path}_high", high_rate, 1)
                    start(path, 3 * capacity - high_rate, 2)
                    for name in (f"{path}_high", path):
                        r = _take(node, drivers[name], warmup + duration + CLIENT_TIMEOUT_S + 120)
                        key = f"priority.{path}.{'high' if name.endswith('high') else 'low'}"
                        results[key] = summarise(r)
                        samples[key] = {"latency_ms": [round(v, 3) for v in r["latency_ms"]], "status": r["status"]}
                        print(f"{key}: {json.dumps(results[key])}", flush=True)
            finally:
                for _proc, cmds, _ in drivers.values():
                    cmds.put(("stop",))
                for proc, _, _ in drivers.values():
                    proc.join(timeout=10)
                    if proc.is_alive():
                        proc.kill()
                        proc.join()
            instance = sv.instance_stats(node, APP)
            admission = (node.status()["apps"][APP].get("oip") or {}).get("admission")
        finally:
            door.close()
    summary: dict[str, Any] = {"capacity_rps": round(capacity, 2), "capacity_measured": args.capacity is None}
    for path in PATHS:
        peak = max((results[f"{path}.{m:g}x"]["goodput_rps"] for m in loads), default=0.0)
        summary[f"{path}.peak_goodput_rps"] = peak
        for m in loads:
            s = results[f"{path}.{m:g}x"]
            for k in ("offered_rps", "goodput_rps", "throughput_rps", "admitted_p50_ms", "admitted_p99_ms",
                      "slo_attainment", "refused", "refusal_p50_ms", "refusal_p99_ms", "late", "lost"):
                summary[f"{path}.{m:g}x.{k}"] = s[k]
            summary[f"{path}.{m:g}x.goodput_share_of_peak"] = round(s["goodput_rps"] / peak, 4) if peak else None
    for key, s in results.items():
        if key.startswith("priority."):
            for k in ("offered_rps", "goodput_rps", "slo_attainment", "admitted_p99_ms", "refused"):
                summary[f"{key}.{k}"] = s[k]
    summary.update({"engine": args.engine, "model": "mobilenet_v2", "input_shape": "3x64x64", "slo_ms": SLO_MS,
                    "max_batch": 8, "loads_x_capacity": loads, "duration_s": duration, "high_share": args.high_share,
                    "wall_s": round(time.monotonic() - t_start, 1)})
    notes = (f"CPU backend (no GPU), engine {args.engine}; gpuprims only (peers not driven yet). Paths run one "
             "after another at each load; the priority runs drive a priority-1 stream and a low "
             "stream (priority 2) at once over the same front door. Goodput = OK answers within the SLO per second.")
    path = write_result("overload", "cpu", summary, {"runs": samples, "results": results, "instance": instance,
                                                     "admission": admission},
                        notes=notes, name=args.name, load_avg_before=load_before, large_samples=True,
                        out_dir=args.out)
    print(f"wrote {path} in {time.monotonic() - t_start:.0f} s")


if __name__ == "__main__":
    main()
