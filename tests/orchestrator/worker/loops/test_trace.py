"""The opt-in stage trace's file (orchestrator/worker/loops/trace.py); an instance writing it is tested in
tests/orchestrator/worker/test_instance.py."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from orchestrator.worker.loops.trace import TRACE_ENV, StageTrace, TracedRequest, read_trace


def test_the_trace_is_off_unless_its_variable_names_a_directory(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    monkeypatch.delenv(TRACE_ENV, raising=False)
    assert StageTrace.from_env("a-0") is None
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "t"))
    trace = StageTrace.from_env("a-0")
    assert trace is not None and trace.path.parent == tmp_path / "t"
    trace.close()


def test_read_trace_returns_each_row_and_skips_a_line_cut_short(tmp_path: Path) -> None:
    row = TracedRequest("a-0", 7, 1, 2, 3, 4, 5, 6, 7, 8, 1)
    trace = StageTrace(tmp_path / "a-0-1.trace.jsonl")
    trace.write([row])
    trace.close()
    trace.close()  # twice: nothing left to close
    with (tmp_path / "a-0-2.trace.jsonl").open("w") as f:
        f.write(json.dumps(asdict(row))[:20])  # an instance that ended mid-write
    assert read_trace(tmp_path) == [row]
