"""Python clients for the node's UDP path (wire format v1): one blocking, one asyncio.

>>> import numpy as np
>>> from gpuprims.client import Client
>>> with Client(("127.0.0.1", 9000)) as c:  # doctest: +SKIP
...     r = c.infer(1, np.zeros((3, 64, 64), np.float32))
...     r.raise_for_status().output.shape, r.latency_ms
((1000,), 12.3)

A request is one array (sent as a bare tensor of its wire dtype, float32/uint8/float16/int64) or a
mapping of names to arrays (sent as a multi-tensor body, wire dtype TENSORS: any numeric datatype, for
models with several named inputs; ``gpuprims.tensorwire``). An OK answer in a multi-tensor body gives
``Result.outputs``, the model's named outputs:

>>> r = c.infer(3, {"image": img, "scale": np.float32(0.5)})  # doctest: +SKIP
>>> r.raise_for_status().outputs["boxes"].shape  # doctest: +SKIP

Each request gets a fresh request id (unique per client socket), its datagrams are sent to the node,
and the answer is matched back by (app_id, request_id). A request whose answer does not come within
``timeout_s`` raises :class:`RequestLost`; a non-OK status comes back as a :class:`Result` (call
``raise_for_status()`` to turn it into a :class:`RequestError`). Retries are off by default: with
``retries=n`` a lost or OVERLOADED request is sent again under a new request id, up to n times, so
the node may run it more than once (it never answers one request id twice; see docs/wire-format.md).
Many requests may be in flight at once (``submit``/``infer_many``, or ``asyncio.gather``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import random
import select
import socket
import threading
import time
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuprims import _native, tensorwire, wire
from gpuprims.tensorwire import TensorBodyError, WireTensor
from gpuprims.wire import DType, Status

#: How long a client waits for an answer by default. The node answers every request it admitted by
#: about max(deadline, reassembly timeout) plus one batch's model time (docs/wire-format.md); two
#: seconds covers the example configs on a busy CPU with room to spare.
DEFAULT_TIMEOUT_S = 2.0
SOCKET_BUFFER_BYTES = 8 << 20
#: Statuses a client with ``retries`` sends again (with a new request id); every other is final.
RETRY_STATUSES = frozenset({Status.OVERLOADED})

Address = tuple[str, int]


class RequestError(RuntimeError):
    """The node answered a request with a status other than OK."""

    def __init__(self, result: Result) -> None:
        self.result = result
        self.status = result.status
        super().__init__(f"app {result.app_id} request {result.request_id}: {result.status.name}")


class MalformedAnswer(RuntimeError):
    """The node answered OK with a multi-tensor body (dtype TENSORS) that does not decode. Raised where
    the request's Result would have been returned; ``body`` holds the answer's raw bytes."""

    def __init__(self, app_id: int, request_id: int, detail: str, body: bytes) -> None:
        self.app_id, self.request_id, self.detail, self.body = app_id, request_id, detail, body
        super().__init__(f"app {app_id} request {request_id}: OK answer with a malformed multi-tensor body "
                         f"({len(body)} bytes): {detail}")

    def __reduce__(self) -> tuple[type, tuple[int, int, str, bytes]]:
        return (type(self), (self.app_id, self.request_id, self.detail, self.body))


class RequestLost(TimeoutError):
    """No answer came within the timeout (after every retry)."""

    def __init__(self, app_id: int, request_id: int, timeout_s: float, attempts: int) -> None:
        self.app_id, self.request_id, self.timeout_s, self.attempts = app_id, request_id, timeout_s, attempts
        super().__init__(f"app {app_id} request {request_id}: no answer within {timeout_s:g} s "
                         f"({attempts} attempt{'s' if attempts != 1 else ''}); raise timeout_s if the app is slow")


@dataclass(frozen=True, slots=True)
class ClientTrace:
    """The client's side of one request's way (``Client(trace=True)``), CLOCK_MONOTONIC ns
    (``time.monotonic_ns``, the clock the node's trace uses on the same host): ``start_ns`` the call,
    ``client_ts_ns`` the request built (the wire header's, echoed by the node), ``first_sent_ns`` and
    ``last_sent_ns`` its first and last datagram handed to the kernel, ``answered_ns`` its answer's last
    datagram read by the receive thread (just before the Result is handed over)."""

    start_ns: int
    client_ts_ns: int
    first_sent_ns: int
    last_sent_ns: int
    answered_ns: int


@dataclass(frozen=True, slots=True)
class Result:
    """One answered request: its status, output (OK only) and the latency the client saw.

    ``output`` is the answer's body as a 1-D array of its wire dtype (a multi-tensor answer's raw
    bytes as uint8); ``outputs`` the named tensors of an OK multi-tensor answer (dtype TENSORS,
    read-only arrays of their shapes, BF16 as its uint16 bits), None for any other answer.
    """

    app_id: int
    request_id: int
    status: Status
    output: np.ndarray | None
    latency_ms: float
    attempts: int = 1
    outputs: dict[str, np.ndarray] | None = None
    trace: ClientTrace | None = None  #: the client's timestamps, from a Client made with trace=True

    @property
    def ok(self) -> bool:
        return self.status == Status.OK

    def raise_for_status(self) -> Result:
        """Return self if OK, else raise RequestError carrying this result."""
        if not self.ok:
            raise RequestError(self)
        return self


def as_request_tensor(tensor: Any) -> np.ndarray:
    """A C-contiguous array of a wire dtype (float32, uint8, float16, int64), or ValueError."""
    arr = np.ascontiguousarray(tensor)
    try:
        DType.from_numpy(arr.dtype)
    except ValueError:
        raise ValueError(f"tensor dtype {arr.dtype} has no wire dtype (use float32, uint8, float16 or "
                         "int64)") from None
    if arr.nbytes == 0:
        raise ValueError("tensor is empty")
    if arr.nbytes >= 2**32:
        raise ValueError(f"tensor of {arr.nbytes} bytes does not fit one request (< 4 GiB)")
    return arr


#: What a request body is on the way out: the array or encoded bytes, and the wire dtype to send it as
#: (None: the array's own, exactly as before multi-tensor bodies existed).
_Body = tuple[np.ndarray | bytes, DType | None]


def request_body(x: Any) -> _Body:
    """A request's body and wire dtype: a mapping ``{name: array}`` (or a sequence of
    :class:`~gpuprims.tensorwire.WireTensor`, for BF16) becomes a multi-tensor body (TENSORS), anything
    else goes through :func:`as_request_tensor`. ValueError (a TensorBodyError for a tensor the body
    cannot carry) says what is wrong."""
    if isinstance(x, Mapping):
        if not x:
            raise ValueError("no tensors: a request needs at least one named tensor")
        body = tensorwire.encode_arrays(x)
    elif isinstance(x, WireTensor) or (isinstance(x, list | tuple) and x and all(isinstance(t, WireTensor) for t in x)):
        body = tensorwire.encode([x] if isinstance(x, WireTensor) else x)
    else:
        return as_request_tensor(x), None
    if len(body) >= 2**32:
        raise ValueError(f"tensors of {len(body)} bytes do not fit one request (< 4 GiB)")
    return body, DType.TENSORS


def _answer(app_id: int, rid: int, r: wire.Response, status: Status, latency_ms: float, attempts: int) -> Result:
    """The Result of one answer; MalformedAnswer for an OK multi-tensor answer that does not decode."""
    if status != Status.OK:
        return Result(app_id, rid, status, None, latency_ms, attempts)
    out = np.frombuffer(r.body, dtype=DType(r.dtype).numpy if r.dtype <= max(DType) else np.uint8)
    outputs = None
    if r.dtype == DType.TENSORS:
        try:
            outputs = tensorwire.decode_arrays(r.body)
        except TensorBodyError as e:
            raise MalformedAnswer(app_id, rid, str(e), r.body) from None
    return Result(app_id, rid, status, out, latency_ms, attempts, outputs)


def _status(code: int) -> Status:
    try:
        return Status(code)
    except ValueError:  # a newer node's status: keep it an error, never OK
        return Status.INTERNAL


def _check_args(timeout_s: float, retries: int, chunk_payload: int) -> None:
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be an integer >= 0, got {retries!r}")
    wire.chunk_count_for(1, chunk_payload)  # validates chunk_payload


def _check_request(app_id: int, deadline_us: int) -> None:
    if isinstance(app_id, bool) or not isinstance(app_id, int | np.integer) or not 0 <= app_id <= 0xFFFF:
        raise ValueError(f"app_id must be an integer in 0..65535, got {app_id!r}")
    if isinstance(deadline_us, bool) or not isinstance(deadline_us, int | np.integer) \
            or not 0 <= deadline_us < 2**32:
        raise ValueError(f"deadline_us must be an integer in 0..2**32-1 (0 = the app's SLO), got {deadline_us!r}")


def _make_socket(node: Address, bind_host: str | None) -> socket.socket:
    family = socket.AF_INET6 if ":" in node[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
        except OSError:
            pass
    try:
        sock.bind((bind_host if bind_host is not None else ("::" if family == socket.AF_INET6 else ""), 0))
    except OSError:
        sock.close()
        raise
    return sock


class _Book:
    """The request ids, the response assembler and the counters a client keeps (no I/O)."""

    def __init__(self, chunk_payload: int) -> None:
        self.chunk_payload = chunk_payload
        # Random start: a new client on a reused port does not repeat ids the node may still remember.
        self._next_id = random.SystemRandom().getrandbits(46) + 1
        self.asm = wire.ResponseAssembler()
        self.invalid = 0  # datagrams that are not v1 responses
        self.stray = 0  # answers to no pending request (late after a timeout, or not ours)
        self.malformed = 0  # OK answers whose multi-tensor body did not decode (MalformedAnswer)

    def new_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    def encode(self, app_id: int, rid: int, body: _Body, deadline_us: int, flags: int = 0,
               ts: int | None = None) -> tuple[list[bytes], int]:
        ts = time.monotonic_ns() if ts is None else ts
        data, dtype = body
        return wire.encode_request(app_id, rid, data, chunk_payload=self.chunk_payload, dtype=dtype,
                                   deadline_us=deadline_us, client_ts_ns=ts, flags=flags), ts

    def send(self, sock: socket.socket | int, to: Address, app_id: int, rid: int, body: _Body, deadline_us: int,
             flags: int = 0) -> tuple[int, list[bytes]]:
        """Send one request's datagrams to `to` in one native call (sendmmsg, no copy of the payload;
        the same datagrams as `encode`); returns the request's client_ts_ns and the datagrams left to
        send (none, unless a non-blocking socket's buffer filled). ValueError for an address that is
        not numeric (the caller then sends through `encode`)."""
        ts = time.monotonic_ns()
        data, dtype = body
        if isinstance(data, np.ndarray):
            code = DType.from_numpy(data.dtype) if dtype is None else dtype
            raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        else:
            code = DType.BYTES if dtype is None else dtype
            raw = np.frombuffer(data, np.uint8)
        fd = sock if isinstance(sock, int) else sock.fileno()
        sent = _native.send_request(fd, to[0], to[1], app_id, rid, raw, self.chunk_payload, int(code), flags,
                                    deadline_us, ts)
        if sent == wire.chunk_count_for(raw.size, self.chunk_payload):
            return ts, []
        return ts, self.encode(app_id, rid, body, deadline_us, flags, ts)[0][sent:]

    def feed(self, data: bytes) -> wire.Response | None:
        try:
            return self.asm.feed(data)
        except wire.WireError:
            self.invalid += 1
            return None


@dataclass
class _Pending:
    app_id: int
    body: _Body
    deadline_us: int
    timeout_ns: int
    attempts_left: int
    first_ns: int
    rid: int = 0
    expires_ns: int = 0
    attempts: int = 0
    future: concurrent.futures.Future[Result] | None = None
    to: Address | None = None  # where to send (default: the client's node)
    flags: int = 0  # wire flags (wire.FLAG_MORE: more of its query follow)
    # Client(trace=True) only: the call, the request built, its first and last datagram sent (ns).
    start_ns: int = 0
    client_ts_ns: int = 0
    first_sent_ns: int = 0
    last_sent_ns: int = 0


class Client:
    """Blocking client with a receive thread; ``submit`` returns a Future, so many can be in flight.

    ``node`` is the node's UDP listen address. ``bind_host`` is the local address to receive answers
    on (default: any). ``trace``: every Result carries its `ClientTrace` (the client's timestamps of
    the request, to join with the node's stage trace, orchestrator.worker.loops.trace ``TRACE_ENV``); off, the
    path takes no timestamps beyond the latency. Close it with ``close()`` or ``with``.
    """

    def __init__(self, node: Address = ("127.0.0.1", 9000), *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 retries: int = 0, chunk_payload: int = wire.DEFAULT_CHUNK_PAYLOAD,
                 bind_host: str | None = None, trace: bool = False) -> None:
        _check_args(timeout_s, retries, chunk_payload)
        self.trace = bool(trace)
        self._native_send = True  # until an address turns out not to be numeric (then sendto, a datagram each)
        self.node = (str(node[0]), int(node[1]))
        self.timeout_s, self.retries = float(timeout_s), retries
        self._book = _Book(chunk_payload)
        self._sock = _make_socket(self.node, bind_host)
        self._lock = threading.Lock()
        self._pending: dict[tuple[int, int], _Pending] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._recv_loop, name="gpuprims-client", daemon=True)
        self._thread.start()
        self._fin = weakref.finalize(self, _close_sync, self._stop, self._thread, self._sock)

    @property
    def address(self) -> Address:
        """Where this client receives answers."""
        return self._sock.getsockname()[:2]

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    @property
    def stray(self) -> int:
        """Answers that matched no pending request (late, after a retry or timeout)."""
        return self._book.stray

    @property
    def malformed(self) -> int:
        """OK answers whose multi-tensor body did not decode (each raised MalformedAnswer)."""
        return self._book.malformed

    def submit(self, app_id: int, tensor: Any, *, deadline_us: int = 0, timeout_s: float | None = None,
               to: Address | None = None, more: bool = False) -> concurrent.futures.Future[Result]:
        """Send one request now (to ``to``, default the client's node); the Future resolves to its
        Result or raises RequestLost (or MalformedAnswer). ``tensor`` is an array or a mapping
        ``{name: array}`` (a multi-tensor body; :func:`request_body`). ``more``: another request of
        the same query follows at once (`wire.FLAG_MORE`; `infer_many` sets it on all but the last), so
        the instance may hold this one to batch it with the rest."""
        start_ns = time.monotonic_ns() if self.trace else 0
        if not self._thread.is_alive():
            raise RuntimeError("client is closed")
        body = request_body(tensor)
        t = self.timeout_s if timeout_s is None else timeout_s
        _check_args(t, self.retries, self._book.chunk_payload)
        _check_request(app_id, deadline_us)
        p = _Pending(app_id=int(app_id), body=body, deadline_us=int(deadline_us), timeout_ns=round(t * 1e9),
                     attempts_left=self.retries + 1, first_ns=0, future=concurrent.futures.Future(),
                     to=None if to is None else (str(to[0]), int(to[1])), flags=wire.FLAG_MORE if more else 0,
                     start_ns=start_ns)
        self._send(p)
        assert p.future is not None
        return p.future

    def infer(self, app_id: int, tensor: Any, *, deadline_us: int = 0, timeout_s: float | None = None) -> Result:
        """Send one request (an array, or a mapping of names to arrays) and wait for its Result (raises
        RequestLost after the timeout, MalformedAnswer for an OK answer that does not decode)."""
        return self.submit(app_id, tensor, deadline_us=deadline_us, timeout_s=timeout_s).result()

    def infer_many(self, app_id: int, tensors: Sequence[Any], *, deadline_us: int = 0,
                   timeout_s: float | None = None) -> list[Result]:
        """Send every tensor (array or mapping) at once, all in flight together, and return their Results
        in order. They are sent as one query (every request but the last says more follow,
        `wire.FLAG_MORE`): the instance serves them as one batch when its ``max_batch`` and their
        deadline allow (MultiStream)."""
        last = len(tensors) - 1
        futs = [self.submit(app_id, t, deadline_us=deadline_us, timeout_s=timeout_s, more=i < last)
                for i, t in enumerate(tensors)]
        return [f.result() for f in futs]

    def _send(self, p: _Pending) -> None:
        """Send (or send again) ``p`` under a new request id. Registered as pending before its first
        datagram leaves, so an answer cannot come before it is expected: its expiry counts from now,
        and its ``first_ns`` (the latency's start) is the first attempt's."""
        rid = self._book.new_id()
        now = time.monotonic_ns()
        with self._lock:
            p.rid, p.attempts, p.attempts_left = rid, p.attempts + 1, p.attempts_left - 1
            p.first_ns = p.first_ns or now
            p.expires_ns = now + p.timeout_ns
            self._pending[(p.app_id, rid)] = p
        to = p.to or self.node
        # A traced request's timestamps are written under the lock the receive thread takes to resolve
        # it, so an answer that comes back before the send call returns still reads them all.
        traced = self._lock if self.trace else contextlib.nullcontext()
        try:
            with traced:
                self._send_datagrams(p, rid, to)
        except OSError:
            with self._lock:
                self._pending.pop((p.app_id, rid), None)
            raise

    def _send_datagrams(self, p: _Pending, rid: int, to: tuple[str, int]) -> None:
        if self._native_send:
            try:  # one system call for all of the request's datagrams
                ts, rest = self._book.send(self._sock, to, p.app_id, rid, p.body, p.deadline_us, p.flags)
                for d in rest:  # only if the socket's buffer filled (a blocking socket waits instead)
                    self._sock.sendto(d, to)
                if self.trace:
                    p.client_ts_ns = ts
                    p.first_sent_ns = p.last_sent_ns = time.monotonic_ns()  # all sent in that one call
                return
            except ValueError:  # a host name, not a numeric address: sendto resolves it
                self._native_send = False
        dgrams, ts = self._book.encode(p.app_id, rid, p.body, p.deadline_us, p.flags)
        self._sock.sendto(dgrams[0], to)
        if self.trace:
            p.client_ts_ns, p.first_sent_ns = ts, time.monotonic_ns()
        for d in dgrams[1:]:
            self._sock.sendto(d, to)
        if self.trace:
            p.last_sent_ns = time.monotonic_ns()

    def _send_again(self, p: _Pending) -> None:
        """A retry from the receive thread: a send error fails the request instead of the thread."""
        try:
            self._send(p)
        except OSError as e:
            assert p.future is not None
            p.future.set_exception(e)

    def _recv_loop(self) -> None:
        sock = self._sock
        while not self._stop.is_set():
            select.select([sock], [], [], self._wait_s())
            while True:
                try:
                    data = sock.recv(65536, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:  # ICMP errors from an earlier send, or a closed socket
                    if self._stop.is_set():
                        return
                    break
                r = self._book.feed(data)
                if r is not None:
                    self._resolve(r, time.monotonic_ns())
            self._expire(time.monotonic_ns())

    def _wait_s(self) -> float:
        with self._lock:
            if not self._pending:
                return 0.05
            first = min(p.expires_ns for p in self._pending.values())
        return min(0.05, max(0.0, (first - time.monotonic_ns()) / 1e9))

    def _resolve(self, r: wire.Response, now_ns: int) -> None:
        with self._lock:
            p = self._pending.pop((r.app_id, r.request_id), None)
        if p is None:
            self._book.stray += 1
            return
        status = _status(r.status)
        if status in RETRY_STATUSES and p.attempts_left > 0:
            self._send_again(p)
            return
        assert p.future is not None
        try:
            res = _answer(p.app_id, r.request_id, r, status, (now_ns - p.first_ns) / 1e6, p.attempts)
        except MalformedAnswer as e:  # the caller's error, not the receive thread's
            self._book.malformed += 1
            p.future.set_exception(e)
            return
        if self.trace:
            # the send timestamps are read as the send call returns; an answer read before that (the
            # sender descheduled) proves its datagrams had left by then
            res = dataclasses.replace(res, trace=ClientTrace(p.start_ns, p.client_ts_ns, min(p.first_sent_ns, now_ns),
                                                             min(p.last_sent_ns, now_ns), now_ns))
        p.future.set_result(res)

    def _expire(self, now_ns: int) -> None:
        with self._lock:
            gone = [(k, p) for k, p in self._pending.items() if p.expires_ns <= now_ns]
            for k, _ in gone:
                del self._pending[k]
        for (app, rid), p in gone:
            self._book.asm.forget(app, rid)
            if p.attempts_left > 0:
                self._send_again(p)
            else:
                assert p.future is not None
                p.future.set_exception(RequestLost(app, rid, p.timeout_ns / 1e9, p.attempts))

    def close(self) -> None:
        """Stop the receive thread and close the socket; pending requests raise RequestLost."""
        self._fin()
        with self._lock:
            left = list(self._pending.values())
            self._pending.clear()
        for p in left:
            assert p.future is not None
            if not p.future.done():
                p.future.set_exception(RequestLost(p.app_id, p.rid, p.timeout_ns / 1e9, p.attempts))

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_sync(stop: threading.Event, thread: threading.Thread, sock: socket.socket) -> None:
    stop.set()
    if thread is not threading.current_thread():
        thread.join()
    sock.close()


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, client: AsyncClient) -> None:
        self.client = client

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.client._on_datagram(data)

    def error_received(self, exc: Exception) -> None:
        # ICMP port unreachable for an earlier send: the node is not there; the request times out.
        self.client.send_errors += 1


class AsyncClient:
    """asyncio client: ``await infer(...)``; run many with ``asyncio.gather``. Use ``async with``.

    Bound to the event loop that opened it (``await open()`` or ``async with``).
    """

    def __init__(self, node: Address = ("127.0.0.1", 9000), *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 retries: int = 0, chunk_payload: int = wire.DEFAULT_CHUNK_PAYLOAD,
                 bind_host: str | None = None) -> None:
        _check_args(timeout_s, retries, chunk_payload)
        self.node = (str(node[0]), int(node[1]))
        self.timeout_s, self.retries = float(timeout_s), retries
        self.bind_host = bind_host
        self._book = _Book(chunk_payload)
        self._pending: dict[tuple[int, int], asyncio.Future[tuple[wire.Response, int]]] = {}
        self._transport: asyncio.DatagramTransport | None = None
        self._native_send = True  # until the node's address turns out not to be numeric
        self.send_errors = 0

    async def open(self) -> AsyncClient:
        if self._transport is not None:
            return self
        sock = _make_socket(self.node, self.bind_host)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        self._transport, _ = await loop.create_datagram_endpoint(lambda: _Protocol(self), sock=sock)
        return self

    @property
    def address(self) -> Address:
        if self._transport is None:
            raise RuntimeError("client is not open")
        return self._transport.get_extra_info("sockname")[:2]

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    @property
    def stray(self) -> int:
        return self._book.stray

    @property
    def malformed(self) -> int:
        """OK answers whose multi-tensor body did not decode (each raised MalformedAnswer)."""
        return self._book.malformed

    def _on_datagram(self, data: bytes) -> None:
        r = self._book.feed(data)
        if r is None:
            return
        fut = self._pending.pop((r.app_id, r.request_id), None)
        if fut is None or fut.done():
            self._book.stray += 1
            return
        fut.set_result((r, time.monotonic_ns()))

    async def infer(self, app_id: int, tensor: Any, *, deadline_us: int = 0,
                    timeout_s: float | None = None, more: bool = False) -> Result:
        """Send one request (an array, or a mapping of names to arrays) and await its Result (raises
        RequestLost after the timeout, MalformedAnswer for an OK answer that does not decode). ``more``:
        another request of the same query follows at once (`Client.submit`)."""
        if self._transport is None:
            raise RuntimeError("client is not open: use 'async with AsyncClient(...)' or 'await open()'")
        body = request_body(tensor)
        t = self.timeout_s if timeout_s is None else timeout_s
        _check_args(t, self.retries, self._book.chunk_payload)
        _check_request(app_id, deadline_us)
        app_id = int(app_id)
        loop = asyncio.get_running_loop()
        first_ns = 0
        rid = 0
        for attempt in range(1, self.retries + 2):
            rid = self._book.new_id()
            flags = wire.FLAG_MORE if more else 0
            fut: asyncio.Future[tuple[wire.Response, int]] = loop.create_future()
            key = (app_id, rid)
            self._pending[key] = fut
            ts = self._send(app_id, rid, body, deadline_us, flags)
            first_ns = first_ns or ts
            try:
                r, recv_ns = await asyncio.wait_for(fut, t)
            except (asyncio.TimeoutError, TimeoutError):
                self._pending.pop(key, None)
                self._book.asm.forget(app_id, rid)
                continue
            except BaseException:  # cancelled: forget the request so a late answer counts as stray
                self._pending.pop(key, None)
                self._book.asm.forget(app_id, rid)
                raise
            status = _status(r.status)
            if status in RETRY_STATUSES and attempt <= self.retries:
                continue
            try:
                return _answer(app_id, rid, r, status, (recv_ns - first_ns) / 1e6, attempt)
            except MalformedAnswer:
                self._book.malformed += 1
                raise
        raise RequestLost(app_id, rid, t, self.retries + 1)

    def _send(self, app_id: int, rid: int, body: _Body, deadline_us: int, flags: int) -> int:
        """Send one request's datagrams; returns its client_ts_ns. In one native call (sendmmsg) on the
        transport's socket while asyncio holds nothing unsent for it (what the call cannot send, a full
        buffer, goes through the transport as the rest would); a datagram each through the transport
        for a node named by host name."""
        assert self._transport is not None
        if self._native_send and not self._transport.get_write_buffer_size():
            sock = self._transport.get_extra_info("socket")
            try:
                ts, rest = self._book.send(sock.fileno(), self.node, app_id, rid, body, deadline_us, flags)
            except ValueError:  # a host name, not a numeric address
                self._native_send = False
            except OSError:  # nothing sent (an error comes from the first datagram): asyncio's way reports it
                pass
            else:
                for d in rest:
                    self._transport.sendto(d, self.node)
                return ts
        dgrams, ts = self._book.encode(app_id, rid, body, deadline_us, flags)
        for d in dgrams:
            self._transport.sendto(d, self.node)
        return ts

    async def infer_many(self, app_id: int, tensors: Sequence[Any], *, deadline_us: int = 0,
                         timeout_s: float | None = None) -> list[Result]:
        """All tensors (arrays or mappings) in flight together, as one query (`Client.infer_many`);
        Results in order (the first RequestLost or MalformedAnswer is raised)."""
        last = len(tensors) - 1
        return list(await asyncio.gather(*(self.infer(app_id, x, deadline_us=deadline_us, timeout_s=timeout_s,
                                                      more=i < last) for i, x in enumerate(tensors))))

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        for fut in self._pending.values():
            if not fut.done():
                fut.cancel()
        self._pending.clear()

    async def __aenter__(self) -> AsyncClient:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        self.close()


# ---- fleet mode -------------------------------------------------------------------------------------

#: Statuses after which a fleet client sends the request again to the app's other copy.
FAILOVER_STATUSES = frozenset({Status.UNKNOWN_APP, Status.INSTANCE_FAILED, Status.SHUTTING_DOWN})


class FleetClient:
    """A client of a fleet of nodes (docs/fleet.md): it sends each request straight to the node that
    owns the app, by a versioned routing table fetched from any node's agent (``GET /fleet/routes``).

    When no answer comes within ``failover_s`` (or the owner answers that it lost the app), the
    client refreshes the table and sends the request again, under a new request id, to the app's
    new owner or its standby; the request stays open on both, the first answer wins and a later one
    is counted in :attr:`duplicates`, never returned. ``timeout_s`` bounds the whole request.
    """

    def __init__(self, seeds: Sequence[str], *, failover_s: float = 0.5, timeout_s: float = DEFAULT_TIMEOUT_S,
                 bind_host: str | None = None, fetch_timeout_s: float = 1.0) -> None:
        if not seeds:
            raise ValueError("give at least one seed URL (http://host:routes_port of any node's agent)")
        if not 0 < failover_s < timeout_s:
            raise ValueError(f"need 0 < failover_s < timeout_s, got {failover_s} and {timeout_s}")
        self.seeds = list(seeds)
        self.failover_s, self.timeout_s, self.fetch_timeout_s = failover_s, timeout_s, fetch_timeout_s
        self.table: dict[str, Any] = {"version": -1, "apps": {}}
        self.duplicates = 0  # answers that came after the request was already answered
        self.failovers = 0  # requests sent a second time
        self.refreshes = 0
        self._lock = threading.Lock()
        self._refreshing: threading.Thread | None = None
        self._client = Client(("127.0.0.1", 9), timeout_s=timeout_s, bind_host=bind_host)
        self.refresh()

    def refresh(self) -> int:
        """Fetch the newest routing table from the first seed that answers; returns its version (an
        older table than the one held is ignored). Raises ConnectionError when no seed answers."""
        errors = []
        best: dict[str, Any] | None = None
        for url in list(self.seeds):
            try:
                with urllib.request.urlopen(url.rstrip("/") + "/fleet/routes", timeout=self.fetch_timeout_s) as r:
                    t = json.loads(r.read())
            except (OSError, ValueError) as e:
                errors.append(f"{url}: {e}")
                with self._lock:  # a seed that did not answer is asked last next time (a dead machine's)
                    if url in self.seeds:
                        self.seeds.remove(url)
                        self.seeds.append(url)
                continue
            if best is None or int(t.get("version", -1)) > int(best.get("version", -1)):
                best = t
            if int(best.get("version", -1)) > 0:
                break
        if best is None:
            raise ConnectionError("no node served the fleet's routing table: " + "; ".join(errors))
        with self._lock:
            self.refreshes += 1
            if int(best.get("version", -1)) >= int(self.table.get("version", -1)):
                self.table = best
            return int(self.table["version"])

    def _route(self, app: str) -> dict[str, Any]:
        r = self.table.get("apps", {}).get(app)
        if r is None:
            raise KeyError(f"the fleet's routing table (version {self.table.get('version')}) has no app {app!r}; "
                           f"apps: {', '.join(sorted(self.table.get('apps', {}))) or 'none'}")
        return r

    def infer(self, app: str, tensor: Any, *, deadline_us: int = 0) -> Result:
        """Send one request of ``app`` and return its first answer (raises RequestLost when neither
        copy answers within ``timeout_s``)."""
        route = self._route(app)
        t0 = time.monotonic()
        first = self._client.submit(route["app_id"], tensor, deadline_us=deadline_us, timeout_s=self.timeout_s,
                                    to=(route["primary"]["host"], route["primary"]["udp_port"]))
        futs = [first]
        done, _ = concurrent.futures.wait(futs, timeout=self.failover_s)
        winner = self._settled(done)
        if winner is None:
            target = self._second(app, route)
            if target is not None:
                left = max(0.05, self.timeout_s - (time.monotonic() - t0))
                self.failovers += 1
                futs.append(self._client.submit(route["app_id"], tensor, deadline_us=deadline_us, timeout_s=left,
                                                to=target))
            winner = self._first_answer(futs, t0)
        for f in futs:
            if f is not winner:
                f.add_done_callback(self._count_late)
        return winner.result()

    def _settled(self, done: set[concurrent.futures.Future[Result]]) -> concurrent.futures.Future[Result] | None:
        for f in done:
            if f.exception() is None and f.result().status not in FAILOVER_STATUSES:
                return f
        return None

    def _second(self, app: str, route: dict[str, Any]) -> Address | None:
        """Where to send again: the standby the table already names, at once (the table is refreshed
        beside it, so the next requests follow a flip; a silent machine's routes server must not hold
        the re-send for a fetch timeout); without one, the refreshed table's primary if it moved."""
        old = (route["primary"]["host"], route["primary"]["udp_port"])
        standby = route.get("standby")
        if standby and (standby["host"], standby["udp_port"]) != old:
            self._refresh_beside()
            return (standby["host"], standby["udp_port"])
        try:
            self.refresh()
            new = self._route(app)
        except (ConnectionError, KeyError):
            new = route
        for cand in (new.get("primary"), new.get("standby")):
            if cand and (cand["host"], cand["udp_port"]) != old:
                return (cand["host"], cand["udp_port"])
        return None

    def _refresh_beside(self) -> None:
        """Refresh the table on a thread of its own, one at a time."""
        with self._lock:
            if self._refreshing is not None and self._refreshing.is_alive():
                return

            def run() -> None:
                with contextlib.suppress(ConnectionError):
                    self.refresh()

            self._refreshing = threading.Thread(target=run, name="fleet-refresh", daemon=True)
            self._refreshing.start()

    def _first_answer(self, futs: list[concurrent.futures.Future[Result]], t0: float) -> concurrent.futures.Future[Result]:
        pending = set(futs)
        last: concurrent.futures.Future[Result] = futs[-1]
        while pending:
            done, pending = concurrent.futures.wait(pending, timeout=max(0.0, self.timeout_s - (time.monotonic() - t0)),
                                                    return_when=concurrent.futures.FIRST_COMPLETED)
            if not done:
                break
            f = self._settled(done)
            if f is not None:
                return f
            last = next(iter(done))
        return last

    def _count_late(self, f: concurrent.futures.Future[Result]) -> None:
        if f.exception() is None:
            with self._lock:
                self.duplicates += 1

    def close(self) -> None:
        t = self._refreshing
        if t is not None:  # a refresh in flight ends within its fetch timeouts
            t.join(timeout=self.fetch_timeout_s * len(self.seeds) + 1.0)
        self._client.close()

    def __enter__(self) -> FleetClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
