"""Engines against eager: latency, sustainable rate, build time (cold and cached) and memory (issue 23).

    python -m bench.engines [--quick] [--engines eager,onnxruntime,openvino,compile] [--cases ...] [--runs N]
                            [--name STEM]

For MobileNetV2 3x64x64 and 3x224x224 and ResNet-50 3x224x224, at batch 1 and max batch, with one and
two threads, each engine in its own child process (pinned to as many cores as it has threads, so RSS and
threads are its own):

- ``build_cold_ms``: prepare() with an empty engine cache (export, optimization, compilation...);
  ``build_cached_ms``: prepare() in a fresh process with the cache the cold build filled (what a restart
  or a change of share costs);
- ``p50_ms`` / ``p99_ms`` of back-to-back runs of one batch (after warm-up);
- ``rate_rps``: the best sustainable rate of one instance, batch / p50 at that batch (back-to-back
  full batches are the most a closed loop can serve);
- ``rss_mb``: the child's peak resident set after building and running;
- ``speedup`` (eager p50 / engine p50) and ``rate_ratio`` (engine rate / eager rate), same run.

Writes bench/results/<machine>/engines.json (BENCH.md) and engines.png. It reports; it asserts no speed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, load_note, percentiles, write_result

CASES: dict[str, tuple[str, tuple[int, int, int], int]] = {
    "mobilenet_v2_64": ("mobilenet_v2", (3, 64, 64), 8),
    "mobilenet_v2_224": ("mobilenet_v2", (3, 224, 224), 4),
    "resnet50_224": ("resnet50", (3, 224, 224), 4),
}
ENGINES = ("eager", "onnxruntime", "openvino", "compile")
THREADS = (1, 2)
CHILD_TIMEOUT_S = 3600.0


# -- child: one engine, one case, one thread count ----------------------------------------------------------
def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Build (cold or cached, as the cache dir finds it) and time one engine; returns the figures."""
    import torch

    from gpuprims.engines import EngineCache, ModelSource, Target, make_engine

    threads = int(spec["threads"])
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)
    model, shape, max_batch = spec["model"], tuple(spec["shape"]), int(spec["max_batch"])
    src = ModelSource(model, shape, max_batch=max_batch)  # type: ignore[arg-type]
    module = src.build_module()
    eng = make_engine(spec["engine"], src, Target("cpu", threads=threads), cache=EngineCache(spec["cache"]))
    t0 = time.perf_counter()
    info = eng.prepare(module)
    prepare_ms = (time.perf_counter() - t0) * 1e3
    out: dict[str, Any] = {"prepare_ms": prepare_ms, "cache_hit": info.cache_hit, "describe": eng.describe()}
    if spec.get("time", True):
        gen = torch.Generator().manual_seed(0)
        for batch in sorted({1, max_batch}):
            x = torch.randn(batch, *shape, generator=gen)
            for _ in range(int(spec["warmup"])):
                eng.run(x)
            samples = []
            for _ in range(int(spec["runs"])):
                t = time.perf_counter_ns()
                eng.run(x)
                samples.append((time.perf_counter_ns() - t) / 1e6)
            out[f"batch{batch}"] = samples
    out["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    eng.close()
    return out


def _run_child(spec: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.engines", "--child", json.dumps(spec)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": f"exit {proc.returncode}: {tail}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- parent --------------------------------------------------------------------------------------------------
def measure(cases: list[str], engines: list[str], threads: list[int], runs: int, warmup: int,
            progress: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    summary: dict[str, Any] = {}
    samples: dict[str, Any] = {}
    for case in cases:
        model, shape, max_batch = CASES[case]
        for engine in engines:
            with tempfile.TemporaryDirectory(prefix="gpuprims-bench-engines-") as cache:
                base = {"engine": engine, "model": model, "shape": list(shape), "max_batch": max_batch,
                        "cache": cache, "runs": runs, "warmup": warmup}
                cold = _run_child({**base, "threads": threads[0], "time": False})
                if "error" in cold:
                    summary[f"{case}_{engine}_error"] = cold["error"]
                    if progress:
                        print(f"{case} {engine}: {cold['error']}", flush=True)
                    continue
                summary[f"{case}_{engine}_build_cold_ms"] = round(cold["prepare_ms"], 1)
                for t in threads:
                    res = _run_child({**base, "threads": t})  # the cache is warm now: a cached build
                    key = f"{case}_{engine}_t{t}"
                    if "error" in res:
                        summary[f"{key}_error"] = res["error"]
                        continue
                    summary[f"{key}_build_cached_ms"] = round(res["prepare_ms"], 1)
                    summary[f"{key}_cache_hit"] = res["cache_hit"]
                    summary[f"{key}_rss_mb"] = round(res["rss_mb"], 1)
                    for b in sorted({1, max_batch}):
                        p = percentiles(res[f"batch{b}"], (50, 99))
                        summary[f"{key}_b{b}_p50_ms"] = round(p["p50"], 3)
                        summary[f"{key}_b{b}_p99_ms"] = round(p["p99"], 3)
                        summary[f"{key}_b{b}_rate_rps"] = round(b / p["p50"] * 1e3, 1)
                        samples[f"{key}_b{b}_ms"] = [round(s, 4) for s in res[f"batch{b}"]]
                    if progress:
                        print(f"{case} {engine} t{t}: p50 b1 {summary[f'{key}_b1_p50_ms']} ms, "
                              f"b{max_batch} {summary[f'{key}_b{max_batch}_p50_ms']} ms, "
                              f"cold {summary[f'{case}_{engine}_build_cold_ms']:.0f} ms, "
                              f"cached {summary[f'{key}_build_cached_ms']:.0f} ms", flush=True)
        for engine in engines:
            for t in threads:
                for b in sorted({1, max_batch}):
                    ref = summary.get(f"{case}_eager_t{t}_b{b}_p50_ms")
                    got = summary.get(f"{case}_{engine}_t{t}_b{b}_p50_ms")
                    if engine != "eager" and ref and got:
                        summary[f"{case}_{engine}_t{t}_b{b}_speedup"] = round(ref / got, 2)
                        summary[f"{case}_{engine}_t{t}_b{b}_rate_ratio"] = round(
                            summary[f"{case}_{engine}_t{t}_b{b}_rate_rps"] / summary[f"{case}_eager_t{t}_b{b}_rate_rps"], 2)
    return summary, samples


def plot(summary: dict[str, Any], cases: list[str], engines: list[str], threads: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(threads), figsize=(6 * len(threads), 4), squeeze=False)
    for ax, t in zip(axes[0], threads):
        labels, width = [], 0.8 / max(1, len(engines))
        for i, case in enumerate(cases):
            max_batch = CASES[case][2]
            for j, b in enumerate(sorted({1, max_batch})):
                labels.append(f"{case}\nbatch {b}")
                x = i * 2 + j if max_batch > 1 else i * 2
                for k, engine in enumerate(engines):
                    v = summary.get(f"{case}_{engine}_t{t}_b{b}_p50_ms")
                    if v:
                        ax.bar(x + k * width, v, width, color=f"C{k}", label=engine if (i, j) == (0, 0) else None)
        ax.set_xticks([i * 2 + j + 0.4 - width / 2 for i, c in enumerate(cases) for j in range(len({1, CASES[c][2]}))])
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("p50 latency per batch (ms, log)")
        ax.set_title(f"{t} thread(s)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> Path | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="MobileNetV2 3x64x64, one thread, eager and onnxruntime, "
                                                          "a few runs: checks the script, measures nothing")
    ap.add_argument("--engines", default=None, help=f"comma-separated (default {','.join(ENGINES)})")
    ap.add_argument("--cases", default=None, help=f"comma-separated (default {','.join(CASES)})")
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--name", default=None, help="result file stem (default engines): a partial run kept apart")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child))))
        return None
    engines = args.engines.split(",") if args.engines else (["eager", "onnxruntime"] if args.quick else list(ENGINES))
    cases = args.cases.split(",") if args.cases else (["mobilenet_v2_64"] if args.quick else list(CASES))
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    threads = [1] if args.quick else list(THREADS)
    runs = args.runs or (5 if args.quick else 200)
    warmup = 2 if args.quick else 20
    load_before = os.getloadavg()
    summary, samples = measure(cases, engines, threads, runs, warmup)
    summary.update(runs=runs, warmup=warmup, engines=engines,
                   cases={c: {"model": CASES[c][0], "shape": list(CASES[c][1]), "max_batch": CASES[c][2]}
                          for c in cases})
    notes = ("rate_rps = batch / p50 of back-to-back runs at that batch; speedup = eager p50 / engine p50 in the "
             "same run; build_cached_ms = prepare() in a fresh process on the cache the cold build filled."
             + (" QUICK RUN: a script check, not a measurement." if args.quick else "") + load_note(load_before))
    path = write_result("engines", "cpu", summary, samples, notes=notes, load_avg_before=load_before,
                        large_samples=not args.quick, name=args.name)
    plot(summary, cases, engines, threads, path.with_suffix(".png"))
    print(path)
    return path


if __name__ == "__main__":
    main()
