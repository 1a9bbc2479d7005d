"""bench/gather: GB/s of the native CPU gather from pool slots into a contiguous batch.

Batches of 8 and 32 float32 224x224x3 images (588 datagrams each) are received by the native ingest
into the pool, then copied into one batch buffer three ways, side by side:
- native: ``PacketPool.gather`` (the CPU equivalent of GPU-DMA);
- numpy: one vectorised fancy-index copy of the same slots' payloads (the best plain-numpy gather);
- memcpy: ``np.copyto`` of a contiguous block of the same size (the limit).

Run: ``python -m bench.gather [--quick]``. Reports, never asserts.
"""

from __future__ import annotations

import argparse
import socket
import time

import numpy as np

from bench.common import percentiles, write_result
from gpuprims import wire
from gpuprims.ingest import Ingest
from gpuprims.pool import PacketPool

APP = 1
SHAPE = (3, 224, 224)


def fill(pool: PacketPool, n: int) -> np.ndarray:
    """Send n images through the ingest on loopback; return their record indices in request order."""
    ing = Ingest(pool, [("127.0.0.1", 0)], timeout_ms=5000).start()
    ing.set_route(APP, [0])
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    addr = ("127.0.0.1", ing.ports[0])
    rng = np.random.default_rng(0)
    for rid in range(n):
        img = rng.random(SHAPE, dtype=np.float32)
        for i, d in enumerate(wire.encode_request(APP, rid, img)):
            s.sendto(d, addr)
            if i % 64 == 63:
                time.sleep(0)  # let the ingest keep up on a 2-core machine
    cons = pool.consumer(0)
    got: list[int] = []
    deadline = time.monotonic() + 30
    while len(got) < n and time.monotonic() < deadline:
        got += cons.poll(64, 100).tolist()
    ing.stop()
    s.close()
    if len(got) != n:
        raise RuntimeError(f"only {len(got)} of {n} requests arrived: {ing.counters()}")
    recs = np.array(got, np.uint32)
    order = np.argsort(pool.requests(recs)["request_id"])
    return recs[order]


def numpy_gather(pool: PacketPool, recs: np.ndarray, out: np.ndarray, slots: np.ndarray) -> None:
    info = pool.requests(recs)
    cm = pool.region("chunkmap").view(np.uint32).reshape(pool.layout["record_count"], -1)
    chunks = int(info["chunk_count"][0])
    idx = cm[recs.astype(np.intp), :chunks]
    payload = slots[idx, wire.HEADER_SIZE:wire.HEADER_SIZE + 1024]
    out.view(np.uint8).reshape(-1)[:] = payload.reshape(-1)


def run(quick: bool) -> dict:
    reps = 20 if quick else 100
    batches = (8, 32)
    n = max(batches)
    per_img = 588
    pool = PacketPool.create(slot_count=n * per_img + 256, record_count=64, max_chunks=1024, consumer_count=1)
    recs_all = fill(pool, n)
    slots = pool.region("slots").reshape(pool.layout["slot_count"], pool.layout["slot_size"])
    summary: dict[str, float] = {}
    samples: dict[str, dict[str, list[float]]] = {}
    for b in batches:
        recs = recs_all[:b]
        nbytes = b * int(np.prod(SHAPE)) * 4
        out_native = np.empty((b, *SHAPE), np.float32)
        out_numpy = np.empty_like(out_native)
        src = np.random.default_rng(1).random(out_native.size, dtype=np.float32).reshape(out_native.shape)
        out_memcpy = np.empty_like(out_native)
        pool.gather(recs, out_native)
        numpy_gather(pool, recs, out_numpy, slots)
        if not np.array_equal(out_native, out_numpy):
            raise RuntimeError("native and numpy gathers disagree")
        times: dict[str, list[float]] = {"native": [], "numpy": [], "memcpy": []}
        for _ in range(reps):
            t = time.perf_counter_ns()
            pool.gather(recs, out_native)
            times["native"].append(time.perf_counter_ns() - t)
            t = time.perf_counter_ns()
            numpy_gather(pool, recs, out_numpy, slots)
            times["numpy"].append(time.perf_counter_ns() - t)
            t = time.perf_counter_ns()
            np.copyto(out_memcpy, src)
            times["memcpy"].append(time.perf_counter_ns() - t)
        gbps = {k: nbytes / float(np.median(v)) for k, v in times.items()}  # bytes/ns == GB/s
        summary[f"native_gbps_b{b}"] = round(gbps["native"], 3)
        summary[f"numpy_gbps_b{b}"] = round(gbps["numpy"], 3)
        summary[f"memcpy_gbps_b{b}"] = round(gbps["memcpy"], 3)
        summary[f"native_p99_us_b{b}"] = round(percentiles(times["native"])["p99"] / 1e3, 1)
        samples[f"b{b}"] = {k: [x / 1e3 for x in v] for k, v in times.items()}
    pool.close()
    # Keys CONTRIBUTING.md (Benchmarks) names, for the paper's batch of 8.
    summary.update(native_gbps=summary["native_gbps_b8"], numpy_gbps=summary["numpy_gbps_b8"],
                   memcpy_gbps=summary["memcpy_gbps_b8"], batch=8)
    return {"summary": summary, "samples": samples}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["summary"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = ["native", "numpy", "memcpy"]
    for i, b in enumerate((8, 32)):
        vals = [s[f"{k}_gbps_b{b}"] for k in labels]
        ax.bar(np.arange(3) + i * 0.38, vals, width=0.36, label=f"batch {b}")
    ax.set_xticks(np.arange(3) + 0.19, labels)
    ax.set_ylabel("GB/s")
    ax.set_title("Gather of 224x224x3 float32 images from pool slots (CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    res = run(args.quick)
    path = write_result("gather", "cpu", res["summary"], res["samples"],
                        notes="CPU backend; median of repeated gathers; GB/s = bytes / median ns.")
    plot(res, str(path.with_suffix(".png")))
    print(path)
    for k, v in res["summary"].items():
        print(f"{k:>22}: {v}")


if __name__ == "__main__":
    main()
