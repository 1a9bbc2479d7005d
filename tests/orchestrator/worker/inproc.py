"""An instance served in this process against a real pool and ingest (no orchestrator): the harness of the
instance's and its serving loops' tests."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import numpy as np

from gpuprims import wire
from gpuprims.batching import LatencyModel
from gpuprims.ingest import Ingest
from gpuprims.pool import PacketPool
from orchestrator.worker.instance import Instance, InstanceSpec

SHAPE = (3, 32, 32)


def in_process_instance(slo_ms: float = 5000.0, max_wait_ms: float = 0.0,
                        max_batch: int = 4) -> Iterator[tuple[Instance, Ingest, socket.socket]]:
    """An initialised instance of a small zoo model (app 1, consumer 0) over its own pool, the pool's ingest
    on a loopback port, and a client socket; everything is closed after the one yield."""
    pool = PacketPool.create(slot_count=1024, record_count=64, max_chunks=64, consumer_count=1)
    ing = Ingest(pool, [("127.0.0.1", 0)]).start()
    ing.set_route(1, [0])
    spec = InstanceSpec(name="t-0", app="t", app_id=1, model="mobilenet_v2", pool=pool.name, consumer=0,
                        input_shape=SHAPE, num_classes=10, slo_ms=slo_ms, max_batch=max_batch, max_wait_ms=max_wait_ms,
                        warmup=False)
    inst = Instance(spec, control=None)
    inst.init_compute(100)
    # The model's cold first runs (over a second on a loaded machine) are taken here and forgotten, so the
    # instance's latency model learns only what the test serves; the SLO (5 s) is one a served batch of this
    # small model makes on a machine loaded tenfold, so only the tests' own latencies make a request miss.
    inst.runner.warm_up(LatencyModel())
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(5.0)
    yield inst, ing, sock
    sock.close()
    inst.close()
    ing.stop()
    pool.close()


def send(ing: Ingest, sock: socket.socket, rid: int) -> None:
    x = np.random.default_rng(rid).random(SHAPE, dtype=np.float32)
    for d in wire.encode_request(1, rid, x):
        sock.sendto(d, ("127.0.0.1", ing.ports[0]))


def serve_all(inst: Instance, sock: socket.socket, n: int) -> dict[int, wire.Response]:
    """Step the instance until n responses arrived (each request id once) or a deadline passes."""
    asm, got = wire.ResponseAssembler(), {}
    sock.settimeout(0.01)
    deadline = time.monotonic() + 30
    while len(got) < n and time.monotonic() < deadline:
        inst.step(max_wait_ms=10)
        try:
            r = asm.feed(sock.recv(65536))
        except TimeoutError:
            continue
        if r is not None:
            assert r.request_id not in got, f"request {r.request_id} answered twice"
            got[r.request_id] = r
    assert len(got) == n, f"{len(got)} of {n} answered"
    return got


def answer(inst: Instance, sock: socket.socket) -> wire.Response:
    """The next response (stepping the instance until it comes)."""
    return next(iter(serve_all(inst, sock, 1).values()))


def send_body(ing: Ingest, sock: socket.socket, rid: int, body: np.ndarray | bytes) -> None:
    for d in wire.encode_request(1, rid, body):
        sock.sendto(d, ("127.0.0.1", ing.ports[0]))


def step_until(inst: Instance, done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not done() and time.monotonic() < deadline:
        inst.step(max_wait_ms=10)
    assert done(), what
