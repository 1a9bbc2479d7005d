from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from gpuprims.cuda.ipc import ParameterHandles
from orchestrator.control import rundir
from orchestrator.control.rundir import (
    NodeRecord,
    RunDirBusy,
    claim,
    find_nodes,
    node_state,
    read_record,
    reap,
    sweep_dead_segments,
    write_record,
)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _private(tmp_path: Path, name: str = "run") -> Path:
    d = tmp_path / name
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def shm_names() -> list[str]:
    """Shared-memory names a test creates; whatever a test leaves is removed."""
    names: list[str] = []
    yield names
    for n in names:
        (rundir.SHM_DIR / n).unlink(missing_ok=True)


def _segment(names: list[str], name: str, size: int = 4096) -> str:
    (rundir.SHM_DIR / name).write_bytes(b"\0" * size)
    names.append(name)
    return name


def test_start_ticks_tell_a_live_process_from_a_gone_one() -> None:
    me = rundir.proc_start_ticks(os.getpid())
    assert isinstance(me, int) and me > 0
    assert rundir.proc_start_ticks(_dead_pid()) is None
    rec = NodeRecord.for_this_process(name="me")
    assert rec.alive
    rec.start_ticks += 1  # the same pid started at another time: a recycled pid, not this node
    assert not rec.alive


def test_record_round_trip_and_update(tmp_path: Path) -> None:
    d = _private(tmp_path)
    assert read_record(d) is None
    rec = NodeRecord.for_this_process(config="/x/apps.yaml", name="n1")
    write_record(d, rec)
    assert read_record(d) == rec
    rundir.update_record(d, ports=[9000], urls={"metrics": "http://127.0.0.1:1/metrics"})
    back = read_record(d)
    assert back is not None and back.ports == [9000] and back.config == "/x/apps.yaml"
    assert "n1" in back.describe() and "9000" in back.describe() and "/x/apps.yaml" in back.describe()
    (d / rundir.RECORD_FILE).write_text("{not json")
    assert read_record(d) is None
    with pytest.raises(ValueError, match="no field"):
        rundir.update_record(d, colour="red")


def test_node_state_without_a_record(tmp_path: Path) -> None:
    d = _private(tmp_path)
    assert node_state(d) == "empty"
    (d / "token").write_text("x")
    assert node_state(d) == "starting"
    path = d / "command.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        srv.bind(str(path))
        srv.listen(1)
        assert node_state(d) == "live"
    assert node_state(d) == "dead"  # the socket file stays, nobody listens


def test_reap_removes_pool_params_and_run_dir(tmp_path: Path, shm_names: list[str]) -> None:
    d = _private(tmp_path)
    dead = _dead_pid()
    tag = uuid.uuid4().hex[:8]
    pool = _segment(shm_names, f"gpuprims-{dead}-{tag}", 8192)
    params = _segment(shm_names, f"gpuprims-params-{dead + 1}-{tag}", 4096)
    other = _segment(shm_names, f"gpuprims-params-{dead + 2}-{tag}")  # not this node's: stays
    h = ParameterHandles(backend="cpu", token=tag, pid=dead + 1, nbytes=4096, handle=params.encode(),
                         device_bus_id="", entries=())
    (d / "params-0.bin").write_bytes(h.to_bytes())
    for f in ("token", "control.sock", "command.sock"):
        (d / f).write_text("")
    write_record(d, NodeRecord(pid=dead, start_ticks=1, started_at=0.0, name="gone", ports=[9000]))
    (tmp_path / "current").symlink_to(d)
    assert node_state(d) == "dead"
    removed = reap(d)
    assert sorted(removed.shm) == sorted([pool, params]) and removed.shm_bytes == 8192 + 4096
    assert removed.dir_removed and not d.exists() and not (tmp_path / "current").is_symlink()
    assert (rundir.SHM_DIR / other).exists()
    text = removed.describe()
    assert "gone" in text and "2 shared-memory segment(s)" in text and str(d) in text


def test_reap_keeps_foreign_files_and_refuses_a_live_node(tmp_path: Path) -> None:
    d = _private(tmp_path)
    write_record(d, NodeRecord(pid=_dead_pid(), start_ticks=1, started_at=0.0))
    (d / "mine.txt").write_text("keep")
    removed = reap(d)
    assert not removed.dir_removed and (d / "mine.txt").exists() and "node.json" in removed.files
    write_record(d, NodeRecord.for_this_process())
    with pytest.raises(RunDirBusy, match="running"):
        reap(d)


def test_claim_refuses_a_live_node_and_clears_a_dead_one(tmp_path: Path, shm_names: list[str]) -> None:
    d = _private(tmp_path)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ticks = rundir.proc_start_ticks(live.pid)
        assert ticks is not None
        write_record(d, NodeRecord(pid=live.pid, start_ticks=ticks, started_at=0.0, name="busy"))
        with pytest.raises(RunDirBusy, match="busy"):
            claim(d, NodeRecord.for_this_process(name="new"))
    finally:
        live.kill()
        live.wait()
    seg = _segment(shm_names, f"gpuprims-{live.pid}-{uuid.uuid4().hex[:8]}")
    (d / "token").write_text("old")  # what made the next start fail with FileExistsError
    removed = claim(d, NodeRecord.for_this_process(name="new"))
    assert removed is not None and removed.shm == [seg] and not (rundir.SHM_DIR / seg).exists()
    assert d.is_dir() and not (d / "token").exists()
    rec = read_record(d)
    assert rec is not None and rec.name == "new" and rec.alive
    assert claim(d, NodeRecord.for_this_process(name="other")) is None  # this process's own dir: kept
    rec = read_record(d)
    assert rec is not None and rec.name == "new"


@pytest.mark.slow
def test_reap_stops_instances_the_dead_node_left(tmp_path: Path) -> None:
    d = _private(tmp_path)
    env = {**os.environ, "GPUPRIMS_CONTROL_ADDRESS": f"ipc://{d}/control.sock ipc://{d}/command.sock"}
    stray = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                              "signal.SIG_IGN); print(flush=True); time.sleep(60)"], env=env,
                             stdout=subprocess.PIPE)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # not of this node
    try:
        assert stray.stdout is not None and stray.stdout.readline() == b"\n"  # its SIGTERM is ignored by now
        assert rundir.leftover_processes(d) == [stray.pid]
        write_record(d, NodeRecord(pid=_dead_pid(), start_ticks=1, started_at=0.0, name="gone"))
        removed = reap(d)
        assert removed.killed == [stray.pid] and stray.wait(timeout=10) == -9
        assert other.poll() is None and f"pid {stray.pid}" in removed.describe()
    finally:
        for p in (stray, other):
            p.kill()
            p.wait()


def test_find_nodes_lists_live_and_dead_but_not_starting(tmp_path: Path) -> None:
    a, b, c = (_private(tmp_path, n) for n in ("a", "b", "c"))
    write_record(a, NodeRecord.for_this_process(name="a"))
    write_record(b, NodeRecord(pid=_dead_pid(), start_ticks=1, started_at=0.0, name="b"))
    (c / "token").write_text("x")
    (tmp_path / "current").symlink_to(a)
    got = {e.run_dir.name: e.state for e in find_nodes(tmp_path)}
    assert got == {"a": "live", "b": "dead"}
    removed = rundir.reap_dead(find_nodes(tmp_path))
    assert [r.run_dir.name for r in removed] == ["b"] and not b.exists() and a.exists() and c.exists()


def test_sweep_removes_segments_of_dead_processes_only(tmp_path: Path) -> None:
    """Pools and Param-Share segments are named after the process whose life they follow: those of a
    gone process are removed, a live one's and anything else are kept."""
    shm = tmp_path / "shm"
    shm.mkdir()
    dead, live = _dead_pid(), os.getpid()
    names = {f"gpuprims-params-{dead}-abcdef012345": 8192, f"gpuprims-{dead}-1a2b": 4096,
             f"gpuprims-params-{live}-abcdef012345": 4096, f"gpuprims-{live}-1a2b": 4096,
             "gpuprims-fake-123-x": 10, "gpuprims-params-x-1": 10, "other-1-2": 10}
    for n, size in names.items():
        (shm / n).write_bytes(b"\0" * size)
    removed = sweep_dead_segments(shm)
    assert sorted(removed) == sorted([(f"gpuprims-params-{dead}-abcdef012345", 8192), (f"gpuprims-{dead}-1a2b", 4096)])
    assert sorted(os.listdir(shm)) == sorted(set(names) - {n for n, _ in removed})
    assert sweep_dead_segments(tmp_path / "missing") == []
