"""gpuprims/traffic/echo.py: the kernel's drops on the echo's socket are read, not guessed."""

from __future__ import annotations

import socket
import time

from gpuprims.traffic.echo import EchoServer


def test_kernel_drops_counts_what_a_full_receive_buffer_lost_and_none_once_closed() -> None:
    srv = EchoServer()  # not started: nothing reads its socket
    srv._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the kernel's smallest, about 4.6 kB
    assert srv.kernel_drops() == 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
        for _ in range(200):  # 200 kB into a buffer of a few: most are dropped
            tx.sendto(b"x" * 1000, srv.address)
    deadline = time.monotonic() + 10  # loopback delivers in the send call; the deadline is only a bound
    while not srv.kernel_drops() and time.monotonic() < deadline:
        time.sleep(0.01)
    drops = srv.kernel_drops()
    assert drops is not None and 100 <= drops < 200
    srv.close()
    assert srv.kernel_drops() is None
