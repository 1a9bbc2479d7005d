from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpuprims.ingest import Ingest
from gpuprims.pool import PacketPool
from gpuprims.profile import save_profile, with_stages
from orchestrator.config.schema import NodeConfig
from orchestrator.control.records import InstanceStats, Role
from orchestrator.node.cpu_overflow import (
    NodeOverflow,
    OverflowSetupError,
    plan_pools,
    start_overflow,
)
from tests.gpuprims.sched._profiles import grid


def _cfg(*apps: dict, reserved: int = 1) -> NodeConfig:
    return NodeConfig.model_validate({"node": {"overflow_reserved_cores": reserved}, "apps": list(apps)})


def _app(name: str, **kw: object) -> dict:
    return {"name": name, "model": "resnet50", "slo_ms": 100, "overflow": "cpu", **kw}


def _profiles(accel_ms: float = 10.0, cpu_ms: float = 30.0) -> list:
    accel = with_stages(grid("resnet50", {50: {1: 2 * accel_ms, 8: 8 * accel_ms}, 100: {1: accel_ms, 8: 4 * accel_ms}}),
                        [], device_kind="accelerator")
    cpu = with_stages(grid("resnet50", {50: {1: 2 * cpu_ms, 8: 16 * cpu_ms}, 100: {1: cpu_ms, 8: 8 * cpu_ms}}), [],
                      device_kind="cpu", cpu_cores=2)
    return [accel, cpu]


def test_pools_are_disjoint_from_the_top_and_leave_the_reserved_cores() -> None:
    cfg = _cfg(_app("a", overflow_cores=2), {"name": "n", "model": "resnet50", "slo_ms": 50}, _app("b"))
    pools = plan_pools(cfg, cores=range(8))
    assert pools["a"].cores == (6, 7) and pools["b"].cores == (5,) and "n" not in pools
    assert pools["a"].env() == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
    with pytest.raises(OverflowSetupError, match="app 'a': overflow_cores=2 but only 1 cores are left"):
        plan_pools(cfg, cores=[0, 1])


def test_route_overflows_once_the_accelerator_queue_is_longer_than_the_cpu_takes() -> None:
    cfg = _cfg(_app("a", gpu_pct=100, overflow_cores=2))
    with start_overflow(cfg, _profiles(), cores=range(4)) as h:
        ov = h.app("a")
        assert ov is not None and h.app("other") is None
        # accelerator 10 ms per request at 100%; the 2-core pool 30 ms (its profile at 100% of 2 cores).
        got = [ov.route().device for _ in range(4)]
        assert got == ["gpu", "gpu", "gpu", "cpu"]  # the 4th would finish at 40 ms on the accelerator
        assert ov.in_flight() == {"gpu": 3, "cpu": 1} and ov.routed == {"gpu": 3, "cpu": 1}
        ov.finished("cpu", 30.0)
        ov.finished("gpu", 10.0)
        assert ov.in_flight() == {"gpu": 2, "cpu": 0}
        # measured queue lengths override the count of what was routed
        assert ov.route(accel_queue=0, cpu_queue=0).device == "gpu"
    # closed: the CPU pool is going away, so everything goes to the accelerator
    assert ov.route(accel_queue=100, cpu_queue=0).device == "gpu"


def test_measured_slowness_moves_the_decision_and_batches_use_the_profile() -> None:
    cfg = _cfg(_app("a", gpu_pct=100, overflow_cores=2))
    ov = start_overflow(cfg, _profiles(), cores=range(4)).app("a")
    assert ov is not None
    for _ in range(20):
        ov.finished("gpu", 50.0)  # the accelerator turns out five times slower than profiled
    assert ov.route(accel_queue=0, cpu_queue=0).device == "cpu"
    d = ov.route(accel_queue=0, cpu_queue=0, batch=8)
    assert d.cpu_finish_ms == pytest.approx(8 * 30.0, rel=0.01)


def test_missing_profiles_are_named_with_the_command_that_makes_them() -> None:
    cfg = _cfg(_app("a", overflow_cores=2))
    with pytest.raises(OverflowSetupError, match=r"needs cpu profile\(s\) of model 'resnet50'.*--device cpu --cores 2"):
        start_overflow(cfg, _profiles()[:1], cores=range(4))


def test_bad_reports_are_refused_and_routing_is_thread_safe() -> None:
    ov = start_overflow(_cfg(_app("a", gpu_pct=100)), _profiles(), cores=range(4)).app("a")
    assert ov is not None
    with pytest.raises(ValueError, match="device"):
        ov.finished("tpu", 1.0)

    def hammer() -> None:
        for _ in range(500):
            d = ov.route()
            ov.finished(d.device, None)

    ts = [threading.Thread(target=hammer) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert ov.in_flight() == {"gpu": 0, "cpu": 0}
    assert sum(ov.routed.values()) == 2000


# ---- NodeOverflow: the node's side (the ingest's cost models, the split) ----------------------------------


@pytest.fixture
def ingest() -> Iterator[Ingest]:
    pool = PacketPool.create(slot_count=64, record_count=8, max_chunks=4, consumer_count=4)
    ing = Ingest(pool, [("127.0.0.1", 0)])  # never started: only its cost models are used
    yield ing
    ing.stop()
    pool.close()


def _node_overflow(tmp_path: Path, *, accel: bool = True) -> tuple[NodeOverflow, dict]:
    d = tmp_path / "profiles"
    d.mkdir()
    accel_p = with_stages(grid("resnet50", {100: {1: 2.0, 8: 8.0}}), [], device_kind="accelerator")
    cpu_p = with_stages(grid("resnet50", {100: {1: 10.0, 8: 40.0}}), [], device_kind="cpu", cpu_cores=1)
    save_profile(cpu_p, d / "resnet50.cpu.json")
    cfg = NodeConfig.model_validate({"node": {"overflow_profiles": str(d)}, "apps": [
        _app("a", gpu_pct=100, max_batch=8, overflow_cores=1, overflow_alpha_ms=1.0)]})
    ov = NodeOverflow.plan(cfg, cores=[0, 1])
    assert ov is not None
    ov.attach(cfg.apps[0], lambda model: accel_p if accel else None, 1)
    return ov, {"accel": accel_p, "cpu": cpu_p}


def _inst(name: str, role: str, consumer: int, **stats: object) -> SimpleNamespace:
    return SimpleNamespace(name=name, app="a", role=role, ready=True, ended=False,
                           spec=SimpleNamespace(consumer=consumer), stats=InstanceStats(**stats))


def test_costs_come_from_the_profiles_then_follow_measured_batches(tmp_path: Path, ingest: Ingest) -> None:
    ov, _ = _node_overflow(tmp_path)
    acc, cpu = _inst("a-0", "active", 0), _inst("a-c1", Role.OVERFLOW, 1)
    assert ov.update([acc, cpu], ingest, now=0.0)
    # accelerator: 8 ms a batch of 8 -> 1000 us a request, a lone request 2 ms -> 1000 us fixed;
    # CPU (1 core of a 1-core profile): 40 ms / 8 -> 5000 us, 10 ms alone -> 5000 us + alpha 1 ms.
    assert ingest.cost(0) == pytest.approx((1000.0, 1000.0))
    assert ingest.cost(1) == pytest.approx((6000.0, 5000.0))
    assert not ov.update([acc, cpu], ingest, now=0.1)  # not due yet (every COST_UPDATE_S)
    # First heartbeats open the measurement window; a second one, 1 s later, closes it: the
    # accelerator ran 10 batches of 8 in 160 ms (twice its profile), busy 16% of the second.
    acc.stats = InstanceStats(busy_ms=0.0, batches=0, batch_sizes={})
    ov.update([acc, cpu], ingest, now=1.0)
    acc.stats = InstanceStats(busy_ms=160.0, batches=10, batch_sizes={"8": 10})
    ov.update([acc, cpu], ingest, now=2.0)
    # learned scale 0.8 + 0.2 * 2 = 1.2: 1200 us a request; fixed 1.2 * 2000 - 1200 plus 0.16 x 16 ms / 2
    fixed, per = ingest.cost(0)  # type: ignore[misc]
    assert per == pytest.approx(1200.0) and fixed == pytest.approx(1200.0 + 1280.0)
    assert ingest.cost(1) == pytest.approx((6000.0, 5000.0))  # the CPU measured nothing: unchanged
    assert ov.costs["a"]["a-0"] == (pytest.approx(2480.0), pytest.approx(1200.0))
    # A heartbeat whose batch sizes are not numbers measures nothing and breaks nothing (its other
    # fields are refused at the wire: InstanceStats.from_wire).
    acc.stats = InstanceStats(busy_ms=170.0, batches=11, batch_sizes={"eight": 1})
    assert ov.update([acc, cpu], ingest, now=3.0)
    # The CPU instance gone: its queue loses its cost model (its consumer may serve another app next).
    ov.update([acc], ingest, now=4.0)
    assert ingest.cost(1) is None and ingest.cost(0) is not None
    # A route change sets costs at once, from the models as they stand: a new (still loading) active
    # is costed like the accelerator, a CPU instance only once it is ready.
    new, cpu2 = _inst("a-r5", "active", 2), _inst("a-c6", Role.OVERFLOW, 3)
    new.ready = cpu2.ready = False
    ov.reroute([acc, new, cpu2], ingest)
    assert ingest.cost(2) is not None and ingest.cost(2)[1] == pytest.approx(ingest.cost(0)[1])  # type: ignore[index]
    assert ingest.cost(3) is None


def test_split_counts_each_device_and_keeps_what_gone_instances_counted(tmp_path: Path) -> None:
    ov, _ = _node_overflow(tmp_path, accel=False)
    assert ov.seeded_from_cpu == {"a"}  # no accelerator profile: seeded from the CPU one until measured
    acc = _inst("a-0", "active", 0, received=10, ok=9, errors=1)
    dead = _inst("a-c1", Role.OVERFLOW, 1, received=4, ok=2, deadline_missed=1)
    ov.retire(dead)
    ov.lost("a")
    cpu = _inst("a-c2", Role.OVERFLOW, 2, received=3, ok=3)
    shadow = _inst("a-s3", "shadow", 3, received=99)
    split = ov.split("a", [acc, cpu, shadow])
    assert split["accelerator"] == {"routed": 10, "ok": 9, "answered": 10}
    assert split["cpu"] == {"routed": 7, "ok": 5, "answered": 6}
    assert split["cpu_instance_failures"] == 1 and split["cores"] == [1]


def test_overflow_without_a_cpu_profile_is_refused_with_the_command(tmp_path: Path) -> None:
    cfg = NodeConfig.model_validate({"node": {"overflow_profiles": str(tmp_path)}, "apps": [
        _app("a", input_shape=[3, 64, 64])]})
    with pytest.raises(OverflowSetupError, match=r"app 'a'.*CPU profile of model 'resnet50'.*gpuprims-profile "
                                                 r"resnet50 --device cpu --cores 1 --input-shape 3,64,64"):
        NodeOverflow.plan(cfg, cores=[0, 1])
    sched = NodeConfig.model_validate({"node": {"scheduler": "temporal"}, "apps": [_app("a")]})
    with pytest.raises(OverflowSetupError, match=r"node\.scheduler spatial"):
        NodeOverflow.plan(sched, cores=[0, 1])
    assert NodeOverflow.plan(NodeConfig.model_validate({"apps": [{"name": "n", "model": "resnet50", "slo_ms": 50}]})) is None
