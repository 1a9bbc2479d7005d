"""A loopback test client for a running Node: send requests, collect one response each."""

from __future__ import annotations

import socket
import time
from typing import Any

import numpy as np

from gpuprims import wire


def ask(node: Any, xs: dict[int, tuple[int, np.ndarray]], timeout_s: float = 120.0) -> dict[int, wire.Response]:
    """Send request ``rid`` of app ``app`` with body ``x`` for each ``rid: (app, x)``; pump the node's
    control loop while collecting the responses; return them by request id."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.settimeout(0.05)
    try:
        for rid, (app, x) in xs.items():
            for d in wire.encode_request(app, rid, x):
                sock.sendto(d, ("127.0.0.1", node.ingest.ports[0]))
        asm, got = wire.ResponseAssembler(), {}
        deadline = time.monotonic() + timeout_s
        while len(got) < len(xs) and time.monotonic() < deadline:
            try:
                r = asm.feed(sock.recv(65536))
            except TimeoutError:
                node.step(10)
                continue
            if r is not None:
                got[r.request_id] = r
        return got
    finally:
        sock.close()
