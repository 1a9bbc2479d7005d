from __future__ import annotations

import threading

import pytest

from gpuprims.profile import with_stages
from orchestrator.config import NodeConfig
from orchestrator.overflow import OverflowSetupError, plan_pools, start_overflow
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
