"""How the front door hands an inference's rows to the node and gets their answers back.

Two transports with one call shape (``rows``), chosen when the front door starts:

- :class:`PoolTransport` (the node's own, the default there): every row is placed straight into the
  node's packet pool by the native ingest (``LocalPort.submit``: one copy of the tensor into pool slots,
  on the ingest thread) and routed like a reassembled request; its answer comes back in-process
  through the front door's own local port of the ingest (an answer queue whose eventfd wakes this
  loop). No datagram,
  socket, reassembly or Python per chunk on either way.
- :class:`UdpTransport`: every row is sent as wire datagrams to a node's UDP ingest with the asyncio
  client, as any UDP client does (a front door in front of a node in another process).

Both give each row a :class:`~gpuprims.client.Result` or a :class:`~gpuprims.client.RequestLost`
when no answer came within the timeout, and add the time of each step to the caller's
:class:`Marks` (``submit``: the rows handed over; ``node``: until the node's answer; ``back``: the
answer's way from the node to this loop).
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

import numpy as np

from gpuprims.client import AsyncClient, RequestLost, Result
from gpuprims.ingest import Ingest, LocalAnswer, LocalPort
from gpuprims.tensorwire import decode
from gpuprims.wire import DType

#: The steps of one inference at the front door, in order (``FrontDoor.stages()``):
#: parse (the request's bytes to its header: HTTP body read + JSON, gRPC protobuf parse), decode
#: (the tensor to a numpy array, checks), submit (the rows handed to the node), node (until the node
#: has the answers), back (the answers' way to the front door's loop), collect (rows to the answer
#: array, statistics), encode (the response's bytes).
STAGES = ("parse", "decode", "submit", "node", "back", "collect", "encode")


class Marks:
    """Per-request stage durations (ns), added to as the request goes (asyncio-safe: one per request)."""

    __slots__ = ("last_ns", "ns")

    def __init__(self, start_ns: int | None = None) -> None:
        self.ns = dict.fromkeys(STAGES, 0)
        self.last_ns = time.monotonic_ns() if start_ns is None else start_ns

    def lap(self, stage: str) -> int:
        """Add the time since the previous mark to ``stage``; returns now (ns)."""
        now = time.monotonic_ns()
        self.ns[stage] += now - self.last_ns
        self.last_ns = now
        return now

    def add(self, stage: str, ns: int) -> None:
        self.ns[stage] += max(0, int(ns))


class Transport(Protocol):
    name: str

    async def rows(self, app_id: int, x: np.ndarray, *, deadline_us: int, timeout_s: float,
                   marks: Marks, dtype: DType | None = None) -> list[Result | BaseException]: ...

    def close(self) -> None: ...


class UdpTransport:
    """Rows as wire datagrams to a UDP ingest through one asyncio client (one request per row)."""

    name = "udp"

    def __init__(self, client: AsyncClient) -> None:
        self.client = client

    async def rows(self, app_id: int, x: np.ndarray, *, deadline_us: int, timeout_s: float,
                   marks: Marks, dtype: DType | None = None) -> list[Result | BaseException]:
        # A multi-tensor body goes as the client's mapping of named arrays (views into the row), which it
        # encodes again into the same body.
        items = [{t.name: t.array for t in decode(row)} for row in x] if dtype == DType.TENSORS else list(x)
        tasks = [asyncio.ensure_future(self.client.infer(app_id, item, deadline_us=deadline_us, timeout_s=timeout_s))
                 for item in items]
        # One turn of the loop runs each task up to its first wait: the encoding and the sendto of
        # every datagram of its row. What follows (the node, the answer datagrams and their
        # reassembly in the client) is the node stage.
        try:
            await asyncio.sleep(0)
            marks.lap("submit")
            results = await asyncio.gather(*tasks, return_exceptions=True)
        except asyncio.CancelledError:  # the call went away: so do its rows (late answers are strays)
            for t in tasks:
                t.cancel()
            raise
        marks.lap("node")
        return list(results)

    def close(self) -> None:
        self.client.close()


class PoolTransport:
    """Rows placed into the packet pool by the node's native ingest; answers through its local queue.

    Must be opened on the loop that calls ``rows`` (``open`` registers the eventfd reader there).
    An answer whose row was given up (timed out, cancelled) is dropped and counted in ``stray``.
    """

    name = "pool"

    def __init__(self, ingest: Ingest) -> None:
        self.ingest: Ingest | None = ingest
        self.port: LocalPort | None = None
        self.stray = 0
        self._next_token = 1
        self._pending: dict[int, asyncio.Future[tuple[LocalAnswer, int]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def open(self) -> PoolTransport:
        if self.ingest is None:
            raise RuntimeError("PoolTransport is closed")
        self._loop = asyncio.get_running_loop()
        self.port = self.ingest.local_port()
        self._loop.add_reader(self.port.fd, self._drain)
        return self

    def _drain(self) -> None:
        assert self.port is not None
        now = time.monotonic_ns()
        for a in self.port.take():
            fut = self._pending.pop(a.token, None)
            if fut is None or fut.done():
                self.stray += 1
                continue
            fut.set_result((a, now))

    async def rows(self, app_id: int, x: np.ndarray, *, deadline_us: int, timeout_s: float,
                   marks: Marks, dtype: DType | None = None) -> list[Result | BaseException]:
        loop, port = self._loop, self.port
        if loop is None or port is None:
            raise RuntimeError("PoolTransport is not open: call open() on the front door's loop")
        n = len(x)
        token0 = self._next_token
        self._next_token += n
        futs = [loop.create_future() for _ in range(n)]
        for i, f in enumerate(futs):
            self._pending[token0 + i] = f
        try:
            port.submit(app_id, x, token0=token0, deadline_us=deadline_us, dtype=dtype)
        except BaseException:
            for i in range(n):
                self._pending.pop(token0 + i, None)
            raise
        sent_ns = marks.lap("submit")
        try:
            done, _ = await asyncio.wait(futs, timeout=timeout_s)
        except asyncio.CancelledError:  # the call went away: its rows' answers will be strays
            for i, f in enumerate(futs):
                self._pending.pop(token0 + i, None)
                f.cancel()
            raise
        out: list[Result | BaseException] = []
        node_ns = 0
        for i, f in enumerate(futs):
            if f not in done:
                self._pending.pop(token0 + i, None)
                f.cancel()
                out.append(RequestLost(app_id, token0 + i, timeout_s, 1))
                continue
            a, seen_ns = f.result()
            node_ns = max(node_ns, a.answered_ns - sent_ns)
            out.append(Result(app_id, a.token, a.status, a.output, (seen_ns - sent_ns) / 1e6))
        end = time.monotonic_ns()
        marks.add("node", node_ns)
        marks.add("back", (end - sent_ns) - node_ns)
        marks.last_ns = end
        return out

    def close(self) -> None:
        if self.port is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self.port.fd)
            self.port.close()
        # Servers may outlive their stop (grpc keeps its handlers): hold nothing of the node after it.
        self.port = None
        self.ingest = None
        for f in self._pending.values():
            if not f.done():
                f.cancel()
        self._pending.clear()
