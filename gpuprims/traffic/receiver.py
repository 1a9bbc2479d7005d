"""Receiving responses: a thread driving the native recvmmsg loop, and matching them to requests.

`Receiver` records the header of every datagram that arrives on the client sockets, with its
receive time on CLOCK_MONOTONIC (the kernel's receive timestamp where there is one). `Tracker` reassembles responses, matches each to a sent
request by (app_id, request_id) and classifies it: the first answer within the timeout is
*answered*, a first answer after it is *late*, later answers are *duplicates*, and answers to
requests never sent are *unmatched*; datagrams that are not valid responses are *invalid*, by reason.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from gpuprims import wire
from gpuprims.traffic.stream import Plan

#: One received datagram, as the native receiver records it (Record in native/src/traffic.h).
RECORD_DTYPE = np.dtype([
    ("recv_ns", "<i8"), ("request_id", "<u8"), ("client_ts_ns", "<u8"), ("aux0", "<u8"), ("aux1", "<u8"),
    ("payload_off", "<u8"), ("chunk_index", "<u4"), ("chunk_count", "<u4"), ("payload_len", "<u4"),
    ("total_len", "<u4"), ("app_id", "<u2"), ("status", "<u2"), ("sock", "<u2"), ("verdict", "u1"),
    ("dtype", "u1"),
])

NONE, ANSWERED, LATE = 0, 1, 2


class Receiver:
    """Receives on `sockets` in a background thread until `stop()`; `drain()` hands over records.

    Receive times are the kernel's receive timestamps mapped to CLOCK_MONOTONIC (`kernel_ts`, the
    default), so they do not include this thread's wake-up; else the time recvmmsg returned.
    With `record=False` it only counts (a sink); with `gro` the sockets take UDP GRO, so coalesced
    datagrams arrive in one buffer and are split again (counts stay per datagram).
    """

    def __init__(self, sockets: Sequence, *, batch: int = 256, keep_payloads: bool = False,
                 record: bool = True, gro: bool = False, kernel_ts: bool = True) -> None:
        from gpuprims import _native

        assert RECORD_DTYPE.itemsize == _native.TRAFFIC_RECORD_SIZE
        self.sockets = list(sockets)
        self._native = _native.TrafficReceiver([s.fileno() for s in self.sockets], batch, record, keep_payloads, gro,
                                               kernel_ts)
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self, until_ns: int = 0) -> None:
        if self._thread is not None:
            raise RuntimeError("a Receiver runs once")
        self._thread = threading.Thread(target=self._run, args=(until_ns,), name="gpuprims-traffic-recv",
                                        daemon=True)
        self._thread.start()

    def _run(self, until_ns: int) -> None:
        try:
            self._native.run(until_ns)
        except BaseException as e:
            self.error = e

    def stop(self) -> None:
        self._native.stop()
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise self.error

    def drain(self) -> tuple[np.ndarray, bytes]:
        recs, payload = self._native.drain()
        return np.frombuffer(recs, dtype=RECORD_DTYPE), payload

    def stats(self) -> dict:
        return dict(self._native.stats())


class Tracker:
    """Matches responses to the requests of a plan; `sent_ns` is filled in by the sender as it goes."""

    def __init__(self, plan: Plan, sent_ns: np.ndarray, *, timeout_ns: int, keep_payloads: bool = False) -> None:
        self.plan = plan
        self.sent_ns = sent_ns
        self.timeout_ns = int(timeout_ns)
        self.keep_payloads = keep_payloads
        n = plan.n_events
        req = plan.ev_app >= 0
        keys = np.where(req, (plan.ev_app.astype(np.uint64) << np.uint64(48)) | plan.ev_rid, np.uint64(2**64 - 1))
        self._order = np.argsort(keys, kind="stable")
        self._keys = keys[self._order]
        self.state = np.zeros(n, np.uint8)
        self.recv_ns = np.full(n, -1, np.int64)
        self.status = np.zeros(n, np.uint16)
        self.answers = np.zeros(n, np.uint32)
        self.echo_ts = np.zeros(n, np.uint64)
        self.aux = np.zeros((n, 2), np.uint64)
        self.bodies: dict[int, bytes] = {}
        self.unmatched = 0
        self.invalid: dict[str, int] = {}
        self.echo_mismatch = 0
        self.datagrams = 0
        self.last_recv_ns = -1
        self.resolved = 0  # requests with a first answer (answered or late)
        self._partial: dict[tuple[int, int, int], dict] = {}

    @property
    def answered(self) -> int:
        return int((self.state == ANSWERED).sum())

    def outstanding(self, n_sent: int | None = None) -> int:
        """Requests sent and neither answered nor late yet (`n_sent`: requests sent, if known)."""
        if n_sent is not None:
            return n_sent - self.resolved
        return int(((self.sent_ns >= 0) & (self.state == NONE) & (self.plan.ev_app >= 0)).sum())

    def incomplete(self) -> int:
        """Responses of which some but not all chunks arrived."""
        return len(self._partial)

    def feed(self, recs: np.ndarray, payload: bytes = b"") -> None:
        if len(recs) == 0:
            return
        self.datagrams += len(recs)
        self.last_recv_ns = max(self.last_recv_ns, int(recs["recv_ns"].max()))
        bad = recs["verdict"] != 0
        if bad.any():
            for v, c in zip(*np.unique(recs["verdict"][bad], return_counts=True)):
                name = wire.Verdict(int(v)).name.lower() if v <= max(wire.Verdict) else f"verdict_{v}"
                self.invalid[name] = self.invalid.get(name, 0) + int(c)
            recs = recs[~bad]
        single = recs["chunk_count"] == 1
        done = recs[single]
        bodies: list[bytes | None] = []
        if self.keep_payloads:
            bodies = [payload[o:o + n] for o, n in zip(done["payload_off"].tolist(), done["payload_len"].tolist())]
        if (~single).any():
            extra, extra_bodies = self._assemble(recs[~single], payload)
            if len(extra):
                done = np.concatenate([done, extra])
                bodies += extra_bodies
                order = np.argsort(done["recv_ns"], kind="stable")
                done = done[order]
                if self.keep_payloads:
                    bodies = [bodies[i] for i in order]
        self._match(done, bodies)

    def _assemble(self, recs: np.ndarray, payload: bytes) -> tuple[np.ndarray, list[bytes | None]]:
        out, out_bodies = [], []
        for r in recs:
            key = (int(r["sock"]), int(r["app_id"]), int(r["request_id"]))
            st = self._partial.setdefault(key, {"count": int(r["chunk_count"]), "total": int(r["total_len"]),
                                                "parts": {}})
            if (st["count"], st["total"]) != (int(r["chunk_count"]), int(r["total_len"])):
                self.invalid["bad_total"] = self.invalid.get("bad_total", 0) + 1
                continue
            o, n = int(r["payload_off"]), int(r["payload_len"])
            st["parts"][int(r["chunk_index"])] = payload[o:o + n] if self.keep_payloads else None
            if len(st["parts"]) == st["count"]:
                del self._partial[key]
                out.append(r)
                out_bodies.append(b"".join(st["parts"][i] for i in range(st["count"])) if self.keep_payloads else None)
        return (np.array(out, dtype=RECORD_DTYPE) if out else np.zeros(0, RECORD_DTYPE)), out_bodies

    def _match(self, done: np.ndarray, bodies: list[bytes | None]) -> None:
        if len(done) == 0:
            return
        keys = (done["app_id"].astype(np.uint64) << np.uint64(48)) | (done["request_id"] & np.uint64(2**48 - 1))
        pos = np.searchsorted(self._keys, keys)
        pos_c = np.minimum(pos, len(self._keys) - 1)
        hit = (pos < len(self._keys)) & (self._keys[pos_c] == keys) & (done["request_id"] < np.uint64(2**48))
        idx = np.where(hit, self._order[pos_c], -1)
        safe = np.maximum(idx, 0)
        hit &= np.where(hit, (self.sent_ns[safe] >= 0) & (self.plan.ev_app[safe] >= 0), False)
        self.unmatched += int((~hit).sum())
        idx_h = idx[hit]
        d = done[hit]
        if len(idx_h) == 0:
            return
        before = self.answers[idx_h].copy()
        np.add.at(self.answers, idx_h, 1)
        _, first_pos = np.unique(idx_h, return_index=True)
        first = np.zeros(len(idx_h), bool)
        first[first_pos] = True
        first &= before == 0
        fi = idx_h[first]
        fd = d[first]
        lat = fd["recv_ns"] - self.sent_ns[fi]
        self.state[fi] = np.where(lat > self.timeout_ns, LATE, ANSWERED)
        self.resolved += len(fi)
        self.recv_ns[fi] = fd["recv_ns"]
        self.status[fi] = fd["status"]
        self.echo_ts[fi] = fd["client_ts_ns"]
        self.aux[fi, 0] = fd["aux0"]
        self.aux[fi, 1] = fd["aux1"]
        self.echo_mismatch += int((fd["client_ts_ns"] != self.sent_ns[fi].astype(np.uint64)).sum())
        if self.keep_payloads:
            hit_bodies = [b for b, h in zip(bodies, hit) if h]
            for i, b in zip(fi.tolist(), (b for b, f in zip(hit_bodies, first) if f)):
                self.bodies[i] = b if b is not None else b""

    def duplicates(self, mask: np.ndarray | None = None) -> int:
        extra = np.maximum(self.answers.astype(np.int64) - 1, 0)
        return int(extra.sum() if mask is None else extra[mask].sum())
