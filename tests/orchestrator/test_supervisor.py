"""Supervision under faults: instances SIGKILLed while the monitor and set-gpu change shares.

The node must stay up (its loop never raises and counts no internal error), answer every request,
never drop one for want of a route, start killed shadows again, and end with every app serving.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from gpuprims.cpushare import CpuShare
from gpuprims.wire import Status
from orchestrator import supervisor as sup_mod
from orchestrator.config import HostResources, load_config
from orchestrator.control import ControlAddress
from orchestrator.errors import ChangeError
from orchestrator.monitor import Monitor, MonitorPolicy
from orchestrator.node import Node
from orchestrator.param_share import ParamShare
from orchestrator.reconfig import Phase
from orchestrator.spec import ENV_SPEC, InstanceSpec
from orchestrator.state import InstanceState
from orchestrator.supervisor import Supervisor
from tests.orchestrator.test_reconfig import Load

pytestmark = pytest.mark.slow

CONFIG = """
node:
  listen: {host: 127.0.0.1, port: 0}
  backend: cpu
  pool: {slot_count: 4096, max_chunks: 64, record_count: 512}
  hang_timeout_s: 60
apps:
  - {name: a, model: mobilenet_v2, input_shape: [3, 32, 32], slo_ms: 5000, gpu_pct: 50, max_batch: 8, app_id: 1,
     num_classes: 10, shadow: true}
  - {name: b, model: resnet18, input_shape: [3, 32, 32], slo_ms: 5000, gpu_pct: 40, max_batch: 8, app_id: 2,
     num_classes: 10, shadow: true}
"""


def _pump_until(node: Node, cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s:.0f} s"
        node.step(20)


def _serving(node: Node, app: str) -> bool:
    return any(st.app == app and st.role == "active" and st.ready for st in node.instances.values())


def test_kills_during_monitor_and_set_gpu_changes_leave_the_node_serving(tmp_path: Path) -> None:
    p = tmp_path / "apps.yaml"
    p.write_text(CONFIG)
    # A monitor that always finds the apps under-using their share, so it keeps asking for changes.
    monitor = Monitor(MonitorPolicy(interval_s=0.3, window_s=0.6, confirm=1, dwell_s=0.0, underuse_util=1.0,
                                    max_util_after=1.0, step_pct=10, min_pct=10, min_served=0))
    node = Node(load_config(p), heartbeat_ms=100, warmup=False, monitor=monitor).start()
    rng = random.Random(7)
    kills = {"active": 0, "shadow": 0}
    accepted: list[int] = []
    try:
        load = Load(node.ingest.ports[0], rate_rps=30)
        # Each fault waits for the node to have recovered from the last one (a kill every ~1.5 s on a
        # fast machine, slower on a busy one): the test is about recovery, not about a fixed rate.
        for round_ in range(8):
            _pump_until(node, lambda: _serving(node, "a") and _serving(node, "b"), 120, "both apps serving")
            t_next = time.monotonic() + 1.5
            while time.monotonic() < t_next:
                node.step(20)
            victims = [st for st in node.instances.values() if st.role in ("active", "shadow") and st.alive]
            victim = rng.choice(victims)
            kills[victim.role] += 1
            os.kill(victim.pid, signal.SIGKILL)
            if round_ % 2 == 0:
                try:
                    accepted.append(node.set_gpu("a", rng.choice([20, 30, 40])).id)
                except ChangeError:
                    pass  # refused: a change of it is running (the monitor's, most likely)
            node.step(20)
        load.finish(node, timeout_s=120)
        # The node still serves both apps, and killed shadows were started again.
        _pump_until(node, lambda: _serving(node, "a") and _serving(node, "b"), 120, "both apps serving at the end")
        _pump_until(node, lambda: node.shadow_of("a") is not None and node.shadow_of("b") is not None, 120,
                    "shadows started again")
        assert node.errors == {}, f"the node's loop failed internally: {node.errors}"
        assert load.sent > 100
        missing = [rid for rid in range(load.sent) if rid not in load.got]
        assert not missing, f"{len(missing)} request(s) never answered, e.g. {missing[:5]}"
        statuses = {s for v in load.got.values() for s, _ in v}
        assert statuses <= {Status.OK, Status.INSTANCE_FAILED, Status.DEADLINE_MISSED}, statuses
        assert sum(1 for v in load.got.values() if v[0][0] == Status.OK) > load.sent // 2
        assert node.ingest.counters()["drop_unknown_app"] == 0
        assert kills["active"] > 0
        # The changes still running end (done, or failed with the old instances serving).
        _pump_until(node, lambda: not node.changes.running, 300, "the running changes to end")
        changes = list(node.changes)
        assert all(ch.phase.terminal for ch in changes)
        assert any(ch.phase is Phase.DONE for ch in changes), [ch.to_dict() for ch in changes]
        # The monitor asked for changes too (accepted, or refused while another change of the app ran).
        assert any(e["event"] == "decision" for e in node.events)
        assert any(ch.origin == "monitor" for ch in changes) or any(
            e["event"] == "decision" and not e["ok"] for e in node.events)
        assert node.apps["a"].restarts + node.apps["b"].restarts >= kills["active"] - 1
    finally:
        node.stop()
    assert not node.instances


class _Server:
    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []

    def send(self, name: str, msg: object) -> None:
        self.sent.append((name, msg))


class _App:
    def __init__(self) -> None:
        self.retired: list[str] = []

    def retire(self, st: InstanceState) -> None:
        self.retired.append(st.name)


def test_shutdown_terminates_an_instance_still_starting_without_waiting_for_it(tmp_path: Path) -> None:
    # A shadow still importing (not Ready) cannot be told to stop and holds no request: the node
    # terminates it at once instead of waiting out the drain timeout for it; a Ready one is told.
    sup = Supervisor.__new__(Supervisor)
    sup.server, app = _Server(), _App()
    sup.apps = {"a": app}  # type: ignore[dict-item]
    spec = InstanceSpec(name="x", app="a", app_id=1, model="m", pool="p", consumer=0)
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    starting = InstanceState(name="a-s0", app="a", spec=spec, proc=subprocess.Popen(sleeper), role="shadow")
    # A Ready instance that exits when told (here: on its own, once the Shutdown is recorded).
    ready = InstanceState(name="a-0", app="a", spec=spec, proc=subprocess.Popen(sleeper), ready=True)
    sup.instances = {st.name: st for st in (starting, ready)}

    def pump(ms: float) -> None:
        if any(name == "a-0" for name, _ in sup.server.sent) and ready.alive:  # type: ignore[attr-defined]
            ready.proc.kill()
        time.sleep(ms / 1e3)

    try:
        sup.shutdown(drain=True, timeout_s=600, pump=pump)
        assert [name for name, _ in sup.server.sent] == ["a-0"]  # type: ignore[attr-defined]
        assert starting.proc.returncode == -signal.SIGTERM and ready.proc.returncode == -signal.SIGKILL
        assert sup.instances == {} and sorted(app.retired) == ["a-0", "a-s0"]
    finally:
        for st in (starting, ready):
            if st.proc.poll() is None:
                st.proc.kill()
            st.proc.wait()


# -- engines in the specs the supervisor hands its instances (no process started) -------------------------------

def _specs_spawned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, app_yaml: dict[str, Any],
                   roles: list[str | None]) -> list[InstanceSpec]:
    cfg_path = tmp_path / "apps.yaml"
    cfg_path.write_text(yaml.safe_dump({"node": {"backend": backend, "engine_cache": str(tmp_path / "c")},
                                         "apps": [app_yaml]}))
    cfg = load_config(cfg_path, host=HostResources(cores=64, mem_available_mb=1e6))
    envs: list[dict[str, str]] = []

    def popen(args: list[str], env: dict[str, str], **kw: Any) -> Any:
        envs.append(env)
        return SimpleNamespace(pid=4242 + len(envs), poll=lambda: None)

    monkeypatch.setattr(sup_mod.subprocess, "Popen", popen)
    placement = SimpleNamespace(instance_pct=lambda app: 50, scheduled=False, stage_pcts=lambda app: None)
    server = SimpleNamespace(address=ControlAddress("ipc:///tmp/x-i", "ipc:///tmp/x-c"))
    sup = Supervisor(cfg, {}, {}, pool=SimpleNamespace(name="/pool"), ingest=None, server=server,  # type: ignore[arg-type]
                     token="ab" * 16, run_dir=tmp_path, placement=placement, params=ParamShare(tmp_path),  # type: ignore[arg-type]
                     backend=backend, python=sys.executable, heartbeat_ms=100, warmup=False, consumers=8)
    share = CpuShare(cores=[0], threads=1, gpu_pct=50)
    for i, role in enumerate(roles):
        sup.spawn(cfg.apps[0], f"{cfg.apps[0].name}-{i}", share, role=role)
    return [InstanceSpec.from_json(e[ENV_SPEC]) for e in envs]


def test_instances_get_the_apps_engine_and_the_overflow_instance_its_own(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    app = {"name": "a", "model": "mobilenet_v2", "slo_ms": 100, "gpu_pct": 50, "overflow": "cpu",
           "engine": {"kind": "onnxruntime", "provider": "cpu", "optimization": "basic"}, "overflow_engine": "eager"}
    active, overflow = _specs_spawned(tmp_path, monkeypatch, "cpu", app, [None, "overflow"])
    assert (active.engine, active.engine_options) == ("onnxruntime", {"provider": "cpu", "optimization": "basic"})
    assert active.engine_cache == str(tmp_path / "c")
    assert active.share_params is None  # Param-Share does not apply: the engine holds its own weights
    assert (overflow.engine, overflow.engine_options, overflow.backend) == ("eager", None, "cpu")


def test_eager_instances_still_share_their_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app = {"name": "b", "model": "mobilenet_v2", "slo_ms": 100, "gpu_pct": 40}
    first, second = _specs_spawned(tmp_path, monkeypatch, "cuda", app, [None, None])
    assert first.engine == "eager" and first.share_params.startswith("export:")  # type: ignore[union-attr]
    assert second.share_params.startswith("import:")  # type: ignore[union-attr]
