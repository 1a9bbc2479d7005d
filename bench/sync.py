"""Sync-lite vs blocking synchronize vs host callback (paper V-A, Fig. 6).

    python3 -m bench.sync [--quick] [--backend auto|cpu|cuda]

For AlexNet and ResNet-50 at batch 1, back-to-back inferences with each completion scheme; per
scheme: p50/p99 latency, CPU time of the calling thread per inference (and, on CUDA, the part left
after the launch cost, i.e. the waiting), CPU time of the whole process, and the device's idle time
per inference (wall period minus the model's busy time, from CUDA events around the model).

CUDA: each schedule flag (cudaDeviceScheduleAuto, Spin, BlockingSync) needs a fresh context, so each
runs in its own spawn process. CPU: the model runs on a CpuStream worker thread and the schemes wait
for it; there are no schedule flags, and the models run at reduced width (said in the JSON).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import percentiles, write_result
from gpuprims.backend import resolve_backend

MODELS = ("alexnet", "resnet50")
PAPER_P99_MS = {"alexnet": {"sync_lite": 3.2, "callback": 3.8, "synchronize": 4.17}}

# scheme name -> how to call it
SCHEMES = ("sync_lite", "sync_lite_adaptive", "synchronize_stream", "synchronize_device", "synchronize_event_blocking",
           "callback")
GROUPS_CUDA: dict[str, tuple[str, ...]] = {
    "auto": SCHEMES,
    "spin": ("synchronize_stream", "synchronize_device"),
    "blocking_sync": ("synchronize_stream", "synchronize_device"),
}


def _call(scheme: str, model: Any, x: Any, adaptive: Any) -> Any:
    from gpuprims.cuda import sync_blocking, sync_callback, sync_lite

    if scheme == "sync_lite":
        return sync_lite(model, x, interval_us=100)
    if scheme == "sync_lite_adaptive":
        return sync_lite(model, x, adaptive=adaptive)
    if scheme == "synchronize_stream":
        return sync_blocking(model, x, how="stream")
    if scheme == "synchronize_device":
        return sync_blocking(model, x, how="device")
    if scheme == "synchronize_event_blocking":
        return sync_blocking(model, x, how="event")
    if scheme == "callback":
        return sync_callback(model, x)
    raise ValueError(scheme)


class Timed:
    """Wraps a model and records how long the device is busy with each call."""

    def __init__(self, model: Any, cuda: bool) -> None:
        self.model = model
        self.cuda = cuda
        self.marks: list[Any] = []

    def __call__(self, x: Any) -> Any:
        import torch

        if self.cuda:
            s = torch.cuda.current_stream(x.device)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(s)
            out = self.model(x)
            e1.record(s)
            self.marks.append((e0, e1))
            return out
        t0 = time.perf_counter_ns()
        out = self.model(x)
        self.marks.append((time.perf_counter_ns() - t0) / 1e3)
        return out

    def busy_us(self) -> list[float]:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            return [e0.elapsed_time(e1) * 1e3 for e0, e1 in self.marks]
        return list(self.marks)


def run_group(backend: str, name: str, width: float, schedule: str, schemes: tuple[str, ...],
              iters: int) -> dict[str, Any]:
    """Measure `schemes` for one model in this process; on CUDA first set the schedule flag."""
    import torch

    from apps.zoo import build_model
    from gpuprims.cuda import AdaptiveWait

    cuda = backend == "cuda"
    if cuda:
        from gpuprims.cuda import runtime

        runtime.set_schedule(0, schedule)  # before torch creates the context
    dev = "cuda:0" if cuda else "cpu"
    model = build_model(name, width=width, device=dev)
    x = torch.randn(1, 3, 224, 224, device=dev)
    with torch.no_grad():
        ref = model(x)
    out: dict[str, Any] = {}
    if cuda:
        # Launch cost alone: what the calling thread spends before any waiting.
        launch = []
        with torch.no_grad():
            for _ in range(iters):
                c0 = time.thread_time_ns()
                model(x)
                launch.append((time.thread_time_ns() - c0) / 1e3)
                torch.cuda.synchronize()
        out["launch_cpu_us"] = launch
    for scheme in schemes:
        timed = Timed(model, cuda)
        adaptive = AdaptiveWait()
        for _ in range(max(5, iters // 10)):
            _call(scheme, timed, x, adaptive)
        timed.marks.clear()
        wall, tcpu, pcpu = [], [], []
        for _ in range(iters):
            c0, p0, w0 = time.thread_time_ns(), time.process_time_ns(), time.perf_counter_ns()
            y = _call(scheme, timed, x, adaptive)
            w1, p1, c1 = time.perf_counter_ns(), time.process_time_ns(), time.thread_time_ns()
            wall.append((w1 - w0) / 1e3)
            tcpu.append((c1 - c0) / 1e3)
            pcpu.append((p1 - p0) / 1e3)
        busy = timed.busy_us()
        key = f"{scheme}@{schedule}" if cuda else scheme
        out[key] = {"latency_us": wall, "thread_cpu_us": tcpu, "process_cpu_us": pcpu, "busy_us": busy,
                    "same_output": bool(torch.allclose(y, ref, rtol=1e-4, atol=1e-5))}
    return out


def _child(args: tuple[Any, ...], q: Any) -> None:
    try:
        q.put(run_group(*args))
    except Exception as exc:
        q.put({"error": repr(exc)})


def run_spawned(args: tuple[Any, ...], timeout_s: float = 900) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(args, q))
    p.start()
    try:
        res = q.get(timeout=timeout_s)
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()
            p.join()
    if "error" in res:
        raise RuntimeError(f"sync bench child failed: {res['error']}")
    return res


def summarise(name: str, res: dict[str, Any], cuda: bool) -> dict[str, Any]:
    s: dict[str, Any] = {}
    launch = float(np.median(res["launch_cpu_us"])) if cuda else 0.0
    for key, r in res.items():
        if key == "launch_cpu_us":
            continue
        tag = key.replace("@", "_")
        lat = percentiles(np.asarray(r["latency_us"]) / 1e3)
        s[f"{name}_{tag}_p50_ms"] = lat["p50"]
        s[f"{name}_{tag}_p99_ms"] = lat["p99"]
        tcpu = float(np.median(r["thread_cpu_us"]))
        s[f"{name}_{tag}_cpu_us_per_inference"] = tcpu
        s[f"{name}_{tag}_wait_cpu_us_per_inference"] = max(0.0, tcpu - launch)
        s[f"{name}_{tag}_process_cpu_us_per_inference"] = float(np.median(r["process_cpu_us"]))
        idle = np.asarray(r["latency_us"]) - np.asarray(r["busy_us"][:len(r["latency_us"])])
        s[f"{name}_{tag}_gpu_idle_us_per_inference"] = float(np.median(idle))
        s[f"{name}_{tag}_same_output"] = r["same_output"]
    sfx = "_auto" if cuda else ""
    # The summary key names of CONTRIBUTING.md (Benchmarks): synchronize = stream synchronize with the default schedule.
    for short, full in (("sync_lite", f"sync_lite{sfx}"), ("synchronize", f"synchronize_stream{sfx}"),
                        ("callback", f"callback{sfx}")):
        s[f"{name}_{short}_p99_ms"] = s[f"{name}_{full}_p99_ms"]
        s[f"{name}_{short}_cpu_us_per_inference"] = s[f"{name}_{full}_cpu_us_per_inference"]
    baselines = [k for k in s if k.startswith(f"{name}_synchronize_") and k.endswith("_p99_ms")
                 and k != f"{name}_synchronize_p99_ms"] + [f"{name}_callback_p99_ms"]
    s[f"{name}_best_baseline_p99_ms"] = min(s[k] for k in baselines)
    spin = f"{name}_synchronize_stream_spin_wait_cpu_us_per_inference" if cuda else \
        f"{name}_synchronize_stream_wait_cpu_us_per_inference"
    s[f"{name}_sync_lite_wait_cpu_pct_of_spin_sync"] = (
        100 * s[f"{name}_sync_lite{sfx}_wait_cpu_us_per_inference"] / max(s[spin], 1e-9))
    return s


def plot(summary: dict[str, Any], models: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    # Measured schemes only (the short names of CONTRIBUTING.md, Benchmarks, are aliases of some of them).
    schemes = sorted({k[len(models[0]) + 1:-len("_gpu_idle_us_per_inference")] for k in summary
                      if k.startswith(models[0] + "_") and k.endswith("_gpu_idle_us_per_inference")})
    x = np.arange(len(schemes))
    for i, m in enumerate(models):
        off = (i - (len(models) - 1) / 2) * 0.8 / len(models)
        for ax, suffix, label in ((axes[0], "_p99_ms", "p99 latency (ms)"),
                                  (axes[1], "_cpu_us_per_inference", "caller CPU us / inference"),
                                  (axes[2], "_gpu_idle_us_per_inference", "device idle us / inference")):
            ax.bar(x + off, [summary.get(f"{m}_{s}{suffix}", 0) for s in schemes], 0.8 / len(models), label=m)
            ax.set_ylabel(label)
    for ax in axes:
        ax.set_xticks(x, schemes, rotation=60, ha="right", fontsize=7)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--width", type=float, default=None, help="model width (default 1.0 on cuda, 0.25 on cpu)")
    ap.add_argument("--iters", type=int, default=None)
    args = ap.parse_args(argv)
    backend = resolve_backend(args.backend)
    print(f"bench.sync: backend {backend}")
    cuda = backend == "cuda"
    width = args.width if args.width is not None else (1.0 if cuda else 0.25)
    iters = args.iters or ((50 if args.quick else 500) if cuda else (8 if args.quick else 30))
    models = [m for m in args.models.split(",") if m]
    summary: dict[str, Any] = {"model_width": width, "batch": 1, "iterations": iters, "sync_lite_interval_us": 100}
    samples: dict[str, Any] = {}
    for name in models:
        if cuda:
            res: dict[str, Any] = {}
            for schedule, schemes in GROUPS_CUDA.items():
                res.update(run_spawned((backend, name, width, schedule, schemes, iters)))
        else:
            res = run_group(backend, name, width, "none", SCHEMES, iters)
        samples[name] = res
        summary.update(summarise(name, res, cuda))
    notes = ("CUDA: latency from perf_counter around each call; caller CPU from thread_time (the wait part is "
             "that minus the launch-only CPU); device idle = wall per call minus CUDA-event busy time of the "
             "model; schedule flags in separate spawn processes.")
    if not cuda:
        from gpuprims.cuda.sync import default_cpu_stream

        default_cpu_stream().close()
        notes = ("backend: cpu (no GPU): the model runs on a CpuStream worker thread; 'cpu_us_per_inference' is "
                 "the calling thread's CPU time (all of it waiting), 'process_cpu' includes the model's compute; "
                 "device idle = wall per call minus the worker's compute time. No schedule flags on the CPU; "
                 f"models at width {width}.")
    path = write_result("sync", backend, summary, samples, notes=notes, large_samples=True)
    plot(summary, models, path.with_suffix(".png"))
    for k, v in summary.items():
        if any(t in k for t in ("_p99_ms", "cpu_us_per_inference", "pct")) and "process" not in k:
            print(f"  {k}: {v:.4g}" if isinstance(v, float) else f"  {k}: {v}")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
