"""bench/stage_cost: what each stage of an instance's per-batch path costs, in CPU time and wall time.

An instance (orchestrator.worker.instance.Instance, the real serving loop) serves requests from a real pool
and native ingest in this process, one request at a time at a steady pace (batch 1, as bench/e2e's
low-load traffic), with its stage clock (gpuprims.stats.StageClock) reading either
``time.thread_time_ns`` (the CPU time the serving thread spent in each stage: what the framework's
code costs, little moved by other processes on a shared machine) or ``time.monotonic_ns`` (wall
time, as the instance reports it). The two clocks alternate batch by batch. The ingest-side stages
(reassembly, delivery) are measured on the pool's clock, so they appear only in the wall-time rows.

It also times the heartbeat's snapshot (``heartbeat_*``), which the serving thread takes between two
batches, on statistics as full as a long-running instance's (4,096 latencies, 512 model times, 1,024
batches of stage samples), forced to recompute every time: as the instance takes it
(``orchestrator.worker.loops.stats.LatencyStats.snapshot``) and as it was taken before issue 26 (``np.percentile``
over a deque, ``heartbeat_numpy_*``), alternating, paired.

Run: ``python -m bench.stage_cost [--quick] [--name NAME]``. Reports, never asserts.
"""

from __future__ import annotations

import argparse
import collections
import os
import socket
import time
from typing import Any

import numpy as np

from bench.common import load_note, write_result
from gpuprims import wire
from gpuprims.cpushare import plan_cpu_shares
from gpuprims.ingest import Ingest
from gpuprims.pool import PacketPool
from gpuprims.stats import STAGES, StageClock
from gpuprims.traffic.images import request_body
from orchestrator.worker.instance import Instance, InstanceSpec
from orchestrator.worker.loops.stats import LatencyStats

SHAPE = (3, 64, 64)
RATE = 10.0


def serve_one(inst: Instance, sock: socket.socket, port: int, rid: int, body: np.ndarray) -> int:
    """Send one request, step the instance until its answer arrives; returns the answer's status."""
    for d in wire.encode_request(1, rid, body):
        sock.sendto(d, ("127.0.0.1", port))
    asm = wire.ResponseAssembler()
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        inst.step(max_wait_ms=5)
        try:
            r = asm.feed(sock.recv(65536))
        except (TimeoutError, BlockingIOError):
            continue
        if r is not None:
            return int(r.status)
    raise TimeoutError(f"request {rid} was not answered within 10 s")


def run(model: str, n: int) -> dict[str, Any]:
    share = plan_cpu_shares([("app-0", 50)])["app-0"]
    pool = PacketPool.create(slot_count=1024, record_count=64, max_chunks=64, consumer_count=1)
    ing = Ingest(pool, [("127.0.0.1", 0)]).start()
    ing.set_route(1, [0])
    spec = InstanceSpec(name="cost-0", app="cost", app_id=1, model=model, pool=pool.name, consumer=0,
                        input_shape=SHAPE, slo_ms=5000.0, max_batch=8, max_wait_ms=0.0, cores=list(share.cores),
                        threads=share.threads)
    inst = Instance(spec, control=None)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.002)
    try:
        inst.init_compute(50)
        body = np.asarray(request_body(SHAPE, "float32"), np.float32)
        clocks = {"cpu": StageClock(window=n, clock=time.thread_time_ns), "wall": StageClock(window=n)}
        statuses: list[int] = []
        nxt = time.perf_counter()
        for i in range(2 * n + 10):
            kind = "cpu" if i % 2 else "wall"
            inst.stats.stages = clocks[kind] if i >= 10 else StageClock()  # the first 10: warm-up
            assert inst.gatherer is not None
            inst.gatherer.clock = inst.stats.stages
            nxt += 1.0 / RATE
            time.sleep(max(0.0, nxt - time.perf_counter()))
            statuses.append(serve_one(inst, sock, ing.ports[0], i + 1, body))
        out: dict[str, Any] = {"cores": list(share.cores), "statuses": statuses}
        for kind, clock in clocks.items():
            out[kind] = {s: v.tolist() for s, v in clock.samples_ms().items()}
        return out
    finally:
        sock.close()
        inst.close()
        ing.stop()
        pool.close()


def full_stats(seed: int = 0) -> LatencyStats:
    """Statistics as full as a long-running instance's: every reservoir at its window."""
    rng = np.random.default_rng(seed)
    stats = LatencyStats(slo_ms=100.0)
    stats.latencies_ms.extend(rng.lognormal(0.5, 0.5, stats.latencies_ms.size))
    stats.model_ms.extend(rng.lognormal(0.0, 0.3, stats.model_ms.size))
    for _ in range(stats.stages.window):
        stats.stages.start(0)
        for stage in STAGES:
            stats.stages.observe(stage, int(rng.integers(1_000, 2_000_000)))
        stats.stages.end()
    stats.batch_sizes.update({1: 900, 2: 100, 4: 24})
    stats.counts.update({"received": 4096, "ok": 4096, "within_slo": 4090})
    return stats


def numpy_snapshot(stats: LatencyStats, latencies: Any, model_ms: Any) -> dict[str, Any]:
    """The percentile part of the snapshot as it was before issue 26 (deques, ``np.percentile``)."""
    lat = np.asarray(latencies, dtype=float)
    rows = stats.stages._samples[:stats.stages.window] / 1e6
    (p50, p99), mean = np.percentile(rows, (50, 99), axis=0).tolist(), rows.mean(axis=0).tolist()
    return {"p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
            "model_p50_ms": float(np.median(model_ms)), "hist": stats.hist.to_wire(),
            "stages": {s: {"p50_ms": round(p50[i], 4), "p99_ms": round(p99[i], 4), "mean_ms": round(mean[i], 4)}
                       for i, s in enumerate(stats.stages.stages)}}


def heartbeat_cost(n: int) -> dict[str, list[float]]:
    """Thread CPU time (us) of ``n`` snapshots each way, alternating, each forced to recompute."""
    stats = full_stats()
    latencies = collections.deque(stats.latencies_ms.values().tolist(), maxlen=stats.latencies_ms.size)
    model_ms = collections.deque(stats.model_ms.values().tolist(), maxlen=stats.model_ms.size)
    out: dict[str, list[float]] = {"gpuprims": [], "numpy": []}
    for _ in range(n):
        stats._pct_key = None  # forced: as after every answered batch
        t0 = time.thread_time_ns()
        stats.snapshot(0, 0)
        t1 = time.thread_time_ns()
        numpy_snapshot(stats, latencies, model_ms)
        t2 = time.thread_time_ns()
        out["gpuprims"].append((t1 - t0) / 1e3)
        out["numpy"].append((t2 - t1) / 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests")
    ap.add_argument("--model", default="mobilenet_v2")
    ap.add_argument("--name", default=None, help="result file stem (default stage_cost)")
    args = ap.parse_args()
    load_before = os.getloadavg()
    res = run(args.model, 60 if args.quick else 300)
    res["heartbeat_us"] = heartbeat_cost(100 if args.quick else 1000)
    summary: dict[str, Any] = {"model": args.model, "requests": len(res["statuses"]),
                               "ok": sum(1 for s in res["statuses"] if s == 0)}
    for kind in ("cpu", "wall"):
        total = np.zeros(len(res[kind]["model"]))
        for stage in STAGES:
            if kind == "cpu" and stage in ("reassembly", "delivery"):
                continue
            v = np.asarray(res[kind][stage])
            summary[f"{kind}_{stage}_p50_us"] = round(float(np.median(v)) * 1e3, 1)
            summary[f"{kind}_{stage}_p99_us"] = round(float(np.percentile(v, 99)) * 1e3, 1)
            if stage != "model":
                total += v
        summary[f"{kind}_framework_p50_us"] = round(float(np.median(total)) * 1e3, 1)
        summary[f"{kind}_framework_p99_us"] = round(float(np.percentile(total, 99)) * 1e3, 1)
    for way, key in (("gpuprims", "heartbeat"), ("numpy", "heartbeat_numpy")):
        v = np.asarray(res["heartbeat_us"][way])
        summary[f"{key}_cpu_p50_us"] = round(float(np.median(v)), 1)
        summary[f"{key}_cpu_p99_us"] = round(float(np.percentile(v, 99)), 1)
    notes = ("One instance in this process on the core an instance at 50% gets, real pool and native ingest, "
             f"batch 1 at {RATE:g} req/s, the traffic tool's image body. cpu_* = thread CPU time of the serving "
             "thread per stage (little moved by the machine's load), wall_* = CLOCK_MONOTONIC; the clocks "
             "alternate batch by batch. *_framework_* = every stage but the model, summed per batch "
             "(wall: from the first datagram at the ingest to the answer sent and released). heartbeat_* = thread CPU "
             "time of one heartbeat snapshot on full statistics, recomputed (heartbeat_numpy_*: the np.percentile "
             "way it was taken before), alternating.")
    path = write_result("stage_cost", "cpu", summary, {"ms": {k: res[k] for k in ("cpu", "wall")},
                                                       "heartbeat_us": res["heartbeat_us"], "cores": res["cores"]}, notes=notes + load_note(load_before),
                        load_avg_before=load_before, name=args.name)
    print(path)
    for k, v in summary.items():
        print(f"{k:>32}: {v}")


if __name__ == "__main__":
    main()
