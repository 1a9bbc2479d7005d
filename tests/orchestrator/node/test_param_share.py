"""Param-Share in the node: instances of one model share one copy of the weights, on the CPU backend and
on the fake CUDA runtime, where the weights go through the fake's CUDA IPC and its lifetime rules (an
importer that reads memory whose exporter freed it or exited faults, and the fault is logged)."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from apps.zoo import load_model
from gpuprims.cuda.ipc import ParameterHandles
from gpuprims.testing import fake
from gpuprims.wire import Status
from orchestrator.config.schema import AppConfig, load_config, parse_config
from orchestrator.control.records import NodeView
from orchestrator.control.share_spec import ERROR_SUFFIX, HolderSpec
from orchestrator.control.status_format import format_status
from orchestrator.node.node import Node
from orchestrator.node.param_share import ParamShare
from tests.gpuprims.engines.test_ort_share import dense_model
from tests.orchestrator.client import ask
from tests.orchestrator.node.test_reconfig import Load

CONFIG = """
node:
  listen: {host: 127.0.0.1, port: 0}
  backend: cpu
  allow_oversubscribe: true
  pool: {slot_count: 4096, max_chunks: 64, record_count: 256}
apps:
  - {name: a, model: resnet18, input_shape: [3, 32, 32], slo_ms: 10000, gpu_pct: 50, instances: 2, max_batch: 4,
     app_id: 1, num_classes: 10, seed: 5, shadow: false}
"""


# -- the bookkeeping, with played holder processes ---------------------------------------------------------

class PlayedHolder:
    """A holder process as the node sees it: exits when told (unless ``stubborn``) or when the test says."""

    def __init__(self, spec: HolderSpec, pid: int, stubborn: bool = False) -> None:
        self.spec, self.pid, self.stubborn = spec, pid, stubborn
        self.rc: int | None = None
        self.terminated = self.killed = False

    def poll(self) -> int | None:
        return self.rc

    def terminate(self) -> None:
        self.terminated = True
        if not self.stubborn:
            self.rc = -15

    def kill(self) -> None:
        self.killed, self.rc = True, -9

    def wait(self, timeout: float | None = None) -> int:
        if self.rc is None:
            raise subprocess.TimeoutExpired("holder", timeout or 0)
        return self.rc

    def exports(self) -> None:
        """Writes the handles, as a real holder does once the weights are in its arena."""
        Path(self.spec.path).write_bytes(b"handles")


def _apps(**over: object) -> list[AppConfig]:
    base = {"model": "mobilenet_v2", "input_shape": [3, 32, 32], "slo_ms": 100, "gpu_pct": 40, "num_classes": 10,
            "seed": 5}
    apps = [{"name": "a", "app_id": 1, **base}, {"name": "b", "app_id": 2, **base, **over}]
    cfg = parse_config({"node": {"backend": "cpu", "allow_oversubscribe": True}, "apps": apps})
    return list(cfg.apps)


def _cuda_share(tmp_path: Path, **kw: object) -> tuple[ParamShare, list[PlayedHolder]]:
    started: list[PlayedHolder] = []

    def start(spec: HolderSpec) -> PlayedHolder:
        started.append(PlayedHolder(spec, 1000 + len(started), **kw))  # type: ignore[arg-type]
        return started[-1]

    ps = ParamShare(tmp_path)
    ps.bind("cuda", start, lambda app: 0)
    return ps, started


def test_on_cuda_every_instance_imports_from_one_holder_per_copy(tmp_path: Path) -> None:
    ps, started = _cuda_share(tmp_path)
    a, b = _apps()
    modes = [ps.mode_for(a, "a-0"), ps.mode_for(a, "a-1"), ps.mode_for(b, "b-0")]  # b: the same weights
    assert len(started) == 1 and modes == [f"import:{started[0].spec.path}"] * 3
    spec = started[0].spec
    assert (spec.model, spec.seed, spec.num_classes, spec.input_shape, spec.gpu) == ("mobilenet_v2", 5, 10,
                                                                                      (3, 32, 32), 0)
    (exp,) = ps.exports.values()
    assert exp.users == {"a-0", "a-1", "b-0"} and exp.exporter is None and ps.exported(a)
    # A change retires a-0 (it exits normally): the weights stay, nothing names a-0 any more.
    ps.instance_exited("a-0")
    assert exp.users == {"a-1", "b-0"} and not started[0].terminated
    assert ps.reap_holders() == [] and ps.release_unused() == []


def test_a_copy_no_instance_maps_is_released_and_its_path_never_reused(tmp_path: Path) -> None:
    ps, started = _cuda_share(tmp_path)
    a, _ = _apps()
    first = ps.mode_for(a, "a-0")
    started[0].exports()
    ps.instance_exited("a-0")
    (released,) = ps.release_unused()
    assert started[0].terminated and ps.exports == {} and not released.path.exists()
    assert ps.reap_holders() == [] and ps.holders() == []  # a retired holder's exit is only collected
    again = ps.mode_for(a, "a-1")
    assert len(started) == 2 and again != first


def test_a_holder_that_dies_restarts_exactly_the_instances_that_mapped_it(tmp_path: Path) -> None:
    ps, started = _cuda_share(tmp_path)
    a, b = _apps(seed=6)  # b: other weights, another holder
    ps.mode_for(a, "a-0")
    ps.mode_for(a, "a-s1")
    ps.mode_for(b, "b-0")
    assert len(started) == 2
    for h in started:
        h.exports()
    started[0].kill()
    (gone,) = ps.reap_holders()
    assert gone.exported and gone.rc == -9 and gone.users == ("a-0", "a-s1")
    assert not gone.export.path.exists() and not ps.exported(a) and ps.exported(b)
    assert ps.mode_for(a, "a-r2") == f"import:{started[2].spec.path}" != f"import:{started[0].spec.path}"


def test_a_holder_that_fails_before_exporting_leaves_its_reason_to_the_waiting_instances(tmp_path: Path) -> None:
    ps, started = _cuda_share(tmp_path)
    a, _ = _apps()
    ps.mode_for(a, "a-0")
    err = Path(started[0].spec.path + ERROR_SUFFIX)
    err.write_text("RuntimeError: out of memory")
    started[0].rc = 1
    (gone,) = ps.reap_holders()
    assert not gone.exported and gone.users == ("a-0",)
    assert err.exists(), "a-0 reads the reason and fails its start with it"
    # A holder killed before it could say why: the node writes the reason for the instances waiting.
    ps.mode_for(a, "a-r1")
    started[1].kill()
    (gone,) = ps.reap_holders()
    reason = Path(started[1].spec.path + ERROR_SUFFIX)
    assert not gone.exported and "exited with status -9 before exporting" in reason.read_text()
    ps.remove_all()
    assert not err.exists() and not reason.exists()


def test_a_holder_that_cannot_start_leaves_the_instance_its_own_weights(tmp_path: Path) -> None:
    def refuse(spec: HolderSpec) -> PlayedHolder:
        raise OSError("no such interpreter")

    ps = ParamShare(tmp_path)
    ps.bind("cuda", refuse, lambda app: 0)
    assert ps.mode_for(_apps()[0], "a-0") is None and ps.exports == {}


def test_copies_are_per_gpu_on_cuda(tmp_path: Path) -> None:
    ps, started = _cuda_share(tmp_path)
    ps._gpu_of = lambda app: 0 if app.name == "a" else 1
    a, b = _apps()
    assert ps.key(a) != ps.key(b)
    ps.mode_for(a, "a-0")
    ps.mode_for(b, "b-0")
    assert [h.spec.gpu for h in started] == [0, 1]


def test_stop_kills_a_holder_that_ignores_sigterm(tmp_path: Path) -> None:
    ps, started = _cuda_share(tmp_path, stubborn=True)
    ps.mode_for(_apps()[0], "a-0")
    ps.stop_holders(timeout_s=0.01)
    assert started[0].terminated and started[0].killed


def test_on_the_cpu_the_first_instance_exports_and_its_exit_leaves_the_segment(tmp_path: Path) -> None:
    ps = ParamShare(tmp_path)
    ps.bind("cpu", lambda spec: pytest.fail("no holder on the CPU"), lambda app: 0)
    a, _ = _apps()
    first = ps.mode_for(a, "a-0")
    assert first is not None and first.startswith("export:")
    assert ps.mode_for(a, "a-1") == "import:" + first.removeprefix("export:")
    Path(first.removeprefix("export:")).write_bytes(b"handles")
    ps.instance_exited("a-0")  # exited (drained or crashed): the node's segment stays valid
    (exp,) = ps.exports.values()
    assert exp.exporter is None and exp.users == {"a-1"}
    assert ps.mode_for(a, "a-r2") == "import:" + first.removeprefix("export:")


def test_on_the_cpu_an_exporter_that_died_before_exporting_is_forgotten(tmp_path: Path) -> None:
    ps = ParamShare(tmp_path)
    ps.bind("cpu", lambda spec: pytest.fail("no holder on the CPU"), lambda app: 0)
    a, _ = _apps()
    first = ps.mode_for(a, "a-0")
    ps.instance_exited("a-0")
    assert ps.exports == {}
    again = ps.mode_for(a, "a-r1")
    assert again is not None and again.startswith("export:") and again != first


def test_onnxruntime_on_the_cpu_provider_shares_one_copy_of_its_initializers(tmp_path: Path) -> None:
    ps = ParamShare(tmp_path)
    ps.bind("cpu", lambda spec: pytest.fail("no holder on the CPU"), lambda app: 0)
    a, b = _apps(engine="onnxruntime")
    assert ps.key(a) is not None and not ps.key(a).startswith("onnxruntime")  # (eager: torch weights)
    key = ps.key(b)
    assert key is not None and key.startswith("onnxruntime|mobilenet_v2|5|10|3x32x32|all")
    first = ps.mode_for(b, "b-0")
    assert first is not None and first.startswith("export:")
    assert ps.mode_for(b, "b-1") == "import:" + first.removeprefix("export:")
    _, basic = _apps(engine={"kind": "onnxruntime", "optimization": "basic"})
    assert ps.key(basic) not in (None, key)  # another optimized graph: other initializers


def test_onnxruntime_on_a_gpu_provider_or_a_cuda_node_keeps_its_own_copy(tmp_path: Path) -> None:
    base = {"model": "mobilenet_v2", "input_shape": [3, 32, 32], "slo_ms": 100, "gpu_pct": 40, "app_id": 1}
    cfg = parse_config({"node": {"backend": "cuda", "mps": "off", "allow_oversubscribe": True},
                        "apps": [{"name": "g", **base, "engine": {"kind": "onnxruntime", "provider": "cuda"}}]})
    (gpu_app,) = cfg.apps
    cuda, started = _cuda_share(tmp_path)
    assert cuda.key(gpu_app) is None and cuda.mode_for(gpu_app, "g-0") is None
    _, b = _apps(engine="onnxruntime")
    assert cuda.key(b) is None and cuda.mode_for(b, "b-0") is None
    assert started == []  # no holder for initializers a GPU session would copy to the device anyway


def test_status_shows_each_shared_copy_its_owner_size_and_users(tmp_path: Path) -> None:
    cuda, started = _cuda_share(tmp_path)
    a, _ = _apps()
    cuda.mode_for(a, "a-0")
    cuda.mode_for(a, "a-1")
    handles = ParameterHandles("cuda", "t", 1, 3 * 2**20, b"\0" * 64, "0000:01:00.0", ())
    Path(started[0].spec.path).write_bytes(handles.to_bytes())
    cpu = ParamShare(tmp_path / "cpu")
    (tmp_path / "cpu").mkdir()
    cpu.bind("cpu", lambda spec: pytest.fail("no holder on the CPU"), lambda app: 0)
    cpu.mode_for(a, "a-0")
    lines = [ln for ln in format_status(NodeView(param_share=(*cuda.describe(), *cpu.describe(), "junk", {}))).splitlines()
             if ln.startswith("param-share")]
    assert lines[0] == (f"param-share {cuda.key(a)}: cuda holder pid {started[0].pid}  3.0 MB  ready  "
                        "users=a-0,a-1")
    assert lines[1] == f"param-share {cpu.key(a)}: cpu node segment  - MB  not written yet  users=a-0"
    assert lines[2] == "param-share ?: ? node segment  - MB  not written yet  users=-"  # malformed: dashes
    assert len(lines) == 3


ORT_CONFIG = """
node:
  listen: {host: 127.0.0.1, port: 0}
  backend: cpu
  allow_oversubscribe: true
  pool: {slot_count: 4096, max_chunks: 64, record_count: 256}
  engine_cache: CACHE
apps:
  - {name: a, model: mobilenet_v2, input_shape: [3, 32, 32], slo_ms: 10000, gpu_pct: 50, instances: 2, max_batch: 4,
     app_id: 1, num_classes: 10, seed: 5, shadow: false, engine: onnxruntime}
"""


@pytest.mark.slow
def test_onnxruntime_instances_serve_from_one_segment_and_survive_the_exporters_death(tmp_path: Path) -> None:
    p = tmp_path / "apps.yaml"
    p.write_text(ORT_CONFIG.replace("CACHE", str(tmp_path / "cache")))
    node = Node(load_config(p), warmup=False, heartbeat_ms=100).start()
    segments: list[str] = []
    try:
        insts = sorted(node.instances.values(), key=lambda st: st.name)
        assert [st.spec.share_params.split(":")[0] for st in insts] == ["export", "import"]
        for _ in range(10):
            node.step(50)
        assert sorted(st.stats.params for st in node.instances.values() if st.stats is not None) == ["exported", "imported"]
        exp = next(iter(node.params.exports.values()))
        segments.append(ParameterHandles.from_bytes(exp.path.read_bytes()).handle.decode())
        assert {st.stats.engine["initializers"]["segment"] for st in node.instances.values() if st.stats and st.stats.engine} == set(segments)
        text = format_status(NodeView.from_dict(node.status()))
        (line,) = [ln for ln in text.splitlines() if ln.startswith("param-share onnxruntime|mobilenet_v2")]
        assert "cpu node segment" in line and "ready" in line and "users=a-0,a-1" in line
        ref_model = load_model("mobilenet_v2", seed=5, num_classes=10, input_shape=(3, 32, 32)).eval()
        rng = np.random.default_rng(0)

        def check(xs: dict[int, np.ndarray]) -> None:
            got = ask(node, {rid: (1, x) for rid, x in xs.items()})
            assert sorted(got) == sorted(xs) and all(r.status == Status.OK for r in got.values())
            for rid, x in xs.items():
                with torch.inference_mode():
                    ref = ref_model(torch.from_numpy(x)[None]).numpy()[0]
                np.testing.assert_allclose(got[rid].array(), ref, rtol=1e-3, atol=1e-3)

        check({rid: rng.random((3, 32, 32), dtype=np.float32) for rid in range(16)})
        os.kill(insts[0].pid, signal.SIGKILL)  # the exporter: the segment is the node's
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(
                st.name.startswith("a-r") and st.ready for st in node.instances.values()):
            node.step(50)
        repl = next(st for st in node.instances.values() if st.name.startswith("a-r"))
        assert repl.spec.share_params.startswith("import:")
        check({rid: rng.random((3, 32, 32), dtype=np.float32) for rid in range(100, 116)})
    finally:
        node.stop()
    assert not any(os.path.exists("/dev/shm/" + n) for n in segments), "stop removes the shared initializers"


@pytest.mark.slow
def test_an_onnxruntime_apps_warm_shadow_maps_the_actives_initializers(tmp_path: Path) -> None:
    """The paper's first Param-Share scenario on ONNX Runtime: the shadow holds no copy of its own."""
    p = tmp_path / "apps.yaml"
    p.write_text(ORT_CONFIG.replace("CACHE", str(tmp_path / "cache")).replace("instances: 2", "instances: 1")
                 .replace("shadow: false", "shadow: warm"))
    node = Node(load_config(p), warmup=False, heartbeat_ms=100).start()
    try:
        def initializers() -> dict[str, dict[str, object]]:
            insts = node.status()["apps"]["a"]["instances"]
            return {i["name"]: (i.get("engine") or {}).get("initializers") or {} for i in insts}

        _until(node, lambda: _ready_shadow(node) and len(initializers()) == 2 and all(initializers().values()), 120,
               "the warm shadow ready")
        shadow = node.shadow_of("a")
        assert shadow is not None and shadow.spec.share_params.startswith("import:")
        got = initializers()
        assert {n: d["mode"] for n, d in got.items()} == {
            **{n: "exported" for n in got if n != shadow.name}, shadow.name: "imported"}
        assert len({d["segment"] for d in got.values()}) == 1  # one copy: the shadow holds none of its own
        (exp,) = node.params.describe()
        assert sorted(exp["users"]) == sorted(node.instances)  # type: ignore[arg-type]
    finally:
        node.stop()


@pytest.mark.slow
def test_an_onnx_model_files_instances_share_its_initializers(tmp_path: Path) -> None:
    dense_model(tmp_path / "dense.onnx")
    p = tmp_path / "apps.yaml"
    p.write_text(ORT_CONFIG.replace("CACHE", str(tmp_path / "cache")).split("apps:")[0]
                 + "apps:\n  - {name: f, model: dense.onnx, slo_ms: 10000, gpu_pct: 50, instances: 2, app_id: 1, "
                   "shadow: cold, engine: onnxruntime}\n")
    node = Node(load_config(p), warmup=False, heartbeat_ms=100).start()
    try:
        _until(node, lambda: sorted(str(st.stats.params if st.stats else None) for st in node.instances.values())
               == ["exported", "imported"], 120, "both instances reporting their initializers")
        (exp,) = node.params.describe()
        assert str(exp["key"]).startswith("onnxruntime|") and exp["mb"] is not None
    finally:
        node.stop()


@pytest.mark.slow
def test_importers_answer_like_the_exporter_and_survive_its_death(tmp_path: Path) -> None:
    p = tmp_path / "apps.yaml"
    p.write_text(CONFIG)
    node = Node(load_config(p), warmup=False, heartbeat_ms=100).start()
    shm_names: list[str] = []
    try:
        insts = sorted(node.instances.values(), key=lambda st: st.name)
        assert [st.spec.share_params.split(":")[0] for st in insts] == ["export", "import"]
        for _ in range(10):
            node.step(50)
        assert sorted(st.stats.params for st in node.instances.values() if st.stats is not None) == ["exported", "imported"]
        from gpuprims.cuda.ipc import ParameterHandles

        exp = next(iter(node.params.exports.values()))
        shm_names.append(ParameterHandles.from_bytes(exp.path.read_bytes()).handle.decode())
        ref_model = load_model("resnet18", seed=5, num_classes=10, input_shape=(3, 32, 32)).eval()
        rng = np.random.default_rng(0)
        xs = {rid: rng.random((3, 32, 32), dtype=np.float32) for rid in range(16)}
        got = ask(node, {rid: (1, x) for rid, x in xs.items()})
        assert sorted(got) == sorted(xs)
        for rid, x in xs.items():
            with torch.inference_mode():
                ref = ref_model(torch.from_numpy(x)[None]).numpy()[0]
            np.testing.assert_allclose(got[rid].array(), ref, rtol=1e-4, atol=1e-4)
        # The exporter dies: the importer keeps serving from the shared weights, and the
        # replacement imports them too (on the CPU the shared object outlives its exporter).
        exporter = insts[0]
        os.kill(exporter.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
                st.name.startswith("a-r") and st.ready for st in node.instances.values()):
            node.step(50)
        repl = next(st for st in node.instances.values() if st.name.startswith("a-r"))
        assert repl.spec.share_params.startswith("import:")
        xs2 = {rid: rng.random((3, 32, 32), dtype=np.float32) for rid in range(100, 116)}
        got2 = ask(node, {rid: (1, x) for rid, x in xs2.items()})
        assert sorted(got2) == sorted(xs2) and all(r.status == Status.OK for r in got2.values())
        for rid, x in xs2.items():
            with torch.inference_mode():
                ref = ref_model(torch.from_numpy(x)[None]).numpy()[0]
            np.testing.assert_allclose(got2[rid].array(), ref, rtol=1e-4, atol=1e-4)
    finally:
        node.stop()
    assert not any(os.path.exists("/dev/shm/" + n) for n in shm_names), "stop removes the shared weights"


@pytest.mark.slow
def test_param_share_can_be_turned_off(tmp_path: Path) -> None:
    p = tmp_path / "apps.yaml"
    p.write_text(CONFIG)
    node = Node(load_config(p), warmup=False, share_params=False).start()
    try:
        assert all(st.spec.share_params is None for st in node.instances.values())
    finally:
        node.stop()


# -- on the fake CUDA runtime: the weights outlive every instance that maps them --------------------------

CUDA_CONFIG = """
node:
  listen: {host: 127.0.0.1, port: 0}
  backend: cuda
  mps: off
  run_dir: RUN_DIR
  shadow_settle_s: 0
  pool: {slot_count: 4096, max_chunks: 64, record_count: 512}
apps:
  - {name: a, model: mobilenet_v2, input_shape: [3, 32, 32], slo_ms: 20000, gpu_pct: 50, instances: INSTANCES,
     max_batch: 4, app_id: 1, num_classes: 10, seed: 5, shadow: true}
"""


def _cuda_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, instances: int) -> tuple[Node, Path]:
    """A node on the fake CUDA runtime whose processes log every IPC use-after-free to the returned file."""
    faults = tmp_path / "fake-cuda-faults.jsonl"
    monkeypatch.setenv(fake.FAKE_ENV, "1")
    monkeypatch.setenv(fake.FAULT_LOG_ENV, str(faults))
    p = tmp_path / "apps.yaml"
    p.write_text(CUDA_CONFIG.replace("RUN_DIR", str(tmp_path / "run")).replace("INSTANCES", str(instances)))
    return Node(load_config(p), warmup=False, heartbeat_ms=100, ready_timeout_s=300).start(), faults


def _until(node: Node, cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Step the node until ``cond()``; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout_s:.0f} s: {node.status()['apps']}")
        node.step(20)


def _ready_shadow(node: Node) -> bool:
    st = node.shadow_of("a")
    return st is not None and st.ready


def _answered_once(load: Load) -> None:
    """Every request sent was answered exactly once, and none failed: OK, or shed by the node's own
    overload rules when a busy machine slows the instances (OVERLOADED, DEADLINE_MISSED). What the bug
    gave is INTERNAL (a model on freed weights) and INSTANCE_FAILED (instances that cannot map them)."""
    assert load.sent > 0
    assert sorted(load.got) == list(range(load.sent)), "every request answered"
    assert all(len(v) == 1 for v in load.got.values()), "none answered twice"
    statuses = collections.Counter(Status(v[0][0]).name for v in load.got.values())
    assert set(statuses) <= {"OK", "OVERLOADED", "DEADLINE_MISSED"} and statuses["OK"] > 0, statuses


def _serves_like_the_model(node: Node) -> None:
    """The app's instances answer OK with what the model computes on the same input (freed weights would
    be poison, 0xFF bytes: NaN)."""
    ref_model = load_model("mobilenet_v2", seed=5, num_classes=10, input_shape=(3, 32, 32)).eval()
    rng = np.random.default_rng(7)
    xs = {10_000 + i: rng.random((3, 32, 32), dtype=np.float32) for i in range(8)}
    got = ask(node, {rid: (1, x) for rid, x in xs.items()})
    assert sorted(got) == sorted(xs) and all(r.status == Status.OK for r in got.values())
    for rid, x in xs.items():
        with torch.inference_mode():
            ref = ref_model(torch.from_numpy(x)[None]).numpy()[0]
        np.testing.assert_allclose(got[rid].array(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_set_gpu_with_a_shadow_under_load_never_reads_freed_weights(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The paper's first Param-Share scenario on CUDA: a shadow shares the active's weights, a change of
    share makes it the active and retires the old one, which exits. The new active must still read live
    weights (issue 43: the old exporter's exit freed them), and the next shadow must map them too."""
    node, faults = _cuda_node(tmp_path, monkeypatch, instances=1)
    try:
        _until(node, lambda: _ready_shadow(node), 300, "the shadow's start")
        (old,) = node.supervisor.actives("a")
        load = Load(node.ingest.ports[0], rate_rps=10)
        _until(node, lambda: len(load.got) >= 10, 120, "answers before the change")
        ch = node.set_gpu("a", 40)
        _until(node, lambda: ch.phase.terminal, 300, "the change")
        assert ch.phase.value == "done", ch.to_dict()
        _until(node, lambda: old.name not in node.instances, 120, "the old active's exit")
        # The new active serves on after the old one is gone, and a new shadow maps the weights.
        seen = len(load.got)
        _until(node, lambda: len(load.got) >= seen + 20 and _ready_shadow(node), 300, "answers after the change")
        load.finish(node)
        _answered_once(load)
        _serves_like_the_model(node)
    finally:
        node.stop()
    assert fake.read_fault_log(faults) == [], "an instance read IPC memory its exporter had freed"


def _serving(node: Node, n_actives: int) -> bool:
    """The app has ``n_actives`` ready actives and a ready shadow."""
    actives = node.supervisor.actives("a")
    return len(actives) == n_actives and all(st.ready for st in actives) and _ready_shadow(node)


@pytest.mark.slow
def test_killing_each_instance_and_the_holder_in_turn_answers_every_request_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two actives and a shadow map one copy of the weights; each is killed in turn under load, then the
    copy's holder. An instance's death never frees the weights under the others (no fault logged); the
    holder's death does (it is the copy), so an instance that runs a batch before the node has restarted
    it may fault on the dead arena (cudaErrorIllegalAddress: it leaves with that batch unanswered, and the
    node requeues it); the holder's death restarts exactly the instances that mapped its arena, and every
    request is answered once."""
    node, faults = _cuda_node(tmp_path, monkeypatch, instances=2)
    holders: list[int] = []
    try:
        _until(node, lambda: _serving(node, 2), 300, "two actives and a shadow")
        assert {st.spec.share_params.split(":")[0] for st in node.instances.values()} == {"import"}
        (exp,) = node.params.exports.values()
        assert exp.users == set(node.instances) and exp.holder is not None
        holders.append(exp.holder.pid)
        load = Load(node.ingest.ports[0], rate_rps=10)
        _until(node, lambda: len(load.got) >= 10, 120, "answers before the kills")
        for victim in sorted(node.instances.values(), key=lambda st: st.name):
            seen = len(load.got)
            os.kill(victim.pid, signal.SIGKILL)
            _until(node, lambda name=victim.name, seen=seen: name not in node.instances and _serving(node, 2)
                   and len(load.got) >= seen + 10, 300, f"the recovery from killing {victim.name}")
            (now,) = node.params.exports.values()
            assert now is exp and exp.users == set(node.instances), "an instance's death leaves the weights alone"
        assert fake.read_fault_log(faults) == [], "an instance's death freed weights another instance maps"
        before = set(node.instances)
        before_pids = {node.instances[name].pid for name in before}
        seen = len(load.got)
        assert exp.holder is not None
        os.kill(exp.holder.pid, signal.SIGKILL)
        _until(node, lambda: not (before & set(node.instances)) and _serving(node, 2) and len(load.got) >= seen + 10,
               300, "the recovery from killing the holder")
        (new,) = node.params.exports.values()
        assert new is not exp and new.holder is not None and new.users == set(node.instances)
        holders.append(new.holder.pid)
        assert any(e["event"] == "holder_died" and set(e["users"]) == before for e in node.events)
        load.finish(node)
        _answered_once(load)
        _serves_like_the_model(node)
    finally:
        node.stop()
    # after the holder's death: faults only of the instances that mapped its arena, on that arena
    bad = [f for f in fake.read_fault_log(faults) if f["owner"] != holders[0] or f["pid"] not in before_pids]
    assert bad == [], "an instance read IPC memory of an exporter that was not the killed holder"
    for pid in holders:  # the node stopped (and reaped) every holder
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
