"""bench/e2e: the framework's added latency, and throughput at the SLO vs a plain torch server.

Per model (MobileNetV2 and ResNet-50, 3x64x64 float32 requests of 48 datagrams, one app at gpu_pct
50, which on the CPU backend is one core of two; the node's ingest, the client and this process use
the other):

- **added latency**: a constant 10 requests/s through the node (one request at a time, so batch 1),
  the client-measured end-to-end latency minus the model's own latency at batch 1, measured directly in
  torch in this process on the same core with the same thread count, called at the same pace (one call
  per 1/rate s: a back-to-back loop keeps caches and clocks warmer than serving does). Also reported:
  end-to-end minus the model time the instance itself measured around its model call, and the
  back-to-back model time.
- **throughput at the SLO**: constant-rate traffic stepped up from half the model's estimated capacity
  (x1.2 per step) until two steps in a row miss 99 % SLO attainment; the highest rate held (attainment
  >= 99 %, answered OK within the SLO) through the node (max_batch 8, no batching wait) vs a plain
  single-process Python server fed by the same traffic: it receives datagrams, reassembles requests with
  ``gpuprims.wire``, batches whatever is queued up to 8, runs the model and answers, pinned to the same
  core with the same torch threads.

Engines (issue 23): ``--engine onnxruntime`` (or ``openvino``) runs the node's app on that ``engine:`` and
every model-alone reference on the very same engine (gpuprims' engine, built from the same model into the
same engine cache): the paced and back-to-back model times, the batch-8 capacity and the plain server's
model. So ``added_*`` is still the framework's own cost around the model, now around a 0.3 ms one, and
the result is written as ``e2e-<engine>.json``.

Run: ``python3 -m bench.e2e [--quick] [--engine eager|onnxruntime|openvino]``. Reports, never asserts.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import select
import socket
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from bench import serving as sv
from bench.common import load_note, percentiles, write_result
from gpuprims import wire
from gpuprims.cpushare import plan_cpu_shares

SHAPE = (3, 64, 64)
GPU_PCT = 50
MAX_BATCH = 8
LOW_RATE = 10.0
MODELS = {"mobilenet_v2": {"slo_ms": 100.0}, "resnet50": {"slo_ms": 250.0}}
STEP = 1.2
#: How many times a sweep whose every step failed halves its start rate looking for one that holds.
HALVINGS = 5
#: Low-load segments, alternating traffic through the node with the model alone (the same pace).
SEGMENTS = 6


def load_runner(model_name: str, engine: str, threads: int, cache: str | None = None) -> Any:
    """The model as the instance runs it: the torch module (eager) or gpuprims' prepared engine of that kind.

    Either is called on a torch batch and returns a torch tensor. Call it on the cores and threads it is
    measured on (the engine takes ``threads`` at build).
    """
    from apps.zoo import load_model

    if engine == "eager":
        return load_model(model_name, seed=0, input_shape=SHAPE).eval()
    from gpuprims.engines import EngineCache, ModelSource, Target, make_engine

    runner = make_engine(engine, ModelSource(model_name, SHAPE, MAX_BATCH, seed=0),  # type: ignore[arg-type]
                         Target("cpu", threads=threads), cache=EngineCache(cache))
    runner.prepare()
    return runner


def model_latency_ms(model_name: str, engine: str, batch: int, *, cores: list[int], threads: int, reps: int
                     ) -> np.ndarray:
    """`sv.torch_latency_ms` on `engine`: back-to-back latency (ms) at `batch` on `cores` with `threads`."""
    if engine == "eager":
        return sv.torch_latency_ms(model_name, SHAPE, batch, cores=cores, threads=threads, reps=reps)
    with sv.pinned(cores, threads):
        return sv.model_latency_ms(load_runner(model_name, engine, threads), SHAPE, batch, reps=reps)


def share() -> tuple[list[int], int]:
    """The cores and threads the node gives one instance at GPU_PCT (as the instance would get them)."""
    s = plan_cpu_shares([("app-0", GPU_PCT)])["app-0"]
    return list(s.cores), s.threads


# -- the plain torch server ------------------------------------------------------------------------
def _baseline_server(model_name: str, cores: list[int], threads: int, max_batch: int, q: Any, stop: Any,
                     engine: str = "eager") -> None:
    """Child process: one UDP socket, Python reassembly, batch what is queued, run, answer."""
    os.sched_setaffinity(0, cores)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    model = load_runner(model_name, engine, threads)
    row_bytes = int(np.prod(SHAPE)) * 4
    with torch.inference_mode():
        for b in (1, max_batch):
            model(torch.zeros((b, *SHAPE)))
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, 33, 32 << 20)  # SO_RCVBUFFORCE where permitted
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 20)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    q.put(sock.getsockname()[1])
    partial: dict[tuple[int, int], tuple[wire.Header, bytearray, int]] = {}
    ready: deque[tuple[wire.Header, bytearray, Any]] = deque()
    served = 0
    buf = bytearray(65536)
    while not stop.is_set():
        # Take every datagram the socket holds; block briefly only when there is nothing to run.
        while True:
            try:
                n, addr = sock.recvfrom_into(buf)
            except BlockingIOError:
                break
            try:
                h, payload = wire.decode_request(memoryview(buf)[:n])
            except wire.WireError:
                continue
            key = (h.app_id, h.request_id)
            entry = partial.get(key)
            if entry is None:
                entry = (h, bytearray(h.total_len), 0)
            hdr0, body, got = entry
            stride = wire.chunk_stride(h)
            off = h.chunk_index * stride
            body[off:off + h.payload_len] = payload
            got += 1
            if got == h.chunk_count:
                partial.pop(key, None)
                ready.append((hdr0, body, addr))
            else:
                partial[key] = (hdr0, body, got)
        if not ready:
            select.select([sock], [], [], 0.02)
            continue
        batch = [ready.popleft() for _ in range(min(max_batch, len(ready)))]
        batch = [b for b in batch if len(b[1]) == row_bytes]
        if not batch:
            continue
        x = torch.from_numpy(np.concatenate([np.frombuffer(b[1], np.float32) for b in batch]).reshape(len(batch), *SHAPE))
        with torch.inference_mode():
            logits = model(x).float().cpu().numpy().reshape(len(batch), -1)
        for (h, _body, addr), row in zip(batch, logits):
            for d in wire.encode_response(h.app_id, h.request_id, wire.Status.OK, row, client_ts_ns=h.client_ts_ns):
                sock.sendto(d, addr)
        served += len(batch)
    sock.close()
    q.put(served)


class BaselineServer:
    """The plain server in a spawned process; `port` once it has loaded and warmed its model."""

    def __init__(self, model_name: str, cores: list[int], threads: int, engine: str = "eager") -> None:
        ctx = mp.get_context("spawn")
        self.q: Any = ctx.Queue()
        self.stop_ev = ctx.Event()
        self.p = ctx.Process(target=_baseline_server,
                             args=(model_name, cores, threads, MAX_BATCH, self.q, self.stop_ev, engine), daemon=True)
        self.p.start()
        self.port = int(self.q.get(timeout=120))

    def close(self) -> None:
        self.stop_ev.set()
        self.p.join(timeout=10)
        if self.p.is_alive():
            self.p.kill()
            self.p.join()


# -- measurements -----------------------------------------------------------------------------------
def paced_model_ms(model_name: str, cores: list[int], threads: int, n: int, rate: float, engine: str = "eager",
                   model: Any = None) -> np.ndarray:
    """The model's own batch-1 latency, one call per 1/rate s (the pace of the low-load traffic).

    `model`: an already loaded runner (`load_runner`) to reuse, else one is loaded.
    """
    import torch

    with sv.pinned(cores, threads):
        if model is None:
            model = load_runner(model_name, engine, threads)
        x = torch.from_numpy(np.random.default_rng(0).random((1, *SHAPE), dtype=np.float32))
        out = np.empty(n)
        with torch.inference_mode():
            for _ in range(3):
                model(x)
            nxt = time.perf_counter()
            for i in range(n):
                nxt += 1.0 / rate
                time.sleep(max(0.0, nxt - time.perf_counter()))
                t = time.perf_counter_ns()
                model(x).float().cpu().numpy()
                out[i] = (time.perf_counter_ns() - t) / 1e6
    return out


def sweep(send: Any, slo_ms: float, start_rps: float, steps: int, duration_s: float, label: str) -> list[dict[str, Any]]:
    """Constant rates start_rps * STEP**k until two in a row miss 99 % attainment (or `steps` are done).

    If none held, halves start_rps (up to HALVINGS times) until one does.
    """
    out: list[dict[str, Any]] = []

    def step(rate: float) -> bool:
        st = send(rate, duration_s)
        st["rate_rps"] = rate
        st["held"] = bool(st["slo_attainment"] is not None and st["slo_attainment"] >= 0.99)
        print(f"  {label:>9} {rate:7.1f} req/s: attainment {st['slo_attainment']}, p99 {st['p99_ms']} ms", flush=True)
        out.append(st)
        return st["held"]

    fails = 0
    for k in range(steps):
        fails = 0 if step(round(start_rps * STEP ** k, 1)) else fails + 1
        if fails == 2:
            break
    # Nothing held from the start (e.g. the plain server's Python receive path far below an engine's model
    # capacity): halve down until a rate holds, so the figure is the held rate, not 0.
    rate = start_rps
    for _ in range(HALVINGS):
        if any(s["held"] for s in out):
            break
        rate = round(rate / 2, 1)
        step(rate)
    return out


def best_rate(steps: list[dict[str, Any]]) -> float:
    held = [s["rate_rps"] for s in steps if s["held"]]
    return max(held) if held else 0.0


def run_model(model_name: str, slo_ms: float, quick: bool, engine: str = "eager"
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    cores, threads = share()
    # This process (the node's control loop, its ingest thread and the traffic client, which all
    # inherit this thread's affinity) stays off the instance's cores, as the setup above says; the
    # model-alone measurements pin themselves to the instance's cores for their duration.
    free = sorted(set(os.sched_getaffinity(0)) - set(cores))
    with sv.pinned(free or cores, threads):
        return _run_model(model_name, slo_ms, quick, cores, threads, engine)


def _run_model(model_name: str, slo_ms: float, quick: bool, cores: list[int], threads: int, engine: str = "eager"
               ) -> tuple[dict[str, Any], dict[str, Any]]:
    segments = 2 if quick else SEGMENTS
    seg_s = (4.0 if quick else 16.0) / segments
    step_s = 1.5 if quick else 3.0
    steps = 3 if quick else 6
    n_seg = int(LOW_RATE * seg_s)
    timeout_s = max(1.0, 2 * slo_ms / 1e3)

    # The model alone, on the instance's core share, back to back (the paced figure is taken below,
    # interleaved with the traffic through the node).
    model_b2b = model_latency_ms(model_name, engine, 1, cores=cores, threads=threads, reps=n_seg * segments)
    model_b8 = model_latency_ms(model_name, engine, MAX_BATCH, cores=cores, threads=threads, reps=5 if quick else 10)
    cap_rps = MAX_BATCH * 1e3 / float(np.median(model_b8))
    start = cap_rps * 0.5

    app = sv.app("e2e", model_name, 1, shape=SHAPE, slo_ms=slo_ms, gpu_pct=GPU_PCT, max_batch=MAX_BATCH,
                 max_wait_ms=0.0)
    app["engine"] = engine
    cfg = sv.node_config([app])
    with sv.pinned(cores, threads):
        paced_runner = load_runner(model_name, engine, threads)  # loaded once (an engine takes a while)
    with sv.running_node(cfg) as node:
        port = sv.port_of(node)
        # Low load, interleaved: a segment of traffic through the node, then a segment of the model alone
        # paced the same way, so that the machine's load (shared) falls on both alike.
        lows, e2e_parts, paced_parts = [], [], []
        for _ in range(segments):
            rep = sv.drive(node, [sv.stream(1, SHAPE, LOW_RATE, seg_s, port)], timeout_s=timeout_s, slo_ms=slo_ms)
            lows.append(sv.app_stats(rep, 1, slo_ms))
            e2e_parts.append(sv.latencies_ms(rep, 1))
            paced_parts.append(paced_model_ms(model_name, cores, threads, n_seg, LOW_RATE, engine, paced_runner))
        e2e_lat = np.concatenate(e2e_parts)
        model_paced = np.concatenate(paced_parts)
        low = {"sent": sum(x["sent"] for x in lows), "lost": sum(x["lost"] for x in lows), "segments": lows}
        inst = sv.instance_stats(node, "e2e")

        def via_node(rate: float, dur: float) -> dict[str, Any]:
            r = sv.drive(node, [sv.stream(1, SHAPE, rate, dur, port)], timeout_s=timeout_s, slo_ms=slo_ms)
            insts = sv.instance_stats(node, "e2e")["instances"]
            # Batch sizes the instance chose so far (cumulative), to see how it batched near capacity.
            return {**sv.app_stats(r, 1, slo_ms), "batch_sizes_so_far": insts[0]["batch_sizes"] if insts else None}

        node_steps = sweep(via_node, slo_ms, start, steps, step_s, "node")
    server = BaselineServer(model_name, cores, threads, engine)
    try:
        def via_plain(rate: float, dur: float) -> dict[str, Any]:
            r = sv.drive(None, [sv.stream(1, SHAPE, rate, dur, server.port)], timeout_s=timeout_s, slo_ms=slo_ms)
            return sv.app_stats(r, 1, slo_ms)

        plain_steps = sweep(via_plain, slo_ms, start, steps, step_s, "plain")
    finally:
        server.close()

    e2e_p = percentiles(e2e_lat)
    mp_ = percentiles(model_paced)
    inst_model = inst["instances"][0]["model_p50_ms"] if inst["instances"] else None
    stages = (inst["instances"][0].get("stages") or {}) if inst["instances"] else {}
    per_stage = {f"stage_{k}_{q}": v[q] for k, v in stages.items() if isinstance(v, dict) for q in ("p50_ms", "p99_ms")}
    summary = {
        "added_p50_ms": round(e2e_p["p50"] - mp_["p50"], 3),
        "added_p99_ms": round(e2e_p["p99"] - mp_["p99"], 3),
        "model_p50_ms": round(mp_["p50"], 3),
        "model_p99_ms": round(mp_["p99"], 3),
        "model_backtoback_p50_ms": round(float(np.median(model_b2b)), 3),
        "instance_model_p50_ms": round(inst_model, 3) if inst_model is not None else None,
        "instance_model_ratio": round(inst_model / mp_["p50"], 3) if inst_model is not None else None,
        "added_vs_instance_model_p50_ms": round(e2e_p["p50"] - inst_model, 3) if inst_model is not None else None,
        "e2e_p50_ms": round(e2e_p["p50"], 3),
        "e2e_p99_ms": round(e2e_p["p99"], 3),
        "low_load_lost": low["lost"],
        "throughput_rps": best_rate(node_steps),
        "baseline_throughput_rps": best_rate(plain_steps),
        "throughput_ratio": round(best_rate(node_steps) / best_rate(plain_steps), 3) if best_rate(plain_steps) else None,
        "model_b8_p50_ms": round(float(np.median(model_b8)), 3),
        "slo_ms": slo_ms,
        "engine": engine,
        "instance_engine": (inst["instances"][0].get("engine") or {}).get("kind") if inst["instances"] else None,
        **per_stage,
    }
    samples = {"e2e_ms": e2e_lat, "model_paced_ms": model_paced, "model_backtoback_ms": model_b2b,
               "model_b8_ms": model_b8, "low_load": low, "node_instance": inst,
               "node_sweep": node_steps, "plain_sweep": plain_steps, "cores": cores, "threads": threads}
    return summary, samples


def run(quick: bool, models: list[str], engine: str = "eager") -> dict[str, Any]:
    summary: dict[str, Any] = {}
    samples: dict[str, Any] = {}
    for name in models:
        m = MODELS[name]
        print(f"{name}:", flush=True)
        s, smp = run_model(name, m["slo_ms"], quick, engine)
        for k, v in s.items():
            summary[f"{name}.{k}"] = v
        samples[name] = smp
    mob = "mobilenet_v2."
    for k in ("added_p50_ms", "added_p99_ms", "model_p50_ms", "e2e_p50_ms", "e2e_p99_ms", "throughput_rps",
              "baseline_throughput_rps"):
        summary[k] = summary[mob + k]
    summary.update(input_shape="x".join(map(str, SHAPE)), gpu_pct=GPU_PCT, low_rate_rps=LOW_RATE, max_batch=MAX_BATCH,
                   engine=engine)
    return {"summary": summary, "samples": samples}


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    for name, smp in result["samples"].items():
        for key, style, label in (("e2e_ms", "-", "end to end"), ("model_paced_ms", "--", "model alone")):
            x = np.sort(np.asarray(smp[key]))
            ax.plot(x, np.arange(1, len(x) + 1) / len(x), style, label=f"{name} {label}")
    ax.set_xlabel("latency (ms), batch 1, 10 req/s")
    ax.set_ylabel("CDF")
    ax.set_xscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Added latency: end to end vs model alone (1 core)")
    ax = axes[1]
    for name, smp in result["samples"].items():
        for key, style, label in (("node_sweep", "o-", "node"), ("plain_sweep", "s--", "plain torch server")):
            st = smp[key]
            ax.plot([s["rate_rps"] for s in st], [s["slo_attainment"] for s in st], style, label=f"{name} {label}")
    ax.axhline(0.99, color="k", linewidth=0.8, linestyle=":")
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel("SLO attainment")
    ax.set_xscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Throughput at the SLO (attainment >= 99%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _headline(doc: dict[str, Any], source: str) -> dict[str, Any]:
    """The figures of an earlier e2e result worth setting beside a new one."""
    keep = ("added_p50_ms", "added_p99_ms", "model_p50_ms", "model_p99_ms", "model_backtoback_p50_ms",
            "instance_model_p50_ms", "instance_model_ratio", "added_vs_instance_model_p50_ms", "e2e_p50_ms",
            "e2e_p99_ms", "throughput_rps", "baseline_throughput_rps")
    summary = doc.get("summary", {})
    figures = {k: v for k, v in summary.items() if k.split(".", 1)[-1] in keep or k.split(".", 1)[-1].startswith("stage_")}
    return {"source": source, "date": doc.get("date"), "git": doc.get("git"),
            "load_avg_before": doc.get("machine", {}).get("load_avg_before"),
            "load_avg_after": doc.get("machine", {}).get("load_avg_after"), "summary": figures}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs, fewer rate steps")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated, of: " + ", ".join(MODELS))
    ap.add_argument("--before", action="append", default=[], metavar="FILE",
                    help="an earlier e2e.json whose headline figures are kept under 'before' (repeatable)")
    ap.add_argument("--engine", default="eager", choices=["eager", "onnxruntime", "openvino"],
                    help="the app's engine: and the model-alone references' (written as e2e-<engine>.json)")
    args = ap.parse_args()
    models = args.models.split(",")
    if "mobilenet_v2" not in models or any(m not in MODELS for m in models):
        ap.error(f"--models must include mobilenet_v2 and name only {list(MODELS)}")
    load_before = os.getloadavg()
    res = run(args.quick, models, args.engine)
    notes = ("CPU backend (no GPU): the app's gpu_pct 50 is one core of two; the node's native ingest, the traffic "
             "client and this process share the other core. Inputs 3x64x64 float32 (48 datagrams). added_* = "
             "client end-to-end minus the model alone at batch 1 measured in torch in the bench process on the same "
             "core and threads, paced like the traffic (p50 minus p50, p99 minus p99); added_vs_instance_model_p50_ms "
             "uses the model time the instance measured instead. throughput_rps = highest constant rate (steps x1.2 "
             "from half the estimated batch-8 capacity) with >= 99% of requests answered OK within the SLO; "
             "baseline = a single Python process (socket, wire reassembly, batch <= 8, model, answer) pinned to the "
             "same core, so its receive path competes with the model while the node's ingest runs outside the share. "
             "This process (node loop, ingest thread, traffic client) is pinned to the core the instance does not "
             "use. The low-load figures are taken in segments alternating traffic through the node with the model alone "
             "(same pace), so the machine's load falls on both alike; instance_model_ratio = the model time the "
             "instance measured (p50) / the model alone, paced (p50). stage_<s>_p50/p99_ms: the instance's per-batch "
             "breakdown (gpuprims.stats.STAGES) over the low-load batches, warm-up requests included. "
             "Shared 2-core machine: other developers' load adds noise; see the load averages.")
    before = [_headline(json.loads(Path(f).read_text()), f) for f in args.before]
    if args.engine != "eager":
        notes += (f" Engine {args.engine}: the node's app and every model-alone reference (paced, back to back, batch 8, "
                  "the plain server's model) run gpuprims' engine of that kind on the same cores and threads.")
    path = write_result("e2e", "cpu", res["summary"], res["samples"], notes=notes + load_note(load_before),
                        load_avg_before=load_before, name=None if args.engine == "eager" else f"e2e-{args.engine}")
    if before:
        doc = json.loads(path.read_text())
        doc["before"] = before
        path.write_text(json.dumps(doc, indent=1))
    plot(res, str(path.with_suffix(".png")))
    print(path)
    for k, v in res["summary"].items():
        print(f"{k:>45}: {v}")


if __name__ == "__main__":
    main()
