"""The opt-in stage trace (orchestrator/worker/loops/trace.py): its file, and an instance writing it."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from gpuprims.wire import Status
from orchestrator.worker.loops.trace import TRACE_ENV, StageTrace, TracedRequest, read_trace
from tests.orchestrator.worker.inproc import answer, in_process_instance, send


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


def test_a_traced_instance_writes_each_requests_stage_timestamps_in_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "trace"))
    for inst, ing, sock in in_process_instance(slo_ms=60_000.0):  # a deadline no cold first run misses
        assert inst.serving.trace is not None
        for rid in (7, 8, 9):
            send(ing, sock, rid)
            assert answer(inst, sock).status == Status.OK
    rows = read_trace(tmp_path / "trace")
    assert sorted(r.request_id for r in rows) == [7, 8, 9]
    for r in rows:
        assert r.instance == "t-0" and r.batch == 1
        assert 0 < r.first_ns <= r.complete_ns <= r.woke_ns <= r.take_ns <= r.gathered_ns <= r.model_ns <= r.answered_ns


def test_an_instance_is_untraced_by_default_and_when_the_trace_directory_cannot_be_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TRACE_ENV, raising=False)
    for inst, _, _ in in_process_instance():
        assert inst.serving.trace is None
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(TRACE_ENV, str(blocker / "trace"))
    for inst, ing, sock in in_process_instance(slo_ms=60_000.0):
        assert inst.serving.trace is None  # logged, and served untraced
        send(ing, sock, 1)
        assert answer(inst, sock).status == Status.OK
