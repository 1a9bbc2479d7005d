"""bench/model_inside: why the same model runs slower inside an instance than in a plain loop.

Each variant is a spawned process pinned to the core an instance at GPU_PCT gets, with the model
loaded and warmed; the variants take turns, one batch-1 call each per round in a slot of SLOT_S, so the
machine's load falls on all of them alike and each call finds the core idle before it, as a call
paced like bench/e2e's low-load traffic (RATE) does. A variant is the plain loop of bench/e2e (`paced_model_ms`) with some of the instance's
settings switched on:

- ``env``: the share's environment before torch is imported (OMP/MKL threads, OMP_WAIT_POLICY=PASSIVE)
  and ``apply_cpu_share`` (affinity, intra- and inter-op threads), as the instance starts;
- ``shm``: the weights moved into POSIX shared memory (Param-Share's export, which a node's first
  instance of a model does);
- ``image``: the traffic tool's request body (a real image) instead of uniform random input;
- ``buffer``: each request copied into the preallocated max-batch buffer and the model run on its
  first row (the host gatherer's path) instead of one tensor reused;
- ``warm``: the instance's warm-up (batch 1, max/2 and max, one discarded and one timed run each)
  instead of three calls at batch 1;
- ``denormal``: ``torch.set_flush_denormal(True)``;
- ``runner``: the instance's ModelRunner (inference_mode entered per call) and its timer (model
  call only, not the logits' copy to numpy);
- ``tick``: during the call, another process on the same core wakes every millisecond, as the node's
  ingest thread does for its timeouts when nothing keeps it off the instance's core (the node process
  is not pinned); it is stopped (SIGSTOP) outside this variant's calls.

``instance`` has all of them but ``denormal`` (the instance as it was); ``instance-fixed`` is what the
instance now does. Run: ``python -m bench.model_inside [--quick]``. Reports, never asserts.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np

from bench.common import load_note, percentiles, write_result
from gpuprims.cpushare import CpuShare, plan_cpu_shares

SHAPE = (3, 64, 64)
GPU_PCT = 50
MAX_BATCH = 8
RATE = 10.0
#: Each call gets a slot this long (a MobileNetV2 call takes ~10 ms), so the core idles between calls.
SLOT_S = 0.02
FACTORS = ("env", "shm", "image", "buffer", "warm", "denormal", "runner", "tick")
INSTANCE = ("env", "shm", "image", "buffer", "warm", "runner")


def variants() -> dict[str, tuple[str, ...]]:
    """Name -> the factors it switches on: plain, plain + each factor, the instance, the instance minus each."""
    out: dict[str, tuple[str, ...]] = {"plain": ()}
    for f in FACTORS:
        out[f"plain+{f}"] = (f,)
    out["instance"] = INSTANCE
    for f in INSTANCE:
        out[f"instance-{f}"] = tuple(x for x in INSTANCE if x != f)
    out["instance+denormal"] = (*INSTANCE, "denormal")
    return out


def _child(model_name: str, factors: tuple[str, ...], cores: list[int], threads: int, conn: Any) -> None:
    """One variant: set up, then answer each ``n`` on the pipe with n timed calls (ms)."""
    share = CpuShare(cores=cores, threads=threads, gpu_pct=GPU_PCT)
    if "env" in factors:
        os.environ.update(share.env())
    import torch

    from apps.zoo import load_model
    from gpuprims.cpushare import apply_cpu_share
    from gpuprims.cuda.ipc import export_parameters
    from gpuprims.device import warm_up
    from gpuprims.gather import ModelRunner, preprocess
    from gpuprims.traffic.images import request_body

    if "env" in factors:
        apply_cpu_share(share)
    else:  # what bench/serving.pinned does
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)
    if "denormal" in factors:
        torch.set_flush_denormal(True)
    model = load_model(model_name, seed=0, input_shape=SHAPE).eval()
    keep: Any = None
    if "shm" in factors:
        keep = export_parameters(model)
    if "image" in factors:
        body = np.asarray(request_body(SHAPE, "float32"), np.float32).reshape(1, *SHAPE)
    else:
        body = np.random.default_rng(0).random((1, *SHAPE), dtype=np.float32)
    buf = torch.empty((MAX_BATCH, *SHAPE))
    x = torch.from_numpy(body.copy())
    runner = ModelRunner("cpu")
    if "warm" in factors:
        warm_up(model, SHAPE, sorted({1, MAX_BATCH // 2, MAX_BATCH}), "cpu", repeats=1, discard=1)
    else:
        with torch.inference_mode():
            for _ in range(3):
                model(x)

    def once() -> float:
        if "buffer" in factors:
            buf[:1].copy_(torch.from_numpy(body))
            inp = preprocess(buf[:1], "float32")
        else:
            inp = x
        if "runner" in factors:
            t = time.perf_counter_ns()
            out = runner.run(model, inp)
            ms = (time.perf_counter_ns() - t) / 1e6
            out.float().cpu().numpy()
            return ms
        with torch.inference_mode():
            t = time.perf_counter_ns()
            model(inp).float().cpu().numpy()
            return (time.perf_counter_ns() - t) / 1e6

    ticker = None
    if "tick" in factors:
        code = (f"import os, time\nos.sched_setaffinity(0, {cores!r})\n"
                "while True:\n    time.sleep(0.001)\n")
        ticker = subprocess.Popen([sys.executable, "-c", code])
        time.sleep(0.5)
        ticker.send_signal(signal.SIGSTOP)
    conn.send("ready")
    try:
        while True:
            n = conn.recv()
            if n is None:
                break
            if ticker is not None:
                ticker.send_signal(signal.SIGCONT)
                time.sleep(0.002)
            got = [once() for _ in range(n)]
            if ticker is not None:
                ticker.send_signal(signal.SIGSTOP)
            conn.send(got)
    finally:
        if ticker is not None:
            ticker.kill()
            ticker.wait()
    del keep


def run(model_name: str, rounds: int, names: list[str]) -> dict[str, Any]:
    s = plan_cpu_shares([("app-0", GPU_PCT)])["app-0"]
    cores, threads = list(s.cores), s.threads
    table = variants()
    ctx = mp.get_context("spawn")
    kids: dict[str, tuple[Any, Any]] = {}
    try:
        for name in names:
            a, b = ctx.Pipe()
            p = ctx.Process(target=_child, args=(model_name, table[name], cores, threads, b), daemon=True)
            p.start()
            kids[name] = (p, a)
        for name, (_p, conn) in kids.items():
            if not conn.poll(300):
                raise TimeoutError(f"variant {name} did not start within 300 s")
            conn.recv()
        samples: dict[str, list[float]] = {n: [] for n in names}
        order = list(names)
        rng = np.random.default_rng(0)
        nxt = time.perf_counter()
        for r in range(rounds):
            rng.shuffle(order)  # no variant always runs right after the same one
            for name in order:
                nxt = max(nxt + SLOT_S, time.perf_counter())
                time.sleep(max(0.0, nxt - time.perf_counter()))
                conn = kids[name][1]
                conn.send(1)
                samples[name] += conn.recv()
            if r % 50 == 49:
                print(f"  round {r + 1}/{rounds}", flush=True)
    finally:
        for p, conn in kids.values():
            try:
                conn.send(None)
            except OSError:
                pass
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return {"cores": cores, "threads": threads, "samples": samples}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    ap.add_argument("--model", default="mobilenet_v2")
    ap.add_argument("--variants", default=None, help="comma-separated subset of: " + ", ".join(variants()))
    args = ap.parse_args()
    names = args.variants.split(",") if args.variants else list(variants())
    unknown = [n for n in names if n not in variants()]
    if unknown:
        ap.error(f"unknown variants {unknown}")
    load_before = os.getloadavg()
    res = run(args.model, 60 if args.quick else 150, names)
    base = float(np.median(res["samples"]["plain"])) if "plain" in res["samples"] else None
    summary: dict[str, Any] = {"model": args.model, "rate_rps": RATE, "rounds": len(next(iter(res["samples"].values())))}
    for name, v in res["samples"].items():
        p = percentiles(np.asarray(v))
        summary[f"{name}.p50_ms"] = round(p["p50"], 3)
        summary[f"{name}.p99_ms"] = round(p["p99"], 3)
        if base:
            summary[f"{name}.ratio_to_plain"] = round(p["p50"] / base, 3)
    notes = ("Each variant a process pinned to the instance's core; variants interleaved one call each per round, "
             f"each call in a {SLOT_S * 1e3:.0f} ms slot, so the core idles between calls. ratio_to_plain = "
             "p50 / plain's p50. Shared 2-core machine: see the load average.")
    path = write_result("model_inside", "cpu", summary, {"cores": res["cores"], "threads": res["threads"],
                                                         "ms": res["samples"]}, notes=notes + load_note(load_before), load_avg_before=load_before)
    print(path)
    for k, v in summary.items():
        print(f"{k:>40}: {v}")


if __name__ == "__main__":
    main()
