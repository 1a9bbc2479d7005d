from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from orchestrator.control.records import EngineSpec
from orchestrator.worker import instance, launch

ROOT = Path(__file__).resolve().parents[3]


def _my_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_the_import_runs_at_the_nice_value_asked_and_the_caller_keeps_its_own(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # A module that records the nice value of the thread importing it, and which thread that was.
    (tmp_path / "niceprobe.py").write_text(
        "import os, threading\n"
        "NICE = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())\n"
        "THREAD = threading.current_thread().name\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = _my_nice()
    # (The lowered thread ends with the import, so this process's own threads are untouched.)
    info = launch.import_at_nice("niceprobe", 10)
    import niceprobe  # type: ignore[import-not-found]

    assert niceprobe.THREAD == "import" and niceprobe.NICE == max(before, 10) == info["nice"]
    assert info["import_ms"] >= 0
    assert _my_nice() == before


def test_an_import_error_is_raised_in_the_calling_thread() -> None:
    with pytest.raises(ModuleNotFoundError, match="no_such_module_here"):
        launch.import_at_nice("no_such_module_here", 10)


@pytest.mark.parametrize("nice", [-1, 20, 1.5, True, "10"])
def test_a_bad_nice_value_is_refused(nice: object) -> None:
    with pytest.raises(ValueError, match=r"nice must be an integer in 0\.\.19"):
        launch.import_at_nice("json", nice)  # type: ignore[arg-type]


@pytest.mark.parametrize(("raw", "want"), [(None, None), ("10", 10), ("0", 0), ("19", 19), ("20", None), ("-3", None),
                                           ("ten", None), ("", None)])
def test_the_nice_value_from_the_environment(raw: str | None, want: int | None) -> None:
    env = {} if raw is None else {launch.ENV_IMPORT_NICE: raw}
    assert launch.import_nice_from_env(env) == want


def test_the_launcher_ignores_ctrl_c_before_the_import_and_hands_the_import_info_to_the_instance() -> None:
    # (orchestrator.worker.instance.main replaced by a probe: it prints what it was given.)
    code = ("import signal, orchestrator.worker.launch as l, orchestrator.worker.instance as i\n"
            "i.main = lambda import_info=None: (print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN, "
            "import_info['nice'] if import_info else None), 3)[1]\n"
            "l.exit_now(l.main())\n")
    env = dict(os.environ, **{launch.ENV_IMPORT_NICE: "12"})
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    # Its exit code, and what it printed (flushed, although the interpreter's teardown is skipped).
    assert out.returncode == 3, out.stderr
    assert out.stdout.split() == ["True", "12"]


@pytest.mark.parametrize(("code", "rc"), [(None, 0), (0, 0), (5, 5), ("a message", 1)])
def test_an_instance_leaving_by_system_exit_gives_its_exit_code(code: object, rc: int,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # (SIGTERM's handler in the instance is sys.exit(0).)
    def leave(import_info: object = None) -> int:
        raise SystemExit(code)

    monkeypatch.setattr(instance, "main", leave)
    monkeypatch.delenv(launch.ENV_IMPORT_NICE, raising=False)
    monkeypatch.setattr(launch, "die_with_parent", lambda: None)
    monkeypatch.setattr(launch.signal, "signal", lambda *a: None)
    assert launch.main() == rc


def test_a_prewarming_instance_imports_at_the_nice_value_what_its_spec_needs() -> None:
    from orchestrator.control.spec import ENV_SPEC, InstanceSpec

    zoo = InstanceSpec(name="a-0", app="a", app_id=1, model="mobilenet_v2", pool="p", consumer=0)
    onnx_file = InstanceSpec(name="f-0", app="f", app_id=2, model="m.onnx", pool="p", consumer=0,
                             engine=EngineSpec("onnxruntime"), model_config="{}", model_path="m.onnx")
    assert launch.imports_from_env({ENV_SPEC: zoo.to_json()}) == ("orchestrator.worker.instance", "orchestrator.worker.zoo_runner")
    assert launch.imports_from_env({ENV_SPEC: onnx_file.to_json()}) == (
        "orchestrator.worker.instance", "gpuprims.engines.file_onnx", "onnxruntime")
    for bad in ({}, {ENV_SPEC: "{not json"}, {ENV_SPEC: '{"name": "x"}'}, {ENV_SPEC: '{"nosuch": 1}'}):
        assert launch.imports_from_env(bad) == ("orchestrator.worker.instance",)  # the instance says what is wrong
