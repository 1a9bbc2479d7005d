"""GPU-DMA vs CUDA-Copy (paper V-B, Table I): CPU time per batch, gather latency, bandwidth, inference.

    python3 -m bench.dma [--quick] [--backend auto|cpu|cuda]

A batch is 8 requests of 224x224x3 float32 (588 datagrams of 1 KiB each, as in the paper) sitting
scattered in a packet pool. For each method it reports the CPU time the calling thread spends per
batch (and an estimate in cycles from the nominal clock), the wall time of the gather, and the
bytes/s achieved against pinned cudaMemcpy host-to-device bandwidth (the limit). The fused variant
(uint8 requests converted to normalised float32 while gathered) is reported beside it. Then batch-8
inference latency of AlexNet, ResNet-50 and VGG-19 with each method (Table I).

On a machine without a GPU it runs the CPU equivalents (native host gather vs gather into a staging
buffer plus a copy; models at reduced width) and says so in the JSON.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import percentiles, write_result
from gpuprims.backend import resolve_backend
from gpuprims.cuda import IMAGENET, PinnedPool, cuda_copy_gather, gpu_dma, sync_lite
from gpuprims.testing.synthetic import SyntheticPool

BATCH = 8
SHAPE = (224, 224, 3)
CHUNK = 1024
PAPER = {"gpu_dma_cycles": 86263, "cuda_copy_cycles": 2506216,
         "table1_ms": {"alexnet": (4.01, 3.67), "resnet50": (10.53, 9.76), "vgg19": (30.95, 30.49)}}


def cpu_mhz() -> float:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return float(line.split(":", 1)[1])
    except (OSError, ValueError):
        pass
    return float("nan")


def fill(dtype: type, seed: int) -> tuple[SyntheticPool, list[int], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    per = -(-int(np.prod(SHAPE)) * np.dtype(dtype).itemsize // CHUNK)
    sp = SyntheticPool(slot_count=BATCH * per + 64, max_payload=CHUNK, record_count=BATCH + 4, max_chunks=per + 1,
                       seed=seed)
    if dtype == np.uint8:
        bodies = [rng.integers(0, 256, size=SHAPE, dtype=np.uint8) for _ in range(BATCH)]
    else:
        bodies = [rng.random(SHAPE, dtype=np.float32) for _ in range(BATCH)]
    recs = [sp.add_request(1, i, b, chunk_payload=CHUNK) for i, b in enumerate(bodies)]
    return sp, recs, bodies


def measure(fn: Any, iters: int) -> dict[str, list[float]]:
    """CPU time of this thread (time.thread_time_ns) and wall time per call, in microseconds."""
    fn()  # warm
    cpu, wall = [], []
    for _ in range(iters):
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        fn()
        w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        cpu.append((c1 - c0) / 1e3)
        wall.append((w1 - w0) / 1e3)
    return {"cpu_us": cpu, "wall_us": wall}


#: GPU clock cycles of torch.cuda._sleep queued before each timed interval (about 1 ms): the host's
#: launch work (planning, the launch call) then happens while the GPU is busy, so the start event
#: fires only when the kernel is already queued behind it and the interval holds GPU work only.
BUSY_CYCLES = 2_000_000


def _gpu_busy() -> None:
    import torch

    torch.cuda._sleep(BUSY_CYCLES)


def gpu_bandwidth(pp: PinnedPool, recs: list[int], out: Any, iters: int, normalize: Any = None) -> list[float]:
    """GB/s of payload bytes the GPU-DMA kernel moved, timed with CUDA events around the kernels only
    (the stream is kept busy while the host launches, see BUSY_CYCLES)."""
    import torch

    from gpuprims.cuda import Event, gpu_dma_async

    s = torch.cuda.current_stream(0)
    start, end = Event(0, timing=True), Event(0, timing=True)
    src_bytes = out.numel() * out.element_size() // (4 if normalize is not None else 1)
    res = []
    for _ in range(iters):
        _gpu_busy()
        start.record(s)
        job = gpu_dma_async(pp.packets(recs), BATCH, out, 0, normalize=normalize)
        end.record(s)
        job.wait()
        end.synchronize()
        res.append(src_bytes / (start.elapsed_time(end) / 1e3) / 1e9)
    return res


def memcpy_bandwidth(nbytes: int, iters: int) -> list[float]:
    """Pinned host -> device cudaMemcpyAsync GB/s, timed with CUDA events."""
    import torch

    from gpuprims.cuda import Event, PinnedBuffer, runtime

    buf = PinnedBuffer(nbytes, mapped=False)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    s = torch.cuda.current_stream(0)
    start, end = Event(0, timing=True), Event(0, timing=True)
    res = []
    for _ in range(iters):
        _gpu_busy()
        start.record(s)
        runtime.cuda().cuda_memcpy_async(dst.data_ptr(), buf.address, nbytes, s.cuda_stream)
        end.record(s)
        end.synchronize()
        res.append(nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
    buf.close()
    return res


def run_gather(backend: str, iters: int) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch

    dev = "cuda:0" if backend == "cuda" else "cpu"
    gpu_id = 0 if backend == "cuda" else None
    summary: dict[str, Any] = {}
    samples: dict[str, Any] = {}
    sp, recs, bodies = fill(np.float32, 0)
    pp = PinnedPool(sp, backend=backend)
    out = torch.empty((BATCH, *SHAPE), dtype=torch.float32, device=dev)
    nbytes = out.numel() * 4
    samples["gpu_dma"] = measure(lambda: gpu_dma(pp.packets(recs), BATCH, out, gpu_id), iters)
    ok = out.cpu().numpy().tobytes() == np.stack(bodies).tobytes()
    samples["cuda_copy"] = measure(lambda: cuda_copy_gather(pp.packets(recs), BATCH, out, gpu_id), iters)
    ok = ok and out.cpu().numpy().tobytes() == np.stack(bodies).tobytes()
    summary["correct"] = ok
    mhz = cpu_mhz()
    for key in ("gpu_dma", "cuda_copy"):
        cpu = float(np.median(samples[key]["cpu_us"]))
        summary[f"{key}_cpu_us_per_batch"] = cpu
        summary[f"{key}_cpu_cycles_per_batch_est"] = cpu * mhz
        summary[f"{key}_gather_p50_us"] = percentiles(samples[key]["wall_us"])["p50"]
        summary[f"{key}_gather_p99_us"] = percentiles(samples[key]["wall_us"])["p99"]
    summary["cpu_ratio"] = summary["cuda_copy_cpu_us_per_batch"] / max(summary["gpu_dma_cpu_us_per_batch"], 1e-9)
    summary["cpu_mhz_nominal"] = mhz
    summary["batch_bytes"] = nbytes
    summary["packets_per_batch"] = BATCH * -(-int(np.prod(SHAPE)) * 4 // CHUNK)

    # The fused variant: uint8 requests -> normalised float32 rows.
    sp8, recs8, _ = fill(np.uint8, 1)
    pp8 = PinnedPool(sp8, backend=backend)
    out8 = torch.empty((BATCH, *SHAPE), dtype=torch.float32, device=dev)
    samples["gpu_dma_fused_u8"] = measure(lambda: gpu_dma(pp8.packets(recs8), BATCH, out8, gpu_id,
                                                          normalize=IMAGENET), iters)
    summary["gpu_dma_fused_u8_cpu_us_per_batch"] = float(np.median(samples["gpu_dma_fused_u8"]["cpu_us"]))
    summary["gpu_dma_fused_u8_gather_p50_us"] = percentiles(samples["gpu_dma_fused_u8"]["wall_us"])["p50"]

    if backend == "cuda":
        samples["gpu_dma_gbps"] = gpu_bandwidth(pp, recs, out, iters)
        samples["gpu_dma_fused_u8_gbps"] = gpu_bandwidth(pp8, recs8, out8, iters, IMAGENET)
        samples["memcpy_h2d_gbps"] = memcpy_bandwidth(nbytes, iters)
    else:
        # Host: bytes placed per second of wall time, against a plain memcpy of the same bytes.
        samples["gpu_dma_gbps"] = [nbytes / (w * 1e3) for w in samples["gpu_dma"]["wall_us"]]
        samples["gpu_dma_fused_u8_gbps"] = [nbytes / 4 / (w * 1e3) for w in samples["gpu_dma_fused_u8"]["wall_us"]]
        src = np.random.default_rng(0).random(nbytes // 4, dtype=np.float32)
        dst = np.empty_like(src)
        samples["memcpy_h2d_gbps"] = [nbytes / (w * 1e3) for w in measure(lambda: np.copyto(dst, src), iters)["wall_us"]]
    for key in ("gpu_dma_gbps", "gpu_dma_fused_u8_gbps", "memcpy_h2d_gbps"):
        summary[key] = float(np.median(samples[key]))
    summary["gpu_dma_pct_of_memcpy"] = 100 * summary["gpu_dma_gbps"] / summary["memcpy_h2d_gbps"]
    pp.close()
    pp8.close()
    sp.close()
    sp8.close()
    return summary, samples


def run_inference(backend: str, models: list[str], width: float, iters: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Table I: batch-8 latency of gather + inference (Sync-lite completion) with each method."""
    import torch

    from apps.zoo import build_model

    dev = "cuda:0" if backend == "cuda" else "cpu"
    gpu_id = 0 if backend == "cuda" else None
    sp, recs, _ = fill(np.float32, 2)
    pp = PinnedPool(sp, backend=backend)
    buf = torch.empty((BATCH, *SHAPE), dtype=torch.float32, device=dev)
    summary: dict[str, Any] = {}
    samples: dict[str, Any] = {}
    for name in models:
        model = build_model(name, width=width, device=dev)

        def infer(gather: Any, model: Any = model) -> None:
            gather(pp.packets(recs), BATCH, buf, gpu_id)
            sync_lite(model, buf.permute(0, 3, 1, 2))

        for method, gather in (("gpu_dma", gpu_dma), ("cuda_copy", cuda_copy_gather)):
            wall = measure(lambda gather=gather: infer(gather), iters)["wall_us"]
            samples[f"{name}_{method}_ms"] = [w / 1e3 for w in wall]
            summary[f"{name}_{method}_latency_ms"] = float(np.median(wall) / 1e3)
        del model
    pp.close()
    sp.close()
    return summary, samples


def plot(summary: dict[str, Any], models: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    keys = ["gpu_dma", "cuda_copy", "gpu_dma_fused_u8"]
    ax1.bar(keys, [summary[f"{k}_cpu_us_per_batch"] for k in keys], color=["tab:green", "tab:red", "tab:olive"])
    ax1.set_ylabel("CPU time per batch of 8 (us)")
    ax1.set_title(f"CPU cost per batch (ratio {summary['cpu_ratio']:.1f}x)")
    x = np.arange(len(models))
    ax2.bar(x - 0.2, [summary.get(f"{m}_cuda_copy_latency_ms", 0) for m in models], 0.4, label="CUDA-Copy",
            color="tab:red")
    ax2.bar(x + 0.2, [summary.get(f"{m}_gpu_dma_latency_ms", 0) for m in models], 0.4, label="GPU-DMA",
            color="tab:green")
    ax2.set_xticks(x, models)
    ax2.set_ylabel("batch-8 latency (ms)")
    ax2.legend()
    ax2.set_title("Table I: gather + inference")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations, smaller models")
    ap.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--models", default="alexnet,resnet50,vgg19")
    ap.add_argument("--width", type=float, default=None,
                    help="model width for Table I (default 1.0 on cuda, 0.25 on cpu)")
    args = ap.parse_args(argv)
    backend = resolve_backend(args.backend)
    print(f"bench.dma: backend {backend}")
    iters = (20 if args.quick else 200) if backend == "cuda" else (10 if args.quick else 50)
    width = args.width if args.width is not None else (1.0 if backend == "cuda" else 0.25)
    models = [m for m in args.models.split(",") if m]
    summary, samples = run_gather(backend, iters)
    inf_iters = (5 if args.quick else 30) if backend == "cuda" else (2 if args.quick else 3)
    inf_summary, inf_samples = run_inference(backend, models, width, inf_iters)
    summary.update(inf_summary)
    samples.update(inf_samples)
    summary["model_width"] = width
    summary["paper_gpu_dma_cycles"] = PAPER["gpu_dma_cycles"]
    summary["paper_cuda_copy_cycles"] = PAPER["cuda_copy_cycles"]
    summary["paper_cpu_ratio"] = PAPER["cuda_copy_cycles"] / PAPER["gpu_dma_cycles"]
    notes = ("CUDA: GPU-DMA kernel reading the mapped pinned pool vs CPU gather into pinned staging + "
             "cudaMemcpyAsync + cudaStreamSynchronize; bandwidths from CUDA events. Cycles are CPU time x "
             "nominal MHz (an estimate, not a counter).")
    if backend == "cpu":
        notes = ("backend: cpu (no GPU): 'gpu_dma' is the native host gather straight into the batch (the CPU "
                 "equivalent), 'cuda_copy' a gather into a staging buffer plus a copy; 'memcpy_h2d_gbps' is a "
                 f"host memcpy of the same bytes. Table I models at width {width} on the CPU. Cycles are CPU time "
                 "x nominal MHz (an estimate).")
    path = write_result("dma", backend, summary, samples, notes=notes, large_samples=True)
    plot(summary, models, path.with_suffix(".png"))
    for k, v in summary.items():
        print(f"  {k}: {v:.4g}" if isinstance(v, float) else f"  {k}: {v}")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
