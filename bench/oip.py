"""bench/oip: what the Open Inference Protocol front door costs per request, over HTTP and gRPC vs UDP.

One app (MobileNetV2, 3x64x64 float32 = 48 datagrams a request, SLO 200 ms, gpu_pct 50: one core of
two on the CPU backend, max_batch 8) on a real node started in this process, with the front door
(orchestrator/frontdoor) beside it as the node would run it. The same app is driven at the same
open-loop constant rates over three paths, one after the other:

- ``udp``: gpuprims.client.AsyncClient straight to the node's UDP ingest;
- ``http``: tritonclient.http.aio (binary tensor data) to the front door;
- ``grpc``: tritonclient.grpc.aio (raw_input_contents) to the front door.

Each path has its own driver process (one asyncio loop; each request starts at its scheduled time
whatever the earlier ones are doing), so the node process holds only the node and the front door.
At each rate the paths take turns in short blocks (``--blocks``, order rotated, a 0.5 s warm-up
each), so a change in the machine's background load falls on all three alike.
Per path and rate: throughput (OK answers/s), p50/p99 latency of OK answers (from the call to the
answer, as the client sees it), SLO attainment (OK within the SLO / sent), errors by kind, the
driver's lag behind its schedule, and the CPU time per request of the node process (ingest,
control loop and, for http/grpc, the front door) and of the driver. ``added_ms_per_request`` of a
front door is measured in a *paired* run: one driver sends one request per path in turn (udp, http,
grpc, rotating the order), one at a time with 20 ms gaps, so the three requests of a triple meet the
same node and background load; it is the median over triples of (front-door latency - UDP
latency), with its 90th percentile beside it (``paired.*`` keys). During the paired run the front
door times each inference per stage (orchestrator/frontdoor/transport.py ``STAGES``: parse, decode,
submit, node, back, collect, encode; ``stages.<http|grpc>.<stage>.p50_ms``/``p99_ms``/``mean_ms``),
beside the instance's own stages (reassembly ... respond, ``instance_stages.*``), so the report says
where a front-door request's time goes. ``--door pool`` (the node's way, default) places each row
into the packet pool; ``--door udp`` sends it to the UDP ingest as datagrams (the way before). ``added_p50_ms``/``added_p99_ms``
of the blocked open-loop runs are given at every rate too (they move with the machine's background
load between blocks), and ``added_node_cpu_ms_per_request``: the node process's CPU per request
over UDP's.

``--engine onnxruntime`` runs the app on ONNX Runtime (issue 23), so the model's ~2.5 ms instead of eager's
~13 leaves less noise around what the paths add.

``--shm`` runs instead what Triton's shared-memory extension saves: a paired run (one request per path in
turn, one at a time) over ``udp``, ``http``, ``http-shm``, ``grpc`` and ``grpc-shm`` with one 3x224x224
float32 image (the issue's goal: ≤ 0.1 ms over UDP), the shm paths with the input and the output in
system shared memory (``tritonclient.utils.shared_memory`` regions registered once, the output read back
from its region inside the timed call); ``<path>.added_ms_per_request`` over UDP; writes ``oip_shm.json``.

Run: ``python3 -m bench.oip [--quick] [--engine onnxruntime --name oip-onnxruntime] [--shm]``. Reports, never
asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import multiprocessing as mp
import os
import queue
import resource
import sys
import time
import types
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from bench import serving as sv
from bench.common import write_result
from gpuprims.cpushare import available_cores
from orchestrator.frontdoor import start_frontdoor

SHAPE = (3, 64, 64)
SLO_MS = 200.0
APP, APP_ID = "classify", 1
PATHS = ("udp", "http", "grpc")
CLIENT_TIMEOUT_S = 5.0


async def _drive_async(path: str, target: str, rate: float, duration_s: float, warmup_s: float,
                       seed: int, phase_s: float = 0.0) -> dict[str, Any]:
    x = np.random.default_rng(seed).random((1, *SHAPE), dtype=np.float32)
    if path == "udp":
        from gpuprims.client import AsyncClient, RequestLost

        host, port = target.rsplit(":", 1)
        client: Any = await AsyncClient((host, int(port)), timeout_s=CLIENT_TIMEOUT_S).open()

        async def call() -> str:
            try:
                r = await client.infer(APP_ID, x[0])
            except RequestLost:
                return "lost"
            return "ok" if r.ok else r.status.name

        close = client.close
    else:
        from tritonclient.utils import InferenceServerException

        if path == "http":
            import tritonclient.http as mod
            import tritonclient.http.aio as aio

            client = aio.InferenceServerClient(target)
            inp = mod.InferInput("input", list(x.shape), "FP32")
            inp.set_data_from_numpy(x, binary_data=True)
            kw: dict[str, Any] = {}
        else:
            import tritonclient.grpc as mod
            import tritonclient.grpc.aio as aio

            client = aio.InferenceServerClient(target)
            inp = mod.InferInput("input", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            kw = {"client_timeout": CLIENT_TIMEOUT_S}

        async def call() -> str:
            try:
                r = await client.infer(APP, [inp], **kw)
                r.as_numpy("logits")
            except InferenceServerException as e:
                return f"error_{e.status()}"
            except asyncio.TimeoutError:
                return "lost"
            return "ok"

        close = client.close

    loop = asyncio.get_running_loop()
    n_warm, n = round(warmup_s * rate), round((warmup_s + duration_s) * rate)
    lat = np.full(n, np.nan)
    lag = np.zeros(n)
    status = [""] * n

    async def one(k: int, at: float) -> None:
        start = loop.time()
        lag[k] = start - at
        t = time.perf_counter_ns()
        status[k] = await call()
        lat[k] = (time.perf_counter_ns() - t) / 1e6

    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = loop.time() + 0.1 + phase_s
    tasks = []
    for k in range(n):
        at = t0 + k / rate
        delay = at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(k, at)))
    await asyncio.gather(*tasks)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    res = close()
    if asyncio.iscoroutine(res):
        await res
    m = slice(n_warm, n)
    return {"latency_ms": lat[m].tolist(), "status": status[m], "lag_ms": (lag[m] * 1e3).tolist(),
            "span_s": duration_s, "driver_cpu_s": (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)}


async def _paired_async(targets: dict[str, str], n: int, gap_s: float) -> dict[str, Any]:
    """One request per path in turn (udp, http, grpc, udp, ...), one at a time: each triple meets the
    same node and background load, so per-triple differences isolate what a front door adds."""
    import tritonclient.grpc as gmod
    import tritonclient.grpc.aio as gaio
    import tritonclient.http as hmod
    import tritonclient.http.aio as haio

    from gpuprims.client import AsyncClient

    x = np.random.default_rng(2).random((1, *SHAPE), dtype=np.float32)
    host, port = targets["udp"].rsplit(":", 1)
    u = await AsyncClient((host, int(port)), timeout_s=CLIENT_TIMEOUT_S).open()
    h = haio.InferenceServerClient(targets["http"])
    g = gaio.InferenceServerClient(targets["grpc"])
    hi = hmod.InferInput("input", list(x.shape), "FP32")
    hi.set_data_from_numpy(x, binary_data=True)
    gi = gmod.InferInput("input", list(x.shape), "FP32")
    gi.set_data_from_numpy(x)
    calls = {"udp": lambda: u.infer(APP_ID, x[0]), "http": lambda: h.infer(APP, [hi]),
             "grpc": lambda: g.infer(APP, [gi], client_timeout=CLIENT_TIMEOUT_S)}
    lat: dict[str, list[float]] = {p: [] for p in PATHS}
    failed = 0
    try:
        for k in range(n + 5):  # the first 5 triples warm up
            row = {}
            for path in PATHS[k % 3:] + PATHS[:k % 3]:
                t = time.perf_counter_ns()
                try:
                    r = await calls[path]()
                    ok = getattr(r, "ok", True)
                except Exception:
                    ok = False
                row[path] = (time.perf_counter_ns() - t) / 1e6 if ok else float("nan")
                await asyncio.sleep(gap_s)
            if k >= 5:
                failed += sum(np.isnan(v) for v in row.values())
                for path in PATHS:
                    lat[path].append(row[path])
    finally:
        u.close()
        await h.close()
        await g.close()
    return {"latency_ms": lat, "failed": int(failed)}


def _paired(targets: dict[str, str], n: int, gap_s: float, out: Any, cores: list[int]) -> None:
    _on_cores(cores)
    try:
        out.put(asyncio.run(_paired_async(targets, n, gap_s)))
    except BaseException as e:
        out.put({"error": repr(e)})


def _driver(path: str, target: str, seed: int, cmds: Any, out: Any, cores: list[int]) -> None:
    """Child process: serves ("run", rate, duration_s, warmup_s, phase_s) commands until ("stop",)."""
    _on_cores(cores)
    while True:
        cmd = cmds.get()
        if cmd[0] == "stop":
            return
        _, rate, duration_s, warmup_s, phase_s = cmd
        try:
            out.put(asyncio.run(_drive_async(path, target, rate, duration_s, warmup_s, seed, phase_s)))
        except BaseException as e:
            out.put({"error": repr(e)})


def _on_cores(cores: list[int]) -> None:
    """A driver runs where a client on this machine would: on every core, not on the node's own (a
    process started by the in-process node inherits the cores its threads are kept on)."""
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, cores)


def _merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"latency_ms": [v for r in runs for v in r["latency_ms"]], "status": [v for r in runs for v in r["status"]],
            "lag_ms": [v for r in runs for v in r["lag_ms"]], "span_s": sum(r["span_s"] for r in runs),
            "driver_cpu_s": sum(r["driver_cpu_s"] for r in runs)}


def _take(node: Any, driver: tuple[Any, Any, Any], timeout_s: float) -> dict[str, Any]:
    """The driver's next result, pumping the node's control loop meanwhile."""
    proc, _, out = driver
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        node.step(50)
        alive = proc.is_alive()
        try:
            run = out.get(timeout=0.01 if alive else 1.0)
        except queue.Empty:
            if not alive:
                raise RuntimeError(f"driver exited ({proc.exitcode}) without a result") from None
            continue
        if "error" in run:
            raise RuntimeError(f"driver failed: {run['error']}")
        return run
    raise RuntimeError(f"no result from the driver within {timeout_s:g} s")


def summarise(run: dict[str, Any]) -> dict[str, Any]:
    lat = np.asarray(run["latency_ms"])
    st = np.asarray(run["status"])
    ok = st == "ok"
    sent = len(st)
    good = int((ok & (lat <= SLO_MS)).sum())
    kinds, counts = np.unique(st[~ok], return_counts=True) if (~ok).any() else ([], [])

    def pct(p: float) -> float | None:
        return round(float(np.percentile(lat[ok], p)), 3) if ok.any() else None

    return {"sent": sent, "ok": int(ok.sum()), "throughput_rps": round(int(ok.sum()) / run["span_s"], 2),
            "p50_ms": pct(50), "p99_ms": pct(99), "slo_attainment": round(good / sent, 4) if sent else None,
            "errors": {str(k): int(c) for k, c in zip(kinds, counts)},
            "driver_lag_p99_ms": round(float(np.percentile(run["lag_ms"], 99)), 3),
            "driver_cpu_ms_per_request": round(run["driver_cpu_s"] * 1e3 / max(sent, 1), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short runs (a smoke test, not a result)")
    ap.add_argument("--rates", type=float, nargs="+", default=[10.0, 30.0, 60.0], help="requests/s")
    ap.add_argument("--duration", type=float, default=12.0, help="measured seconds per path and rate")
    ap.add_argument("--blocks", type=int, default=4, help="turns each path takes at each rate")
    ap.add_argument("--paired", type=int, default=300, help="request triples of the paired run")
    ap.add_argument("--door", choices=("pool", "udp"), default="pool",
                    help="how the front door hands rows to the node: into the packet pool (the node's "
                         "way) or as datagrams to its UDP ingest (the way before)")
    ap.add_argument("--engine", default="eager", choices=["eager", "onnxruntime"],
                    help="the app's engine (issue 23); onnxruntime needs the onnx extra")
    ap.add_argument("--name", default="oip", help="stem of the result file (bench/results/<machine>/<name>.json)")
    ap.add_argument("--shm", action="store_true",
                    help="instead: the paired run over udp, http, http-shm, grpc, grpc-shm with a 3x224x224 input "
                         "(Triton's shared-memory extension; writes oip_shm.json)")
    ap.add_argument("--out-dir", type=Path, default=None, help="with --shm: write the result here (smoke runs), not bench/results")
    args = ap.parse_args()
    if args.shm:
        shm_main(args)
        return
    duration, warmup = (2.0, 0.5) if args.quick else (args.duration, 0.5)
    blocks = 1 if args.quick else args.blocks
    paired_n = 20 if args.quick else args.paired
    rates = args.rates[:2] if args.quick else args.rates
    load_before = os.getloadavg()
    app = sv.app(APP, "mobilenet_v2", APP_ID, shape=SHAPE, slo_ms=SLO_MS, gpu_pct=50, max_batch=8, max_wait_ms=2.0)
    app["engine"] = args.engine
    cfg = sv.node_config([app])
    cores = available_cores()
    ctx = mp.get_context("spawn")
    results: dict[str, dict[str, Any]] = {}
    samples: dict[str, Any] = {}
    with sv.running_node(cfg) as node:
        port = sv.port_of(node)
        door = start_frontdoor(cfg.apps, ("127.0.0.1", port), http_port=0, grpc_port=0,
                               ingest=node.ingest if args.door == "pool" else None)
        try:
            assert door.http_url is not None and door.grpc_target is not None
            targets = {"udp": f"127.0.0.1:{port}", "http": door.http_url.removeprefix("http://"),
                       "grpc": door.grpc_target}
            drivers = {}
            for path in PATHS:
                cmds, out = ctx.Queue(), ctx.Queue()
                proc = ctx.Process(target=_driver, args=(path, targets[path], 1, cmds, out, cores),
                                   daemon=True)
                proc.start()
                drivers[path] = (proc, cmds, out)
            try:
                for path in PATHS:  # warm-up, discarded: connections, first calls, the instance's batches
                    drivers[path][1].put(("run", rates[0], 1.0, 0.5, 0.0))
                    _take(node, drivers[path], 60.0)
                for rate in rates:
                    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in PATHS}
                    node_cpu = dict.fromkeys(PATHS, 0.0)
                    for rep in range(blocks):
                        # Paths take turns in short blocks (order rotated), so a change in the
                        # machine's background load falls on all three alike.
                        for path in PATHS[rep % 3:] + PATHS[:rep % 3]:
                            proc, cmds, out = drivers[path]
                            ru0 = resource.getrusage(resource.RUSAGE_SELF)
                            cmds.put(("run", rate, duration / blocks, warmup, 0.0))
                            run = _take(node, (proc, cmds, out), warmup + duration + CLIENT_TIMEOUT_S + 120)
                            ru1 = resource.getrusage(resource.RUSAGE_SELF)
                            runs[path].append(run)
                            node_cpu[path] += (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
                    for path in PATHS:
                        key = f"{path}.{rate:g}rps"
                        run = _merge(runs[path])
                        s = summarise(run)
                        s["node_process_cpu_ms_per_request"] = round(node_cpu[path] * 1e3 / max(s["sent"], 1), 3)
                        results[key] = s
                        samples[key] = {"latency_ms": [round(v, 3) for v in run["latency_ms"]],
                                        "status": run["status"]}
                        print(f"{key}: {json.dumps(s)}", flush=True)
                # Paired: the three paths in turn, one request at a time, from one driver process.
                door.stages(reset=True)  # the stage times below are the paired run's alone
                out = ctx.Queue()
                proc = ctx.Process(target=_paired, args=(targets, paired_n, 0.02, out, cores), daemon=True)
                proc.start()
                paired = _take(node, (proc, None, out), paired_n * 3 * (CLIENT_TIMEOUT_S + 1) + 120)
                proc.join(timeout=10)
                stages = door.stages()
            finally:
                for _proc, cmds, _ in drivers.values():
                    cmds.put(("stop",))
                for proc, _, _ in drivers.values():
                    proc.join(timeout=10)
                    if proc.is_alive():
                        proc.kill()
                        proc.join()
            instance = sv.instance_stats(node, APP)
        finally:
            door.close()
    load_after = os.getloadavg()
    summary: dict[str, Any] = {}
    for path in PATHS:
        v = np.asarray(paired["latency_ms"][path])
        v = v[np.isfinite(v)]
        summary[f"paired.{path}.p50_ms"] = round(float(np.median(v)), 3) if v.size else None
        summary[f"paired.{path}.p99_ms"] = round(float(np.percentile(v, 99)), 3) if v.size else None
    summary["paired.requests_per_path"] = paired_n
    summary["door"] = args.door
    for protocol, st in stages.items():
        for stage, v in st.items():
            if isinstance(v, dict):
                for k, ms in v.items():
                    summary[f"stages.{protocol}.{stage}.{k}"] = ms
        summary[f"stages.{protocol}.inferences"] = st["inferences"]
    for inst in instance["instances"]:
        for stage, v in (inst.get("stages") or {}).items():
            if isinstance(v, dict) and inst.get("role") == "active":
                summary[f"instance_stages.{stage}.p50_ms"] = v.get("p50_ms")
    summary["paired.failed"] = paired["failed"]
    for key, s in results.items():
        for k in ("throughput_rps", "p50_ms", "p99_ms", "slo_attainment", "node_process_cpu_ms_per_request",
                  "driver_cpu_ms_per_request", "driver_lag_p99_ms"):
            if k in s:
                summary[f"{key}.{k}"] = s[k]
        summary[f"{key}.errors"] = s["errors"]
    low = f"{rates[0]:g}rps"
    for door_path in ("http", "grpc"):
        for rate in rates:
            r = f"{rate:g}rps"
            a, b = results[f"{door_path}.{r}"], results[f"udp.{r}"]
            if a["p50_ms"] is not None and b["p50_ms"] is not None:
                summary[f"{door_path}.{r}.added_p50_ms"] = round(a["p50_ms"] - b["p50_ms"], 3)
                summary[f"{door_path}.{r}.added_p99_ms"] = round(a["p99_ms"] - b["p99_ms"], 3)
            summary[f"{door_path}.{r}.added_node_cpu_ms_per_request"] = round(
                a["node_process_cpu_ms_per_request"] - b["node_process_cpu_ms_per_request"], 3)
        d = np.asarray(paired["latency_ms"][door_path]) - np.asarray(paired["latency_ms"]["udp"])
        d = d[np.isfinite(d)]
        summary[f"{door_path}.added_ms_per_request"] = round(float(np.median(d)), 3) if d.size else None
        summary[f"{door_path}.added_ms_per_request_p90"] = round(float(np.percentile(d, 90)), 3) if d.size else None
        summary[f"{door_path}.blocked_added_p50_ms_lowest_rate"] = summary.get(f"{door_path}.{low}.added_p50_ms")
    summary.update({"engine": args.engine, "model": "mobilenet_v2", "input_shape": "3x64x64", "dtype": "float32", "slo_ms": SLO_MS,
                    "gpu_pct": 50, "max_batch": 8, "rates_rps": rates, "duration_s": duration, "blocks": blocks,
                    "load_avg_before": [round(v, 2) for v in load_before],
                    "load_avg_after": [round(v, 2) for v in load_after]})
    notes = (f"CPU backend (no GPU), engine {args.engine}. Front door over {args.door}. The node keeps its own "
             "threads (front door included) on the core its instance does not hold; the drivers run on every core."
             f" At each rate the paths take turns in short blocks (order rotated); each "
             "path's driver is a process of its own. added_ms_per_request = median over the paired run's "
             "triples (one request per path in turn, one at a time) of front-door latency - UDP latency.")
    samples["paired"] = {p: [round(v, 3) for v in paired["latency_ms"][p]] for p in PATHS}
    path = write_result("oip", "cpu", summary, {"runs": samples, "instance": instance, "stages": stages},
                        notes=notes, name=args.name)
    doc = json.loads(path.read_text())
    doc["machine"]["load_avg_before"] = summary["load_avg_before"]
    doc["machine"]["load_avg_after"] = summary["load_avg_after"]
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}")


SHM_SHAPE = (3, 224, 224)
SHM_SLO_MS = 1000.0
SHM_CLASSES = 10
SHM_PATHS = ("udp", "http", "http-shm", "grpc", "grpc-shm")
SHM_TIMEOUT_S = 10.0


def _client_shm() -> types.ModuleType:
    """tritonclient.utils.shared_memory; it finds its libcshm.so with pkg_resources, which setuptools >= 81
    no longer ships: stand in for that one lookup when it is missing."""
    if "pkg_resources" not in sys.modules and importlib.util.find_spec("pkg_resources") is None:
        def resource_filename(package: str, name: str) -> str:
            spec = importlib.util.find_spec(package)
            assert spec is not None and spec.origin is not None
            return os.path.join(os.path.dirname(spec.origin), name)

        stand_in = types.ModuleType("pkg_resources")
        stand_in.resource_filename = resource_filename  # type: ignore[attr-defined]
        sys.modules["pkg_resources"] = stand_in
    import tritonclient.utils.shared_memory as cshm

    return cshm


async def _paired_shm_async(targets: dict[str, str], n: int, gap_s: float) -> dict[str, Any]:
    """One request per path of :data:`SHM_PATHS` in turn, one at a time, the shm paths through regions
    registered once (the output read back from its region inside the timed call)."""
    import tritonclient.grpc as gmod
    import tritonclient.grpc.aio as gaio
    import tritonclient.http as hmod
    import tritonclient.http.aio as haio

    from gpuprims.client import AsyncClient

    cshm = _client_shm()
    x = np.random.default_rng(2).random((1, *SHM_SHAPE), dtype=np.float32)
    out_bytes = SHM_CLASSES * 4
    tag = uuid.uuid4().hex[:10]
    h_in = cshm.create_shared_memory_region(f"in-{tag}", f"/bench-in-{tag}", x.nbytes)
    h_out = cshm.create_shared_memory_region(f"out-{tag}", f"/bench-out-{tag}", out_bytes)
    cshm.set_shared_memory_region(h_in, [x])
    host, port = targets["udp"].rsplit(":", 1)
    u = await AsyncClient((host, int(port)), timeout_s=SHM_TIMEOUT_S).open()
    h = haio.InferenceServerClient(targets["http"])
    g = gaio.InferenceServerClient(targets["grpc"])
    await h.register_system_shared_memory(f"in-{tag}", f"/bench-in-{tag}", x.nbytes)
    await h.register_system_shared_memory(f"out-{tag}", f"/bench-out-{tag}", out_bytes)
    hi = hmod.InferInput("input", list(x.shape), "FP32")
    hi.set_data_from_numpy(x, binary_data=True)
    gi = gmod.InferInput("input", list(x.shape), "FP32")
    gi.set_data_from_numpy(x)
    hs = hmod.InferInput("input", list(x.shape), "FP32")
    hs.set_shared_memory(f"in-{tag}", x.nbytes)
    hso = hmod.InferRequestedOutput("logits", binary_data=True)
    hso.set_shared_memory(f"out-{tag}", out_bytes)
    gs = gmod.InferInput("input", list(x.shape), "FP32")
    gs.set_shared_memory(f"in-{tag}", x.nbytes)
    gso = gmod.InferRequestedOutput("logits")
    gso.set_shared_memory(f"out-{tag}", out_bytes)

    async def http_shm() -> Any:
        r = await h.infer(APP, [hs], outputs=[hso])
        cshm.get_contents_as_numpy(h_out, np.float32, [1, SHM_CLASSES])
        return r

    async def grpc_shm() -> Any:
        r = await g.infer(APP, [gs], outputs=[gso], client_timeout=SHM_TIMEOUT_S)
        cshm.get_contents_as_numpy(h_out, np.float32, [1, SHM_CLASSES])
        return r

    calls = {"udp": lambda: u.infer(APP_ID, x[0]), "http": lambda: h.infer(APP, [hi]),
             "http-shm": http_shm, "grpc": lambda: g.infer(APP, [gi], client_timeout=SHM_TIMEOUT_S),
             "grpc-shm": grpc_shm}
    lat: dict[str, list[float]] = {p: [] for p in SHM_PATHS}
    failed = 0
    try:
        for k in range(n + 5):  # the first 5 rounds warm up
            row = {}
            for path in SHM_PATHS[k % len(SHM_PATHS):] + SHM_PATHS[:k % len(SHM_PATHS)]:
                t = time.perf_counter_ns()
                try:
                    r = await calls[path]()
                    ok = getattr(r, "ok", True)
                except Exception:
                    ok = False
                row[path] = (time.perf_counter_ns() - t) / 1e6 if ok else float("nan")
                await asyncio.sleep(gap_s)
            if k >= 5:
                failed += sum(np.isnan(v) for v in row.values())
                for path in SHM_PATHS:
                    lat[path].append(row[path])
    finally:
        await h.unregister_system_shared_memory()
        u.close()
        await h.close()
        await g.close()
        cshm.destroy_shared_memory_region(h_in)
        cshm.destroy_shared_memory_region(h_out)
    return {"latency_ms": lat, "failed": int(failed)}


def _paired_shm(targets: dict[str, str], n: int, gap_s: float, out: Any, cores: list[int]) -> None:
    _on_cores(cores)
    try:
        out.put(asyncio.run(_paired_shm_async(targets, n, gap_s)))
    except BaseException as e:
        out.put({"error": repr(e)})


def shm_main(args: argparse.Namespace) -> None:
    """``--shm``: the paired run of :data:`SHM_PATHS` (the module docstring's shared-memory part)."""
    n = 10 if args.quick else args.paired
    load_before = os.getloadavg()
    app = sv.app(APP, "mobilenet_v2", APP_ID, shape=SHM_SHAPE, slo_ms=SHM_SLO_MS, gpu_pct=50, max_batch=1, max_wait_ms=0.5)
    app["engine"] = args.engine
    app["num_classes"] = SHM_CLASSES
    cfg = sv.node_config([app])
    cores = available_cores()
    ctx = mp.get_context("spawn")
    with sv.running_node(cfg) as node:
        port = sv.port_of(node)
        door = start_frontdoor(cfg.apps, ("127.0.0.1", port), http_port=0, grpc_port=0, ingest=node.ingest)
        try:
            assert door.http_url is not None and door.grpc_target is not None
            targets = {"udp": f"127.0.0.1:{port}", "http": door.http_url.removeprefix("http://"),
                       "grpc": door.grpc_target}
            door.stages(reset=True)
            out = ctx.Queue()
            proc = ctx.Process(target=_paired_shm, args=(targets, n, 0.02, out, cores), daemon=True)
            proc.start()
            try:
                paired = _take(node, (proc, None, out), n * len(SHM_PATHS) * (SHM_TIMEOUT_S + 1) + 120)
            finally:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
            stages = door.stages()
        finally:
            door.close()
    load_after = os.getloadavg()
    summary: dict[str, Any] = {}
    for path in SHM_PATHS:
        v = np.asarray(paired["latency_ms"][path])
        v = v[np.isfinite(v)]
        summary[f"paired.{path}.p50_ms"] = round(float(np.median(v)), 3) if v.size else None
        summary[f"paired.{path}.p99_ms"] = round(float(np.percentile(v, 99)), 3) if v.size else None
        if path != "udp":
            d = np.asarray(paired["latency_ms"][path]) - np.asarray(paired["latency_ms"]["udp"])
            d = d[np.isfinite(d)]
            summary[f"{path}.added_ms_per_request"] = round(float(np.median(d)), 3) if d.size else None
            summary[f"{path}.added_ms_per_request_p90"] = round(float(np.percentile(d, 90)), 3) if d.size else None
    summary.update({"paired.rounds": n, "paired.failed": paired["failed"], "engine": args.engine,
                    "model": "mobilenet_v2", "input_shape": "3x224x224", "dtype": "float32",
                    "load_avg_before": [round(v, 2) for v in load_before],
                    "load_avg_after": [round(v, 2) for v in load_after]})
    notes = ("CPU backend (no GPU). One driver process sends one request per path in turn (order rotated), one "
             "at a time; added_ms_per_request = median over rounds of the path's latency - UDP's. The shm paths "
             "register their regions once and read the output back from its region inside the timed call.")
    path = write_result("oip_shm", "cpu", summary, {"paired": paired["latency_ms"], "stages": stages},
                        notes=notes, name=args.name if args.name != "oip" else "oip_shm", load_avg_before=load_before,
                        out_dir=args.out_dir)
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
