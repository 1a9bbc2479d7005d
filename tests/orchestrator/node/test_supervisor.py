"""Supervision: its rules one by one on played instances, and under faults with real ones.

The rules run in one process: the node is handed a launcher double (tests/orchestrator/fake_launcher.py)
whose instances play Ready, heartbeats, Ended, errors and exits over the in-process control plane, in
front of the real packet pool and ingest, so what a dead instance held is really reclaimed.

The slow test SIGKILLs real instances while the monitor and set-gpu change shares: the node must
stay up (its loop never raises and counts no internal error), answer every request, never drop one
for want of a route, start killed shadows again, and end with every app serving.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import yaml

from gpuprims import wire
from gpuprims.cpushare import CpuShare
from gpuprims.cuda.ipc import ENV_OWNER_PID
from gpuprims.profile import save_profile, with_stages
from gpuprims.wire import Status
from orchestrator.config.schema import HostResources, load_config, parse_config
from orchestrator.control.channel import ControlAddress
from orchestrator.control.errors import ChangeError
from orchestrator.control.records import EngineSpec, Role
from orchestrator.control.share_spec import ENV_HOLDER, HolderSpec
from orchestrator.control.spec import ENV_SPEC, InstanceSpec
from orchestrator.node.monitor import Monitor, MonitorPolicy
from orchestrator.node.node import Node
from orchestrator.node.param_share import ParamShare
from orchestrator.node.reconfig import Changes, Phase
from orchestrator.node.state import InstanceState, InstanceTable
from orchestrator.node.supervisor import SHADOW_BACKOFF_MAX_S, Supervisor
from tests.gpuprims.sched._profiles import grid
from tests.orchestrator.fake_launcher import FakeLauncher
from tests.orchestrator.node.test_reconfig import Load

pytestmark = pytest.mark.timeout(120)

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


@pytest.mark.slow
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
        for round_ in range(5):
            _pump_until(node, lambda: _serving(node, "a") and _serving(node, "b"), 120, "both apps serving")
            t_next = time.monotonic() + 1.5
            while time.monotonic() < t_next:
                node.step(20)
            victims = [st for st in node.instances.values() if st.role in ("active", "shadow") and st.alive]
            # The first victim is an active (the replacement path); the rest are drawn from both roles.
            victim = rng.choice([v for v in victims if v.role == "active"] if round_ == 0 else victims)
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
        # OVERLOADED too: while a killed active's replacement starts (tens of seconds on a busy machine), the
        # requests queue in the pool, and once its slots are taken (4096 slots of 12-chunk requests: about
        # 11 s at 30 req/s) the ingest answers the next ones OVERLOADED at once, as it must.
        assert statuses <= {Status.OK, Status.INSTANCE_FAILED, Status.DEADLINE_MISSED, Status.OVERLOADED}, statuses
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
    sup.params = ParamShare(tmp_path)
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


# ---- the rules, on played instances

def _played_node(tmp_path: Path, *, shadow: bool = False, overflow: bool = False,
                 hang_timeout_s: float = 60.0) -> tuple[Node, FakeLauncher]:
    app: dict[str, object] = {"name": "a", "model": "mobilenet_v2", "input_shape": [3, 8, 8], "slo_ms": 60_000,
                              "gpu_pct": 50, "max_batch": 4, "app_id": 1, "num_classes": 10, "shadow": shadow}
    cfg = parse_config({"node": {"listen": {"host": "127.0.0.1", "port": 0}, "backend": "cpu",
                                 "run_dir": str(tmp_path / "run"), "hang_timeout_s": hang_timeout_s,
                                 "pool": {"slot_count": 256, "max_chunks": 8, "record_count": 64}},
                        "apps": [app]})
    launcher = FakeLauncher()
    node = Node(cfg, control_kind="inproc", launcher=launcher, warmup=False, share_params=False,
                ready_timeout_s=30)
    return node, launcher


def _step_until(node: Node, cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        node.step(10)


def _send(node: Node, n: int) -> None:
    """``n`` requests to app 1; they reach the active instance's ring (a played instance never takes them)."""
    assert node.ingest is not None
    before = node.ingest.counters().get("requests_delivered", 0)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for rid in range(n):
            for d in wire.encode_request(1, rid, np.zeros((3, 8, 8), np.float32), client_ts_ns=time.monotonic_ns()):
                s.sendto(d, ("127.0.0.1", node.ingest.ports[0]))
    _step_until(node, lambda: node.ingest.counters().get("requests_delivered", 0) >= before + n,  # type: ignore[union-attr]
                f"{n} requests delivered to the instance")


def test_a_dead_active_is_replaced_before_what_it_held_is_reclaimed(tmp_path: Path) -> None:
    node, launcher = _played_node(tmp_path)
    with node:
        a0 = launcher.by_name("a-0")
        _send(node, 3)
        a0.die(-signal.SIGSEGV)
        _step_until(node, lambda: node.apps["a"].restarts == 1, "the restart")
        # The replacement was routed to before the reclaim, so the three requests went to it.
        app = node.apps["a"]
        assert app.requeued_by_crash == 3 and app.failed_by_crash == 0
        new = [i for i in launcher.of_app("a") if i is not a0]
        assert len(new) == 1 and node.ingest.route(1) == [new[0].spec.consumer]  # type: ignore[union-attr]
        assert next(e for e in node.events if e["event"] == "crash")["replacement"] == new[0].spec.name
        # A replacement that dies before READY fails what it held instead of passing it on again.
        launcher.auto_ready = False
        new[0].die(1)
        _step_until(node, lambda: node.apps["a"].restarts == 2, "the second restart")
        third = launcher.of_app("a")[-1]
        third.die(1)  # never said Ready
        _step_until(node, lambda: node.apps["a"].restarts == 3, "the third restart")
        assert node.errors == {}
    assert all(i.returncode is not None for i in launcher.launched)


def test_a_killed_shadow_is_started_again_after_a_growing_back_off(tmp_path: Path) -> None:
    node, launcher = _played_node(tmp_path, shadow=True)
    with node:
        assert node.supervisor is not None
        shadows = [i for i in launcher.of_app("a") if i.spec.defer_init]
        assert len(shadows) == 1
        launcher.auto_ready = False
        shadows[0].die(-signal.SIGKILL)
        node.step(10)
        # The back-off after the first failure: 1 s, then doubling (up to SHADOW_BACKOFF_MAX_S).
        first = node.supervisor._shadow_not_before["a"]
        node.supervisor.refill_shadows(first - 0.01, set())
        assert len([i for i in launcher.of_app("a") if i.spec.defer_init]) == 1  # not yet
        node.supervisor.refill_shadows(first, set())
        second = [i for i in launcher.of_app("a") if i.spec.defer_init][-1]
        assert second is not shadows[0] and second.returncode is None
        second.die(1)
        node.step(10)
        gap = node.supervisor._shadow_not_before["a"] - time.monotonic()
        assert 1.0 < gap <= 2.0 <= SHADOW_BACKOFF_MAX_S
        node.supervisor.refill_shadows(node.supervisor._shadow_not_before["a"], set())
        third = [i for i in launcher.of_app("a") if i.spec.defer_init][-1]
        third.ready(initialized=False)  # a shadow that comes up resets the back-off
        _step_until(node, lambda: "a" not in node.supervisor._shadow_not_before, "the back-off reset")  # type: ignore[union-attr]
        assert node.apps["a"].shadow_restarts == 2 and node.apps["a"].restarts == 0
        # A launch that fails outright counts as a failure too, and the node carries on.
        third.die(1)
        launcher.refuse = 1
        node.step(10)
        node.supervisor.refill_shadows(node.supervisor._shadow_not_before["a"], set())
        assert node.supervisor._shadow_failures["a"] == 2 and node.errors == {}


def test_a_silent_active_is_killed_as_hung_and_replaced(tmp_path: Path) -> None:
    node, launcher = _played_node(tmp_path, hang_timeout_s=5.0)
    with node:
        assert node.supervisor is not None
        a0 = launcher.by_name("a-0")
        _send(node, 2)
        a0.beat(received=2, ok=0)
        node.step(10)
        a0.hang()
        beat = node.instances["a-0"].last_beat
        node.supervisor.check_hangs(beat + 4.9, 5.0)
        assert a0.returncode is None  # within node.hang_timeout_s
        node.supervisor.check_hangs(beat + 5.1, 5.0)
        assert a0.returncode == -signal.SIGKILL and node.apps["a"].hangs == 1
        _step_until(node, lambda: node.apps["a"].restarts == 1, "the replacement")
        assert node.apps["a"].requeued_by_crash == 2
        # Its last heartbeat is banked in the app's statistics.
        assert node.status()["apps"]["a"]["received"] == 2


def test_an_error_before_ready_fails_the_start_naming_the_instance(tmp_path: Path) -> None:
    node, launcher = _played_node(tmp_path)
    launcher.auto_ready = False
    original = launcher.launch

    def launch_and_fail(spec: InstanceSpec, env: dict[str, str]) -> object:
        inst = original(spec, env)
        inst.error("model_load", "no such weights")
        return inst

    launcher.launch = launch_and_fail  # type: ignore[method-assign]
    with pytest.raises(Exception, match="a-0 failed to start: model_load: no such weights"):
        node.start()
    assert node.instances == {} and all(i.returncode is not None for i in launcher.launched)


def test_a_launch_that_fails_outright_fails_the_start(tmp_path: Path) -> None:
    node, launcher = _played_node(tmp_path)
    launcher.refuse = 1
    with pytest.raises(Exception, match="could not start a-0"):
        node.start()
    assert node.instances == {}


def test_stop_drains_every_played_instance(tmp_path: Path) -> None:
    node, launcher = _played_node(tmp_path, shadow=True)
    node.start()
    node.stop()
    assert {type(m).__name__ for i in launcher.launched for m in i.received} <= {"Shutdown", "InitGpu"}
    assert all(i.returncode is not None for i in launcher.launched) and not node.instances


def test_a_dead_overflow_instance_gives_what_it_held_to_the_accelerator_and_comes_back(tmp_path: Path) -> None:
    (tmp_path / "profiles").mkdir()
    cpu = with_stages(grid("mobilenet_v2", {100: {1: 60.0, 8: 240.0}}), [], device_kind="cpu", cpu_cores=1)
    save_profile(cpu, tmp_path / "profiles" / "mobilenet_v2.cpu.json")
    cfg = parse_config({"node": {"listen": {"host": "127.0.0.1", "port": 0}, "backend": "cpu",
                                 "run_dir": str(tmp_path / "run"), "overflow_profiles": str(tmp_path / "profiles"),
                                 "pool": {"slot_count": 256, "max_chunks": 8, "record_count": 64}},
                        "apps": [{"name": "a", "model": "mobilenet_v2", "input_shape": [3, 8, 8], "slo_ms": 60_000,
                                  "gpu_pct": 50, "max_batch": 4, "app_id": 1, "num_classes": 10,
                                  "overflow": "cpu", "overflow_cores": 1}]})
    launcher = FakeLauncher()
    with Node(cfg, control_kind="inproc", launcher=launcher, warmup=False, share_params=False,
              ready_timeout_s=30) as node:
        assert node.supervisor is not None and node.ingest is not None
        _step_until(node, lambda: node.supervisor.overflow_of("a") is not None  # type: ignore[union-attr]
                    and node.supervisor.overflow_of("a").ready, "the CPU overflow instance")  # type: ignore[union-attr]
        cpu_inst = node.supervisor.overflow_of("a")
        assert cpu_inst is not None and cpu_inst.role == Role.OVERFLOW
        assert sorted(node.ingest.route(1)) == sorted([node.instances["a-0"].spec.consumer, cpu_inst.spec.consumer])
        launcher.by_name(cpu_inst.name).die(-signal.SIGKILL)
        _step_until(node, lambda: node.supervisor.overflow_of("a") is not cpu_inst, "the overflow's exit")  # type: ignore[union-attr]
        # Off the route at once; the accelerator kept serving; the failure is counted and backed off.
        assert node.ingest.route(1) == [node.instances["a-0"].spec.consumer]
        assert node.status()["apps"]["a"]["overflow"]["cpu_instance_failures"] == 1
        assert node.apps["a"].restarts == 0 and node.errors == {}
        not_before = node.supervisor._overflow_not_before["a"]
        node.supervisor.refill_overflow(not_before)
        again = node.supervisor.overflow_of("a")
        assert again is not None and again.name != cpu_inst.name


# -- engines in the specs the supervisor hands its instances (no process started) -------------------------------

class _RecordingLauncher:
    """Records what it is asked to start and starts nothing."""

    def __init__(self) -> None:
        self.envs: list[dict[str, str]] = []

    def launch(self, spec: InstanceSpec, env: Any) -> Any:
        self.envs.append(dict(env))
        return SimpleNamespace(pid=4242 + len(self.envs), poll=lambda: None)


def _recorded_holder(env: dict[str, str], holders: list[dict[str, str]] | None) -> Any:
    """Records a Param-Share holder's environment and starts nothing."""
    if holders is not None:
        holders.append(env)
    return SimpleNamespace(pid=4000, poll=lambda: None)


def _specs_spawned(tmp_path: Path, backend: str, app_yaml: dict[str, Any],
                   roles: list[str | None], holders: list[dict[str, str]] | None = None) -> list[InstanceSpec]:
    cfg_path = tmp_path / "apps.yaml"
    cfg_path.write_text(yaml.safe_dump({"node": {"backend": backend, "engine_cache": str(tmp_path / "c")},
                                         "apps": [app_yaml]}))
    cfg = load_config(cfg_path, host=HostResources(cores=64, mem_available_mb=1e6))
    launcher = _RecordingLauncher()
    placement = SimpleNamespace(instance_pct=lambda app: 50, scheduled=False, stage_pcts=lambda app: None)
    server = SimpleNamespace(address=ControlAddress("ipc:///tmp/x-i", "ipc:///tmp/x-c"))
    sup = Supervisor(cfg, {}, InstanceTable(), pool=SimpleNamespace(name="/pool"), ingest=None, server=server,  # type: ignore[arg-type]
                     token="ab" * 16, run_dir=tmp_path, placement=placement, params=ParamShare(tmp_path),  # type: ignore[arg-type]
                     backend=backend, launcher=launcher, heartbeat_ms=100, warmup=False, consumers=8,
                     changes=Changes(None, lambda app, pct: None, apps={}, record=lambda event: None),
                     holder_launcher=lambda env: _recorded_holder(env, holders))
    share = CpuShare(cores=[0], threads=1, gpu_pct=50)
    for i, role in enumerate(roles):
        sup.spawn(cfg.apps[0], f"{cfg.apps[0].name}-{i}", share, role=role)
    return [InstanceSpec.from_json(e[ENV_SPEC]) for e in launcher.envs]


def test_instances_get_the_apps_engine_and_the_overflow_instance_its_own(tmp_path: Path) -> None:
    app = {"name": "a", "model": "mobilenet_v2", "slo_ms": 100, "gpu_pct": 50, "overflow": "cpu",
           "engine": {"kind": "onnxruntime", "provider": "cpu", "optimization": "basic"}, "overflow_engine": "eager"}
    active, overflow = _specs_spawned(tmp_path, "cpu", app, [None, "overflow"])
    assert active.engine == EngineSpec("onnxruntime", {"provider": "cpu", "optimization": "basic"})
    assert active.engine_cache == str(tmp_path / "c")
    # Param-Share on the CPU for ONNX Runtime: the first instance exports the session's initializers.
    assert active.share_params is not None and active.share_params.startswith("export:")
    assert (overflow.engine, overflow.backend) == (EngineSpec("eager"), "cpu")


def test_eager_instances_still_share_their_weights(tmp_path: Path) -> None:
    app = {"name": "b", "model": "mobilenet_v2", "slo_ms": 100, "gpu_pct": 40}
    holders: list[dict[str, str]] = []
    first, second = _specs_spawned(tmp_path, "cuda", app, [None, None], holders)
    # On CUDA a holder the node owns exports the weights and every instance imports (Param-Share).
    assert first.engine == EngineSpec("eager") and first.share_params.startswith("import:")  # type: ignore[union-attr]
    assert second.share_params == first.share_params
    (env,) = holders
    assert HolderSpec.from_json(env[ENV_HOLDER]).path == first.share_params.removeprefix("import:")  # type: ignore[union-attr]
    assert env[ENV_OWNER_PID] == str(os.getpid())
