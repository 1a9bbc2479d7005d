"""The node's assembly (orchestrator/node/assembly.py) on played instances: the parts unwind once, in order,
whatever stops them; the loop's duties are counted, timed and shown by status."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config.schema import NodeConfig, parse_config
from orchestrator.control.errors import StartError
from orchestrator.control.messages import Shutdown
from orchestrator.control.records import NodeView
from orchestrator.control.rundir import NodeRecord, proc_start_ticks, write_record
from orchestrator.control.status_format import format_status
from tests.orchestrator.conftest import NodeFactory, played


def _cfg(tmp_path: Path, **node: Any) -> NodeConfig:
    app: dict[str, Any] = {"name": "a", "model": "mobilenet_v2", "input_shape": [3, 8, 8], "slo_ms": 60_000,
                           "gpu_pct": 50, "max_batch": 4, "app_id": 1, "num_classes": 10, "shadow": True}
    return parse_config({"node": {"listen": {"host": "127.0.0.1", "port": 0}, "backend": "cpu",
                                  "run_dir": str(tmp_path / "run"),
                                  "pool": {"slot_count": 256, "max_chunks": 8, "record_count": 64}, **node},
                         "apps": [app]})


def test_the_loop_duties_are_counted_timed_and_shown_by_status(tmp_path: Path, node_factory: NodeFactory) -> None:
    node = node_factory(_cfg(tmp_path)).start()
    try:
        for _ in range(5):
            node.step(5)
        duties = node.status()["node"]["duties"]
        assert list(duties)[:2] == ["messages", "dispatch"]  # per message and per tick; the rest per pass
        assert {"reap", "hangs", "memory", "changes", "shadows"} <= set(duties)
        assert duties["reap"]["runs"] == 5 and duties["reap"]["failures"] == 0
        assert duties["messages"]["runs"] >= 1  # the shadow's Ready, at least
        assert duties["dispatch"]["runs"] == 0  # no live scheduler on a spatial node
        assert all(d["max_us"] >= d["mean_us"] >= 0 for d in duties.values())
        assert "loop duties (runs, mean/max us): messages " in format_status(NodeView.from_dict(node.status()))
        assert node.errors == {}
    finally:
        node.stop()


def test_stop_unwinds_once_and_a_second_stop_or_exit_does_nothing(tmp_path: Path, node_factory: NodeFactory) -> None:
    node = node_factory(_cfg(tmp_path))
    with node:
        run_dir = node.run_dir
        assert run_dir is not None and (run_dir / "token").exists()
        launcher = played(node)
        deadline = time.monotonic() + 30
        while not node.instances["a-s0"].ready and time.monotonic() < deadline:
            node.step(10)  # the shadow's Ready: a ready instance is told Shutdown (one still starting: SIGTERM)
        node.stop()
        assert node.server is None and node.pool is None and not node.instances
        assert not (run_dir / "token").exists() and not (run_dir / "node.json").exists()
        node.stop()  # nothing left to undo: no error, nothing undone twice
    assert sorted(i.spec.name for i in launcher.launched) == ["a-0", "a-s0"]
    for inst in launcher.launched:  # each told to stop exactly once, and gone
        assert [type(m) for m in inst.received].count(Shutdown) == 1 and inst.returncode is not None


def test_a_failed_start_unwinds_what_it_built(tmp_path: Path, node_factory: NodeFactory) -> None:
    node = node_factory(_cfg(tmp_path))
    played(node).fail_apps["a"] = ("ModuleNotFoundError", "no module named nothing")
    with pytest.raises(StartError, match="a-0 failed to start: ModuleNotFoundError"):
        node.start()
    assert node.server is None and node.pool is None and not node.instances
    assert not (tmp_path / "run" / "token").exists()
    node.stop()  # after a failed start: nothing to undo


def test_a_run_dir_a_live_node_holds_is_refused_and_left_as_it_is(tmp_path: Path, node_factory: NodeFactory) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    other = os.getppid()  # a live process that is not this one: the other node
    write_record(run, NodeRecord(pid=other, start_ticks=proc_start_ticks(other) or 0, started_at=time.time()))
    (run / "token").write_text("the other node's")
    node = node_factory(_cfg(tmp_path))
    with pytest.raises(StartError, match="a node is already running in"):
        node.start()
    assert (run / "token").read_text() == "the other node's" and (run / "node.json").exists()


def test_the_instances_stop_after_the_routes_and_before_the_data_path_and_run_dir(
        tmp_path: Path, node_factory: NodeFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    node = node_factory(_cfg(tmp_path)).start()
    sup, ingest, run_dir = node.supervisor, node.ingest, node.run_dir
    assert sup is not None and ingest is not None and run_dir is not None
    assert ingest.route(1)  # app a is served
    seen: list[Any] = []
    shutdown = sup.shutdown

    def watched(drain: bool, timeout_s: float, pump: Any) -> None:
        seen.append((drain, list(ingest.route(1)), (run_dir / "token").exists(), node.pool is not None,
                     node.changes.running == {}))
        shutdown(drain, timeout_s, pump)

    monkeypatch.setattr(sup, "shutdown", watched)
    node.stop(drain=False)
    node.stop()
    # Once, undrained as asked; no route left, the pool and the run dir still there.
    assert seen == [(False, [], True, True, True)]
    assert not (run_dir / "token").exists() and not node.instances
