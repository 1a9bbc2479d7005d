"""A node's real data path on loopback, without the orchestrator: for client and front-door tests.

The real `PacketPool` and native `Ingest` receive and reassemble the UDP requests; a server thread
polls the consumer like an instance does, answers a request whose size does not fit its app with
BAD_REQUEST, gathers the others into one batch per app, runs the app's function and answers through
the consumer's answer ring (float32 rows, status OK), which the ingest sends. Apps not registered are unknown to the ingest.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gpuprims.ingest import Ingest
from gpuprims.pool import Consumer, PacketPool
from gpuprims.wire import Status


@dataclass
class LoopApp:
    """One app: its input (per request) and the function from a batch (N, *shape) to rows (N, K)."""

    shape: tuple[int, ...]
    dtype: str
    fn: Callable[[np.ndarray], np.ndarray]

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


class LoopNode:
    """Pool + ingest on 127.0.0.1 (port 0) + a serving thread; ``close()`` stops everything."""

    def __init__(self, apps: dict[int, LoopApp], *, slot_count: int = 4096, max_chunks: int = 600,
                 record_count: int = 256, timeout_ms: float = 300.0, max_batch: int = 8) -> None:
        self.apps = apps
        self.max_batch = max_batch
        self.pool = PacketPool.create(slot_count=slot_count, record_count=record_count, max_chunks=max_chunks,
                                      consumer_count=1)
        self.ingest = Ingest(self.pool, [("127.0.0.1", 0)], timeout_ms=timeout_ms).start()
        for app_id in apps:
            self.ingest.set_route(app_id, [0])
        self.address = ("127.0.0.1", self.ingest.ports[0])
        self.served = 0
        self.batches: list[int] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="loopnode", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        cons = self.pool.consumer(0)
        try:
            while not self._stop.is_set():
                recs = cons.poll(self.max_batch, 20)
                if not recs.size:
                    continue
                info = self.pool.requests(recs)
                for app_id in np.unique(info["app_id"]).tolist():
                    sel = info["app_id"] == app_id
                    self._answer(cons, self.apps[app_id], recs[sel], info[sel])
                self.served += int(recs.size)
        except BaseException as e:  # surfaced by close()
            self.error = e

    def _answer(self, cons: Consumer, app: LoopApp, recs: np.ndarray, info: np.ndarray) -> None:
        bad = info["total_len"] != app.row_bytes
        if bad.any():
            cons.answer_status(recs[bad], info[bad], Status.BAD_REQUEST)
        recs, info = recs[~bad], info[~bad]
        if not recs.size:
            return
        x = np.empty((recs.size, *app.shape), app.dtype)
        self.pool.gather(recs, x)
        out = np.ascontiguousarray(app.fn(x), dtype=np.float32).reshape(recs.size, -1)
        self.batches.append(int(recs.size))
        cons.answer(recs, info, Status.OK, out)

    def wait(self, cond: Callable[[dict[str, int]], bool], timeout_s: float = 10.0) -> dict[str, int]:
        """Wait until ``cond(ingest counters)`` holds; AssertionError with the counters if it never does."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            c = self.ingest.counters()
            if cond(c):
                return c
            time.sleep(0.005)
        raise AssertionError(f"condition not met; counters: {self.ingest.counters()}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.ingest.stop()
        self.pool.close()
        if self.error is not None:
            raise self.error

    def __enter__(self) -> LoopNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
