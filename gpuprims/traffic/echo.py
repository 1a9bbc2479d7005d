"""A loopback echo server: reassembles requests and answers each after a set delay.

It stands in for a node in tests and benchmarks. Each answer echoes the request's client_ts_ns and,
with `stamp` (default), carries in its first 16 body bytes the server's own CLOCK_MONOTONIC times:
when the request's last chunk arrived and when the answer was sent. On loopback the clock is shared,
so a client can split its measured latency into outbound transit, hold time and inbound transit.

Faults for testing a client: drop every n-th answer, answer every n-th twice, send an answer to a
request never made every n-th time, or hold every n-th answer `late_delay_s` instead of `delay_s`.
"""

from __future__ import annotations

import heapq
import os
import select
import socket
import struct
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from gpuprims import wire
from gpuprims.traffic.stream import parse_addr

_FIELDS = struct.Struct("<IBBHHBBIIIQIIQ")  # the whole v1 header, as wire.FIELDS orders it


@dataclass
class EchoCounters:
    datagrams: int = 0
    invalid: int = 0
    requests: int = 0
    responses: int = 0
    dropped: int = 0
    by_app: dict[int, int] = field(default_factory=dict)
    sources: set[tuple[str, int]] = field(default_factory=set)


class EchoServer:
    """UDP echo of gpuprims requests on `host:port` (port 0 picks one), in a background thread."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, delay_s: float = 0.0,
                 status: int = wire.Status.OK, response_bytes: int = 16, stamp: bool = True,
                 drop_every: int = 0, duplicate_every: int = 0, unmatched_every: int = 0, late_every: int = 0,
                 late_delay_s: float = 0.0, chunk_payload: int = wire.DEFAULT_CHUNK_PAYLOAD,
                 spin_us: float = 0.0) -> None:
        for name, v in (("delay_s", delay_s), ("late_delay_s", late_delay_s), ("spin_us", spin_us)):
            if not v >= 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
        for name, v in (("drop_every", drop_every), ("duplicate_every", duplicate_every),
                        ("unmatched_every", unmatched_every), ("late_every", late_every),
                        ("response_bytes", response_bytes)):
            if v < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
        if stamp and response_bytes < 16:
            raise ValueError(f"stamped answers need response_bytes >= 16, got {response_bytes}")
        self.delay_ns = round(delay_s * 1e9)
        self.late_delay_ns = round(late_delay_s * 1e9)
        self.status = int(status)
        self.response_bytes = response_bytes
        self.stamp = stamp
        self.drop_every, self.duplicate_every = drop_every, duplicate_every
        self.unmatched_every, self.late_every = unmatched_every, late_every
        self.chunk_payload = chunk_payload
        self.spin_ns = round(spin_us * 1000)
        self.counters = EchoCounters()
        host, _ = parse_addr((host, 1))
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for opt, force in ((socket.SO_RCVBUF, 33), (socket.SO_SNDBUF, 32)):  # SO_*BUFFORCE as root
            try:
                self._sock.setsockopt(socket.SOL_SOCKET, force, 16 << 20)
            except OSError:
                self._sock.setsockopt(socket.SOL_SOCKET, opt, 16 << 20)
        self._sock.bind((host, port))
        self._sock.setblocking(False)
        self.address: tuple[str, int] = self._sock.getsockname()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fin = weakref.finalize(self, self._sock.close)

    @property
    def port(self) -> int:
        return self.address[1]

    def kernel_drops(self) -> int | None:
        """Datagrams the kernel dropped on this server's socket (its receive buffer full: the serving
        thread starved on a busy machine), from Linux's /proc/net/udp; None where that is not readable
        or the socket is closed."""
        try:
            inode = str(os.fstat(self._sock.fileno()).st_ino)
        except (OSError, ValueError):
            return None
        for table in ("/proc/net/udp", "/proc/net/udp6"):
            try:
                rows = Path(table).read_text().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                f = row.split()
                if len(f) >= 13 and f[9] == inode:
                    return int(f[-1])
        return None

    def start(self) -> EchoServer:
        self._thread = threading.Thread(target=self.serve, name="gpuprims-echo", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._fin()

    def __enter__(self) -> EchoServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def serve(self) -> None:
        """Serve until close() (runs in the caller's thread)."""
        from gpuprims import _native

        check = _native.check_request
        heap: list[tuple[int, int, tuple, tuple]] = []
        partial: dict[tuple, set[int]] = {}
        seq = 0
        sock = self._sock
        c = self.counters
        while not self._stop.is_set():
            now = time.monotonic_ns()
            timeout = 0.02
            if heap:
                left = heap[0][0] - now
                timeout = max(0.0, min(0.02, (left - self.spin_ns) / 1e9))
            if timeout > 0:
                select.select([sock], [], [], timeout)
            for _ in range(4096):
                try:
                    data, addr = sock.recvfrom(65536)
                except BlockingIOError:
                    break
                t_arr = time.monotonic_ns()
                c.datagrams += 1
                if check(data) != 0:
                    c.invalid += 1
                    continue
                h = _FIELDS.unpack_from(data)
                app, index, count, rid, ts = h[4], h[7], h[8], h[10], h[13]
                if count > 1:
                    key = (addr, app, rid)
                    got = partial.setdefault(key, set())
                    got.add(index)
                    if len(got) < count:
                        continue
                    del partial[key]
                c.requests += 1
                c.by_app[app] = c.by_app.get(app, 0) + 1
                c.sources.add(addr)
                n = c.requests
                if self.drop_every and n % self.drop_every == 0:
                    c.dropped += 1
                    continue
                delay = self.late_delay_ns if self.late_every and n % self.late_every == 0 else self.delay_ns
                copies = 2 if self.duplicate_every and n % self.duplicate_every == 0 else 1
                for _k in range(copies):
                    seq += 1
                    heapq.heappush(heap, (t_arr + delay, seq, addr, (app, rid, ts, t_arr)))
                if self.unmatched_every and n % self.unmatched_every == 0:
                    seq += 1
                    heapq.heappush(heap, (t_arr + delay, seq, addr, (app, rid + (1 << 40), ts, t_arr)))
            while heap:
                due = heap[0][0]
                now = time.monotonic_ns()
                if due > now:
                    if due - now > self.spin_ns:
                        break
                    while time.monotonic_ns() < due:
                        pass
                _, _, addr, (app, rid, ts, t_arr) = heapq.heappop(heap)
                self._answer(addr, app, rid, ts, t_arr)

    def _answer(self, addr: tuple, app: int, rid: int, ts: int, t_arr: int) -> None:
        body = bytearray(self.response_bytes)
        if self.stamp:
            struct.pack_into("<QQ", body, 0, t_arr, time.monotonic_ns())
        for d in wire.encode_response(app, rid, self.status, bytes(body), chunk_payload=self.chunk_payload,
                                      client_ts_ns=ts):
            try:
                self._sock.sendto(d, addr)
            except (BlockingIOError, ConnectionRefusedError):
                continue
        self.counters.responses += 1

