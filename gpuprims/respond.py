"""Responses from an app instance back to each request's client, sent natively in batches."""

from __future__ import annotations

import socket

import numpy as np

from gpuprims import _native
from gpuprims.pool import RECORD_DTYPE
from gpuprims.wire import DEFAULT_CHUNK_PAYLOAD, DType, Status


class Responder:
    """Sends wire-v1 responses with sendmmsg from one UDP socket of its own.

    ``info`` is what :meth:`PacketPool.requests` returned for the batch (so the records may already
    be released), ``statuses`` one Status per request, ``body`` one result row per request (sent
    only for OK requests).
    """

    def __init__(self, *, family: int = socket.AF_INET, chunk_payload: int = DEFAULT_CHUNK_PAYLOAD) -> None:
        if not 0 < chunk_payload <= 65507 - 48:
            raise ValueError(f"chunk_payload must be in 1..65459, got {chunk_payload}")
        self.chunk_payload = chunk_payload
        self._sock = socket.socket(family, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        self.sent_datagrams = 0

    def send(self, info: np.ndarray, statuses: np.ndarray | int, body: np.ndarray | None = None) -> int:
        """Send one response per request; returns the datagrams sent."""
        if info.dtype != RECORD_DTYPE:
            raise ValueError("info must be records from PacketPool.requests()")
        n = info.shape[0]
        if n == 0:
            return 0
        st = np.full(n, int(statuses), np.uint16) if np.isscalar(statuses) else np.ascontiguousarray(statuses, np.uint16)
        if st.shape != (n,):
            raise ValueError(f"need {n} statuses, got shape {st.shape}")
        dtype = DType.BYTES
        rows = None
        if body is not None:
            body = np.ascontiguousarray(body)
            if body.shape[0] != n:
                raise ValueError(f"need {n} body rows, got {body.shape[0]}")
            try:
                dtype = DType.from_numpy(body.dtype)
            except ValueError:
                dtype = DType.BYTES
            rows = body.reshape(n, -1).view(np.uint8)
        raw = np.ascontiguousarray(info).view(np.uint8).reshape(n, RECORD_DTYPE.itemsize)
        sent = int(_native.send_responses(self._sock.fileno(), raw, st, rows, int(dtype), self.chunk_payload))
        self.sent_datagrams += sent
        return sent

    def send_status(self, info: np.ndarray, status: Status) -> int:
        """Answer every request in ``info`` with ``status`` and no body."""
        return self.send(info, int(status), None)

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Responder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
