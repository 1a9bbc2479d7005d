"""Native UDP ingest into the packet pool.

A native thread receives datagrams with ``recvmmsg`` (up to ``batch`` per system call) straight into
pool slots, validates each header, reassembles requests (any order; duplicates, loss and timeouts
handled), and pushes complete requests to the consumer ring of the app they belong to. No Python runs
per packet. Everything it drops is counted by reason (``counters()``): every received datagram is
either accepted or dropped for exactly one reason, so

    packets_received == packets_accepted + sum(drop_*)

Requests refused at admission (pool or request table full, every consumer queue full), timed out
while incomplete, or held by a consumer that died are answered with an explicit status datagram
(OVERLOADED, DEADLINE_MISSED, INSTANCE_FAILED) unless ``answer_drops`` is False. So is a request
for an app no instance serves (UNKNOWN_APP) and one too large for the pool (BAD_REQUEST): once per
request, its key remembered for the dedup window so its other datagrams are dropped (and counted)
without another answer.

An in-process caller (the Open Inference Protocol front door) places requests straight into the pool
through a :class:`LocalPort` (``ingest.local_port()``): each row becomes a complete request, routed
like a reassembled one, and its answer comes back to that port (``take``; ``fd`` is readable while
answers wait) instead of as a datagram: exactly one answer per row, whatever its instance does, with
no datagram, no socket and no reassembly on the way in or out.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from gpuprims import _native
from gpuprims.pool import PacketPool
from gpuprims.wire import DType, Status

ListenAddr = tuple[str, int] | tuple[str, int, int]
_STATUS = {int(s): s for s in Status}


class LocalAnswer(NamedTuple):
    """The answer of one request placed with :meth:`LocalPort.submit`.

    ``output`` is the result row (OK only, of the dtype the instance answered with); ``placed_ns`` is
    when the ingest put the request into the pool (0 if it was refused before), ``answered_ns`` when
    it took the answer, both CLOCK_MONOTONIC (``time.monotonic_ns``).
    """

    token: int
    status: Status
    output: np.ndarray | None
    placed_ns: int
    answered_ns: int


class Ingest:
    """The receive loop of one node. ``start()`` it, route apps to consumers, ``stop()`` it.

    ``listen`` is a list of ``(host, port)`` or ``(host, port, app_id)``; port 0 picks a free one
    (see ``ports``); with an ``app_id`` only that app is accepted on the port. ``timeout_ms`` bounds
    how long an incomplete request may hold slots; ``dedup_window_ms`` how long a finished request's
    id is remembered so duplicates and late chunks are recognised. With ``gro`` (UDP GRO, the
    default) the kernel may deliver a run of datagrams of one flow in one buffer, and each datagram
    is copied into its slot; without it every datagram is received straight into a slot (no copy)
    but costs the kernel more per datagram.

    An answer datagram the socket will not take (a full send buffer) is never waited for nor
    dropped: it is copied aside and retried until sent, or until its request's deadline passes
    (``answer_hold_ms`` after its first datagram for a request without one), when it is counted as
    ``answers_expired``. Other clients' answers keep flowing meanwhile; ``held_answers`` (a gauge in
    ``counters()``) is how many wait, at most ``answer_hold_bytes`` of them.
    """

    def __init__(self, pool: PacketPool, listen: Sequence[ListenAddr] = (("127.0.0.1", 0),), *,
                 timeout_ms: float = 500.0, dedup_window_ms: float = 2000.0, batch: int = 64,
                 rcvbuf_bytes: int = 32 << 20, answer_drops: bool = True, gro: bool = True,
                 answer_hold_ms: float = 1000.0, answer_hold_bytes: int = 32 << 20) -> None:
        if not listen:
            raise ValueError("listen needs at least one (host, port) address")
        specs = []
        for item in listen:
            if len(item) not in (2, 3):
                raise ValueError(f"listen entries are (host, port) or (host, port, app_id), got {item!r}")
            host, port = item[0], int(item[1])
            app = int(item[2]) if len(item) == 3 else -1  # type: ignore[misc]
            if not 0 <= port <= 65535:
                raise ValueError(f"port must be in 0..65535, got {port}")
            if app > 0xFFFF:
                raise ValueError(f"app_id must be a u16, got {app}")
            specs.append((str(host), port, app))
        if timeout_ms <= 0:
            raise ValueError(f"timeout_ms must be positive, got {timeout_ms}")
        if not 1 <= batch <= 1024:
            raise ValueError(f"batch must be in 1..1024, got {batch}")
        if not answer_hold_ms > 0:
            raise ValueError(f"answer_hold_ms must be positive, got {answer_hold_ms}")
        if answer_hold_bytes < 0:
            raise ValueError(f"answer_hold_bytes must be >= 0, got {answer_hold_bytes}")
        self.pool = pool
        self._native = _native.Ingest(pool.native, specs, timeout_ms, dedup_window_ms, batch, rcvbuf_bytes,
                                      answer_drops, gro, answer_hold_ms, answer_hold_bytes)
        self._finalizer = weakref.finalize(self, self._native.stop)

    @property
    def ports(self) -> list[int]:
        """The bound UDP ports, in the order of ``listen``."""
        return list(self._native.ports)

    @property
    def running(self) -> bool:
        return bool(self._native.running)

    def start(self) -> Ingest:
        self._native.start()
        return self

    def stop(self) -> None:
        """Stop the receive thread (releases already queued are still processed)."""
        self._native.stop()

    def set_route(self, app_id: int, consumers: Iterable[int]) -> None:
        """Send complete requests of ``app_id`` to these consumers (least-loaded first, or earliest
        predicted finish when they all have a cost model: ``set_cost``).

        An empty list stops serving the app: its datagrams are dropped as unknown_app. Every datagram
        the ingest receives after this returns is routed by it.
        """
        if not 0 <= app_id <= 0xFFFF:
            raise ValueError(f"app_id must be in 0..65535, got {app_id}")
        cons = [int(c) for c in consumers]
        n = self.pool.layout["consumer_count"]
        for c in cons:
            if not 0 <= c < n:
                raise ValueError(f"consumer {c} out of range 0..{n - 1}")
        self._native.set_route(app_id, cons)

    def route(self, app_id: int) -> list[int]:
        return list(self._native.route(app_id))

    def set_cost(self, consumer: int, fixed_us: float, per_request_us: float) -> None:
        """Give ``consumer``'s queue a cost model: a request delivered to it now is predicted to finish
        after ``fixed_us + per_request_us * (queued + 1)`` microseconds. An app whose consumers all have
        one goes to the earliest predicted finish (round-robin among equals); otherwise it goes to the
        least-loaded queue. ``fixed_us < 0`` clears the model. Takes effect on the next delivery.
        """
        self._check_consumer(consumer)
        if not (math.isfinite(fixed_us) and math.isfinite(per_request_us) and per_request_us >= 0):
            raise ValueError(f"fixed_us and per_request_us must be finite and per_request_us >= 0, "
                             f"got {fixed_us}, {per_request_us}")
        _native.ingest_set_cost(self._native, consumer, float(fixed_us), float(per_request_us))

    def clear_cost(self, consumer: int) -> None:
        """Remove ``consumer``'s cost model (its app is routed least-loaded again)."""
        self.set_cost(consumer, -1.0, 0.0)

    def cost(self, consumer: int) -> tuple[float, float] | None:
        """``(fixed_us, per_request_us)`` of ``consumer``, or None when it has no cost model."""
        self._check_consumer(consumer)
        fixed, per = _native.ingest_cost(self._native, consumer)
        return None if fixed < 0 else (float(fixed), float(per))

    def _check_consumer(self, consumer: int) -> None:
        n = self.pool.layout["consumer_count"]
        if not 0 <= consumer < n:
            raise ValueError(f"consumer {consumer} out of range 0..{n - 1}")

    def reclaim(self, consumer: int, *, requeue: bool = True, timeout_ms: int = 5000) -> tuple[int, int]:
        """Take back what a dead consumer held. Returns (answered_failed, requeued).

        The consumer is removed from every route first. Requests it held go to another consumer of
        their app when ``requeue`` and one exists, else are answered INSTANCE_FAILED and freed.
        """
        failed, requeued = self._native.reclaim(consumer, requeue, timeout_ms)
        return int(failed), int(requeued)

    def local_port(self) -> LocalPort:
        """A port for placing requests in-process (:class:`LocalPort`); up to 16 are open at once."""
        return LocalPort(self)
    def block_answers_to(self, port: int) -> None:
        """Fault seam for tests: answers to clients whose UDP port is ``port`` fail to send as on a
        full send buffer (loopback never fills one: the kernel drops for a slow receiver instead).
        0 lifts it."""
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {port}")
        self._native.set_blocked_port(port)

    def counters(self) -> dict[str, int]:
        """Every counter (packets, drops by reason, requests) plus the free_slots, free_records,
        filling and held_answers gauges."""
        return {k: int(v) for k, v in self._native.counters().items()}

    def drops(self) -> dict[str, int]:
        """Packet drops by reason, only the non-zero ones."""
        return {k[5:]: v for k, v in self.counters().items() if k.startswith("drop_") and v}

    def __enter__(self) -> Ingest:
        return self.start() if not self.running else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"Ingest(ports={self.ports}, running={self.running})"


class LocalPort:
    """Where an in-process caller places requests into the pool and takes their answers back.

    Every row given to :meth:`submit` gets exactly one :class:`LocalAnswer` at this port: its
    instance's (OK with the result, or its status), OVERLOADED when the pool, the request table or
    every queue of the app is full, UNKNOWN_APP when no instance serves the app, BAD_REQUEST when a
    row is larger than the pool takes, INSTANCE_FAILED when its instance died and no other took it,
    INTERNAL when an instance gave it back unanswered. Answers still coming after :meth:`close` are
    dropped (the ingest counts them as ``local_dropped``).
    """

    def __init__(self, ingest: Ingest) -> None:
        self.ingest = ingest
        self.index = int(ingest._native.local_open())
        self.fd = int(ingest._native.local_fd(self.index))
        self._finalizer = weakref.finalize(self, ingest._native.local_close, self.index)

    def submit(self, app_id: int, rows: np.ndarray, *, token0: int, deadline_us: int = 0,
               dtype: DType | None = None) -> None:
        """Place each row of ``rows`` (``[n, ...]``, a wire dtype) into the pool as one complete request
        of ``app_id``; row i is answered with token ``token0 + i``. The rows are copied before this
        returns; ``deadline_us`` is the requests' deadline as in the wire header (0: the app's SLO);
        ``dtype`` the wire dtype the requests carry where the rows' numpy dtype does not say it (a
        multi-tensor body, TENSORS, travels as uint8 rows).
        """
        if not 0 <= app_id <= 0xFFFF:
            raise ValueError(f"app_id must be in 0..65535, got {app_id}")
        if not 0 <= deadline_us < 2**32:
            raise ValueError(f"deadline_us must be in 0..2**32-1, got {deadline_us}")
        if not 0 <= token0 <= 2**64 - len(rows):
            raise ValueError(f"token0 must leave room for {len(rows)} u64 tokens, got {token0}")
        arr = np.ascontiguousarray(rows)
        if arr.ndim < 1 or arr.shape[0] == 0 or arr.nbytes == 0:
            raise ValueError(f"rows must be a non-empty [n, ...] array, got shape {arr.shape}")
        if dtype is None:
            dtype = DType.from_numpy(arr.dtype)
        self.ingest._native.submit(self.index, app_id, arr.reshape(arr.shape[0], -1).view(np.uint8), int(dtype),
                                   int(deadline_us), int(token0))

    def take(self) -> list[LocalAnswer]:
        """Every answer waiting at this port, oldest first (and ``fd`` reset)."""
        out = []
        for token, status, dtype, placed_ns, answered_ns, body in self.ingest._native.take_local(self.index):
            st = _STATUS.get(status, Status.INTERNAL)
            arr = None
            if st == Status.OK:
                arr = np.frombuffer(body, dtype=DType(dtype).numpy if dtype <= max(DType) else np.uint8)
            out.append(LocalAnswer(int(token), st, arr, int(placed_ns), int(answered_ns)))
        return out

    def close(self) -> None:
        """Close the port (idempotent); answers still coming to it are dropped."""
        self._finalizer()

    def __enter__(self) -> LocalPort:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def packet_balance(counters: dict[str, Any]) -> int:
    """packets_received - packets_accepted - sum(drops): 0 when every packet is accounted for."""
    drops = sum(v for k, v in counters.items() if k.startswith("drop_"))
    return int(counters["packets_received"]) - int(counters["packets_accepted"]) - drops
