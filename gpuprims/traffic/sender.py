"""The paced sender: a thread driving the native batch sender over a Plan.

The native loop sends every event at `t0 + ev_time_ns` (absolute schedule, never re-based), all
packets that are due in one `sendmmsg` per socket, consecutive equal-size packets to one destination
as one UDP GSO message. When it falls behind it sends what is due as fast as it can and the
achieved rate shows it; it never thins the schedule. Each request's `client_ts_ns` is its actual
send time (CLOCK_MONOTONIC), stamped right before the call that sends its first packet.
"""

from __future__ import annotations

import socket
import threading
import time
import weakref
from collections.abc import Sequence

import numpy as np

from gpuprims.traffic.stream import Plan

SOCKET_BUFFER_BYTES = 8 << 20


def parse_port_range(text: str | Sequence[int] | None) -> list[int]:
    """'40000-40015', '40000' or a list -> ports; None -> [0] (one ephemeral port)."""
    if text is None:
        return [0]
    if not isinstance(text, str):
        ports = [int(p) for p in text]
    else:
        lo, _, hi = text.partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"port range {text!r} is not PORT or LOW-HIGH") from None
        if b < a:
            raise ValueError(f"port range {text!r} is empty")
        ports = list(range(a, b + 1))
    if not ports or any(not 0 <= p < 65536 for p in ports):
        raise ValueError(f"ports must be in 0..65535, got {text!r}")
    if len(ports) > 1024:
        raise ValueError(f"at most 1024 client ports, got {len(ports)}")
    return ports


def open_sockets(ports: Sequence[int], bind_host: str = "127.0.0.1") -> list[socket.socket]:
    """One UDP socket per client port, bound, with large buffers. Raises OSError naming the port."""
    socks = []
    try:
        for p in ports:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            socks.append(s)
            for opt, force in ((socket.SO_SNDBUF, 32), (socket.SO_RCVBUF, 33)):  # SO_*BUFFORCE as root
                try:
                    s.setsockopt(socket.SOL_SOCKET, force, SOCKET_BUFFER_BYTES)
                except OSError:
                    s.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
            try:
                s.bind((bind_host, p))
            except OSError as e:
                raise OSError(e.errno, f"cannot bind client port {bind_host}:{p}: {e.strerror}") from None
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


class Sender:
    """Sends a Plan from `sockets` (requests take the sockets in turn) in a background thread.

    `start()` fixes t0 (now, or `t0_ns` on the CLOCK_MONOTONIC scale) and returns at once;
    `join()` waits; `stop()` ends the run after the request being sent. `sent_ns[e]` is event e's
    send time (-1 if not sent).
    """

    def __init__(self, plan: Plan, sockets: Sequence[socket.socket], *, gso: bool = True,
                 max_batch_pkts: int = 1024, spin_us: float = 20.0) -> None:
        from gpuprims import _native

        if not sockets:
            raise ValueError("Sender needs at least one socket")
        if not 1 <= max_batch_pkts <= 8192:
            raise ValueError(f"max_batch_pkts must be in 1..8192, got {max_batch_pkts}")
        self.plan = plan
        self.sockets = list(sockets)
        self._native = _native.TrafficSender([s.fileno() for s in self.sockets], gso, max_batch_pkts,
                                             round(spin_us * 1000))
        n = plan.n_events
        self.ev_sock = (np.arange(n) % len(self.sockets)).astype(np.uint16)
        self.sent_ns = np.full(n, -1, dtype=np.int64)
        self.t0_ns: int | None = None
        self.end_ns: int | None = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self, t0_ns: int | None = None) -> int:
        if self._thread is not None:
            raise RuntimeError("a Sender runs once")
        self.t0_ns = time.monotonic_ns() if t0_ns is None else int(t0_ns)
        self._thread = threading.Thread(target=self._run, name="gpuprims-traffic-send", daemon=True)
        self._thread.start()
        return self.t0_ns

    def _run(self) -> None:
        p = self.plan
        ips, ports = p.dest_arrays()
        stop_at = self.t0_ns + p.stop_at_ns if p.stop_at_ns else 0
        try:
            self._native.run(p.pool, p.pkt_off, p.pkt_len, p.pkt_patch, p.unit_first, p.unit_count, ips, ports,
                             p.ev_time_ns, p.ev_unit, p.ev_rid, self.ev_sock, p.ev_dest, self.sent_ns, self.t0_ns,
                             stop_at)
        except BaseException as e:  # surfaced by join()
            self.error = e
        finally:
            self.end_ns = time.monotonic_ns()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the run; True once it has ended. Re-raises an error of the send loop."""
        if self._thread is None:
            raise RuntimeError("Sender was not started")
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        if self.error is not None:
            raise self.error
        return True

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._native.stop()

    def progress(self) -> tuple[int, int, int]:
        """(requests, packets, bytes) sent so far."""
        return tuple(self._native.progress())  # type: ignore[return-value]

    def stats(self) -> dict:
        return dict(self._native.stats())


class SocketSet:
    """Client sockets a run owns; closed by close(), `with`, or when garbage collected."""

    def __init__(self, ports: Sequence[int], bind_host: str = "127.0.0.1") -> None:
        self.sockets = open_sockets(ports, bind_host)
        self._fin = weakref.finalize(self, _close_all, list(self.sockets))

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [s.getsockname() for s in self.sockets]

    def close(self) -> None:
        self._fin()

    def __enter__(self) -> SocketSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()
