"""bench/stage_cost: what each stage of an instance's per-batch path costs, in CPU time and wall time.

An instance (orchestrator.instance.Instance, the real serving loop) serves requests from a real pool
and native ingest in this process, one request at a time at a steady pace (batch 1, as bench/e2e's
low-load traffic), with its stage clock (gpuprims.stats.StageClock) reading either
``time.thread_time_ns`` (the CPU time the serving thread spent in each stage: what the framework's
code costs, little moved by other processes on a shared machine) or ``time.monotonic_ns`` (wall
time, as the instance reports it). The two clocks alternate batch by batch. The ingest-side stages
(reassembly, delivery) are measured on the pool's clock, so they appear only in the wall-time rows.

Run: ``python -m bench.stage_cost [--quick] [--name NAME]``. Reports, never asserts.
"""

from __future__ import annotations

import argparse
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
from orchestrator.instance import Instance, InstanceSpec

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests")
    ap.add_argument("--model", default="mobilenet_v2")
    ap.add_argument("--name", default=None, help="result file stem (default stage_cost)")
    args = ap.parse_args()
    load_before = os.getloadavg()
    res = run(args.model, 60 if args.quick else 300)
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
    notes = ("One instance in this process on the core an instance at 50% gets, real pool and native ingest, "
             f"batch 1 at {RATE:g} req/s, the traffic tool's image body. cpu_* = thread CPU time of the serving "
             "thread per stage (little moved by the machine's load), wall_* = CLOCK_MONOTONIC; the clocks "
             "alternate batch by batch. *_framework_* = every stage but the model, summed per batch "
             "(wall: from the first datagram at the ingest to the answer sent and released).")
    path = write_result("stage_cost", "cpu", summary, {"ms": {k: res[k] for k in ("cpu", "wall")},
                                                       "cores": res["cores"]}, notes=notes + load_note(load_before),
                        load_avg_before=load_before, name=args.name)
    print(path)
    for k, v in summary.items():
        print(f"{k:>32}: {v}")


if __name__ == "__main__":
    main()
