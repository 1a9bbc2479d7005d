"""The real launchers: ``python -m orchestrator.worker.launch`` with exactly the environment it is given, or
a child of the fork server that has exactly that environment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from orchestrator.control.records import EngineSpec
from orchestrator.control.spec import InstanceSpec
from orchestrator.node import launcher
from orchestrator.node.launcher import (
    ForkedProcess,
    ForkLauncher,
    SubprocessLauncher,
    import_env_key,
    instance_imports,
)


def test_the_subprocess_launcher_runs_orchestrator_launch_with_the_given_environment() -> None:
    spec = InstanceSpec(name="a-0", app="a", app_id=1, model="mobilenet_v2", pool="p", consumer=0)
    # No control address in the environment: the instance says so and exits non-zero, without a hang.
    proc = SubprocessLauncher(sys.executable).launch(spec, {"PATH": "/usr/bin:/bin"})
    try:
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc != 0 and proc.pid > 0


def test_the_subprocess_launcher_refuses_an_empty_interpreter_and_reports_a_missing_one(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="interpreter"):
        SubprocessLauncher("")
    spec = InstanceSpec(name="a-0", app="a", app_id=1, model="m", pool="p", consumer=0)
    with pytest.raises(OSError):
        SubprocessLauncher(str(tmp_path / "no-python")).launch(spec, {})
    assert "no-python" in repr(SubprocessLauncher(str(tmp_path / "no-python")))


# The fork launcher, on a server that preloads nothing and runs tests/orchestrator/fork_entry.py in
# its children instead of an instance: what a child gets, how it ends, and what happens when the
# server dies.

_READY_S = 60.0  # one interpreter's start, on a busy machine


def _fork_launcher(entry: str) -> ForkLauncher:
    return ForkLauncher(sys.executable, preload="", entry=f"tests.orchestrator.fork_entry:{entry}")


def _env(tmp_path: Path, name: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "FK_OUT": str(tmp_path / name), **extra}


def _wait_for(cond: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


_SPEC = InstanceSpec(name="a-0", app="a", app_id=1, model="m", pool="p", consumer=0)


@pytest.fixture
def fork_servers() -> Iterator[None]:
    ForkLauncher.close_all()
    yield
    ForkLauncher.close_all()


def test_a_forked_child_has_exactly_its_environment_and_none_of_the_servers_descriptors(
        tmp_path: Path, fork_servers: None) -> None:
    fl = _fork_launcher("report")
    env = _env(tmp_path, "a.json", FK_RC="3", GPUPRIMS_ONLY_HERE="1")
    assert fl.wait_ready(env, _READY_S)
    proc = fl.launch(_SPEC, env)
    assert isinstance(proc, ForkedProcess)
    assert proc.wait(timeout=_READY_S) == 3 and proc.poll() == 3 and proc.returncode == 3
    seen = json.loads((tmp_path / "a.json").read_text())
    assert seen["env"] == env  # the server's own variables (its descriptor number) are not there
    server = fl.server_for(env)
    assert server is not None and seen["ppid"] == server.proc.pid
    assert not any(t.startswith(("socket:", "pipe:")) for t in seen["fds"].values()), seen["fds"]
    # A second child with other runtime variables comes from the same server.
    env2 = {**env, "CUDA_VISIBLE_DEVICES": "1", "GPUPRIMS_ONLY_HERE": "2"}
    assert fl.server_for(env2) is server
    assert fl.launch(_SPEC, env2).wait(timeout=_READY_S) == 3
    assert json.loads((tmp_path / "a.json").read_text())["env"] == env2


def test_a_variable_read_at_import_gets_a_server_of_its_own() -> None:
    base = {"PATH": "/bin", "GPUPRIMS_X": "1", "CUDA_VISIBLE_DEVICES": "0", "PYTEST_CURRENT_TEST": "a"}
    same = {**base, "GPUPRIMS_X": "2", "CUDA_VISIBLE_DEVICES": "1", "PYTEST_CURRENT_TEST": "b"}
    assert import_env_key(base) == import_env_key(same)
    assert import_env_key(base) != import_env_key({**base, "OMP_WAIT_POLICY": "PASSIVE"})
    assert import_env_key(base) != import_env_key({**base, "OMP_NUM_THREADS": "1"})


def test_kill_terminate_and_wait_behave_as_popens(tmp_path: Path, fork_servers: None) -> None:
    fl = _fork_launcher("linger")
    env = _env(tmp_path, "pid")
    assert fl.wait_ready(env, _READY_S)
    a, b = fl.launch(_SPEC, env), fl.launch(_SPEC, env)
    assert isinstance(a, ForkedProcess) and isinstance(b, ForkedProcess) and a.pid != b.pid
    assert a.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        a.wait(timeout=0.05)
    a.kill()
    b.terminate()
    assert a.wait(timeout=_READY_S) == -signal.SIGKILL and b.wait(timeout=_READY_S) == -signal.SIGTERM
    a.kill()  # after its exit: nothing is sent, nothing raises
    assert _gone(a.pid) and _gone(b.pid)


def test_a_dead_server_reports_its_children_killed_and_the_next_launch_still_starts(
        tmp_path: Path, fork_servers: None) -> None:
    fl = _fork_launcher("linger")
    env = _env(tmp_path, "pid")
    assert fl.wait_ready(env, _READY_S)
    server = fl.server_for(env)
    assert server is not None
    child = fl.launch(_SPEC, env)
    assert _wait_for(lambda: (tmp_path / "pid").exists(), _READY_S)
    server.proc.kill()
    assert child.wait(timeout=_READY_S) == -signal.SIGKILL
    assert _wait_for(lambda: _gone(child.pid), _READY_S)
    # The next launch does not wait for a new server: it starts a process, and a new server starts.
    started = fl.launch(_SPEC, {**env, "FK_OUT": str(tmp_path / "pid2")})
    try:
        assert isinstance(started, subprocess.Popen)
    finally:
        started.kill()
        started.wait()
    assert fl.wait_ready(env, _READY_S) and fl.server_for(env) is not server
    again = fl.launch(_SPEC, env)
    assert isinstance(again, ForkedProcess)
    again.kill()
    assert again.wait(timeout=_READY_S) == -signal.SIGKILL


def test_closing_the_servers_ends_their_children(tmp_path: Path, fork_servers: None) -> None:
    fl = _fork_launcher("linger")
    env = _env(tmp_path, "pid")
    assert fl.wait_ready(env, _READY_S)
    child = fl.launch(_SPEC, env)
    assert _wait_for(lambda: (tmp_path / "pid").exists(), _READY_S)
    ForkLauncher.close_all()
    assert _wait_for(lambda: _gone(child.pid), _READY_S)  # SIGTERM from the kernel when its parent went


def test_bad_requests_get_an_error_and_the_server_keeps_forking(tmp_path: Path, fork_servers: None) -> None:
    fl = _fork_launcher("report")
    env = _env(tmp_path, "ok.json")
    assert fl.wait_ready(env, _READY_S)
    server = fl.server_for(env)
    assert server is not None
    with pytest.raises(OSError, match="env must map names to strings"):
        server.fork({"A": 1})  # type: ignore[dict-item]
    with pytest.raises(OSError, match="env must map names to strings"):
        server.fork({"A=B": "1"})
    server.sock.sendall(b"not json\n[1]\n" + b'{"op": "what"}\n' + b'{"op": "signal", "pid": 1, "sig": 9}\n')
    assert fl.launch(_SPEC, env).wait(timeout=_READY_S) == 0


def test_the_fork_launcher_falls_back_to_a_process_and_reports_a_missing_interpreter(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="interpreter"):
        ForkLauncher("")
    with pytest.raises(OSError):
        ForkLauncher(str(tmp_path / "no-python")).launch(_SPEC, {})


def test_servers_beyond_the_cap_end_only_when_idle(tmp_path: Path, fork_servers: None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "MAX_SERVERS", 1)
    fl = _fork_launcher("linger")
    busy_env = _env(tmp_path, "pid", OMP_WAIT_POLICY="PASSIVE")
    assert fl.wait_ready(busy_env, _READY_S)
    busy = fl.server_for(busy_env)
    child = fl.launch(_SPEC, busy_env)
    other = fl.server_for(_env(tmp_path, "pid", OMP_WAIT_POLICY="ACTIVE"))
    assert other is not None and other is not busy
    assert fl.server_for(busy_env) is busy and child.poll() is None  # it has a child: it stays
    child.kill()
    assert child.wait(timeout=_READY_S) == -signal.SIGKILL
    third = fl.server_for(_env(tmp_path, "pid", OMP_WAIT_POLICY="THIRD"))
    assert busy is not None and third is not None
    assert _wait_for(lambda: busy.proc.poll() is not None, _READY_S)  # idle now: the oldest idle one ends


# -- fork servers per need ---------------------------------------------------------------------------------

_FILE_SPEC = InstanceSpec(name="f-0", app="f", app_id=2, model="model.onnx", pool="p", consumer=0,
                          engine=EngineSpec("onnxruntime"), model_config="{}", model_path="model.onnx")


def test_what_an_instance_imports_decides_its_fork_server() -> None:
    assert instance_imports(_SPEC) == ("orchestrator.worker.instance", "orchestrator.worker.zoo_runner")  # a zoo model: torch
    assert instance_imports(_FILE_SPEC) == ("orchestrator.worker.instance", "gpuprims.engines.file_onnx", "onnxruntime")
    torch_file = InstanceSpec(name="t-0", app="t", app_id=3, model="m.pt", pool="p", consumer=0,
                              engine=EngineSpec("torchscript"), model_config="{}", model_path="m.pt")
    assert instance_imports(torch_file) == ("orchestrator.worker.instance", "orchestrator.worker.zoo_runner")
    odd = InstanceSpec(name="o-0", app="o", app_id=4, model="m.x", pool="p", consumer=0, engine=EngineSpec("nosuch"),
                       model_config="{}", model_path="m.x")
    assert instance_imports(odd) == ("orchestrator.worker.instance",)  # the instance refuses the kind itself
    assert ForkLauncher(sys.executable, preload="").preload_for(_FILE_SPEC) == ""  # a given preload wins
    assert ForkLauncher(sys.executable).preload_for(None) == "orchestrator.worker.instance"


@pytest.mark.real
def test_a_model_files_instance_comes_from_a_server_without_torch(tmp_path: Path, fork_servers: None) -> None:
    """An ONNX file's instance is forked from a server that imported ONNX Runtime but no torch; a zoo
    model's from another that holds torch; each is started when its first instance is launched."""
    fl = ForkLauncher(sys.executable, entry="tests.orchestrator.fork_entry:imports")
    env = _env(tmp_path, "file.json")
    assert fl.wait_ready(env, 120, _FILE_SPEC) and len(ForkLauncher.describe()) == 1
    assert fl.launch(_FILE_SPEC, env).wait(timeout=_READY_S) == 0
    seen = json.loads((tmp_path / "file.json").read_text())
    assert seen == {"modules": ["numpy", "onnxruntime"], "libtorch": False}
    env_zoo = _env(tmp_path, "zoo.json")
    assert fl.wait_ready(env_zoo, 300, _SPEC)
    assert fl.launch(_SPEC, env_zoo).wait(timeout=_READY_S) == 0
    seen = json.loads((tmp_path / "zoo.json").read_text())
    assert "torch" in seen["modules"] and "apps.zoo" in seen["modules"] and seen["libtorch"]
    servers = {tuple(d["preload"]): d for d in ForkLauncher.describe()}
    assert len(servers) == 2
    lite = servers[("orchestrator.worker.instance", "gpuprims.engines.file_onnx", "onnxruntime")]
    heavy = servers[("orchestrator.worker.instance", "orchestrator.worker.zoo_runner")]
    assert lite["ready"] and "torch" not in lite["holds"] and "onnxruntime" in lite["holds"]
    assert heavy["ready"] and {"torch", "apps.zoo"} <= set(heavy["holds"])
