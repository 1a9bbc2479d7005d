"""The opt-in stage trace of an instance's fast path: one JSON line per request answered.

Off unless the instance's process has `TRACE_ENV` set; bench/single_stream ``--trace`` joins it with the
client's side (gpuprims.client ``trace``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

#: Opt-in trace of every request an instance answers on its fast path: the directory named by this
#: environment variable (of the instance's process) gets one JSON line per request (`TracedRequest`) in
#: ``<instance>-<pid>.trace.jsonl``. Unset (the default): nothing is timed or written beyond one check
#: per batch. bench/single_stream ``--trace`` joins it with the client's side (gpuprims.client ``trace``).
TRACE_ENV = "GPUPRIMS_TRACE_DIR"


log = logging.getLogger("gpuprims.instance")


@dataclass(frozen=True, slots=True)
class TracedRequest:
    """One request's way through the node, CLOCK_MONOTONIC ns (one clock for every process on a host,
    ``time.monotonic_ns``): ``client_ts_ns`` the client's clock when it built the request (the wire
    header's), ``first_ns`` its first datagram in at the ingest, ``complete_ns`` reassembly complete and
    pushed to the instance's ring, ``woke_ns`` the instance took its batch's first request off the ring,
    ``take_ns`` the batch started (after the batching wait), ``gathered_ns`` the batch gathered,
    ``model_ns`` the engine done, ``answered_ns`` the answers published to the answer ring (the ingest
    sends them); ``batch`` its batch's size."""

    instance: str
    request_id: int
    client_ts_ns: int
    first_ns: int
    complete_ns: int
    woke_ns: int
    take_ns: int
    gathered_ns: int
    model_ns: int
    answered_ns: int
    batch: int


class StageTrace:
    """Where an instance writes `TracedRequest` lines when `TRACE_ENV` names a directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = path.open("a", buffering=1)  # a line each: readable while running

    @classmethod
    def from_env(cls, instance: str) -> StageTrace | None:
        """The trace `TRACE_ENV` asks for, or None. A directory that cannot be written is logged and the
        instance serves untraced (a trace is a measurement aid, never a reason not to serve)."""
        where = os.environ.get(TRACE_ENV)
        if not where:
            return None
        try:
            d = Path(where)
            d.mkdir(parents=True, exist_ok=True)
            return cls(d / f"{instance}-{os.getpid()}.trace.jsonl")
        except OSError as e:
            log.warning("%s: %s=%r cannot be written (%s): serving untraced", instance, TRACE_ENV, where, e)
            return None

    def write(self, rows: list[TracedRequest]) -> None:
        if self._file is not None:
            self._file.write("".join(json.dumps(asdict(r)) + "\n" for r in rows))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_trace(directory: Path) -> list[TracedRequest]:
    """Every `TracedRequest` the instances wrote under `directory` (`TRACE_ENV`); a line cut short by an
    instance that ended mid-write is skipped."""
    out = []
    for path in sorted(directory.glob("*.trace.jsonl")):
        for line in path.read_text().splitlines():
            try:
                out.append(TracedRequest(**json.loads(line)))
            except (ValueError, TypeError):
                continue
    return out

