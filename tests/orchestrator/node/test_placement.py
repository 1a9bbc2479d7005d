"""Placement: what a share gives an instance, and the change that really changes it."""

from __future__ import annotations

import pytest

from orchestrator.config.schema import parse_config
from orchestrator.control.errors import PlacementError
from orchestrator.node import placement as placement_mod
from orchestrator.node.placement import Placement
from orchestrator.node.state import AppState


def _placement(backend: str) -> Placement:
    cfg = parse_config({"node": {"backend": backend}, "apps": [{"name": "a", "model": "resnet18", "slo_ms": 50}]},
                       source="test")
    apps = {a.name: AppState(cfg=a, gpu_pct=50, instances=1) for a in cfg.apps}
    return Placement(cfg, apps, backend=backend)


@pytest.fixture
def two_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement_mod, "available_cores", lambda: [0, 1])


def test_cpu_capacity_is_whole_cores(two_cores: None) -> None:
    p = _placement("cpu")
    assert [p.capacity(pct) for pct in (5, 30, 40, 50, 70, 75, 100)] == [1, 1, 1, 1, 1, 2, 2]


def test_a_change_that_buys_nothing_is_not_made_or_goes_to_the_next_share_that_does(two_cores: None) -> None:
    p = _placement("cpu")
    # 50% -> 40% of 2 cores is one core either way, and nothing lower gives less than one core.
    assert p.effective_target(50, 40, lo=5, hi=100) is None
    # 50% -> 60% is still one core; 75% is the first share that gives two.
    assert p.effective_target(50, 60, lo=5, hi=100) == 75
    # ... unless the other apps leave no room for it.
    assert p.effective_target(50, 60, lo=5, hi=70) is None
    # Down from two cores: 74% (1.48 cores, rounded) is the nearest share that gives one.
    assert p.effective_target(100, 90, lo=5, hi=100) == 74


def test_on_cuda_every_percentage_counts() -> None:
    p = _placement("cuda")
    assert p.effective_target(50, 40, lo=5, hi=100) == 40
    assert p.effective_target(50, 60, lo=5, hi=100) == 60


# -- several GPUs in one node: shares are per device -------------------------------------------------


def _on(backend: str, apps: list[dict], **node: object) -> Placement:
    cfg = parse_config({"node": {"backend": backend, **node}, "apps": apps}, source="test")
    states = {a.name: AppState(cfg=a, gpu_pct=0, instances=a.instances if isinstance(a.instances, int) else 1)
              for a in cfg.apps}
    return Placement(cfg, states, backend=backend)


def test_two_apps_at_100_percent_on_two_gpus_fit() -> None:
    p = _on("cuda", [{"name": "a", "model": "resnet18", "slo_ms": 50, "gpu_pct": 100, "gpu": 0},
                     {"name": "b", "model": "resnet18", "slo_ms": 50, "gpu_pct": 100, "gpu": 1}])
    p.assign_pcts()
    assert p.device_load() == {0: 100, 1: 100}
    assert (p.device_of("a"), p.device_of("b")) == (0, 1)


def test_auto_shares_split_what_each_gpu_has_left() -> None:
    p = _on("cuda", [{"name": "a", "model": "resnet18", "slo_ms": 50, "gpu_pct": 60, "gpu": 0},
                     {"name": "b", "model": "resnet18", "slo_ms": 50, "gpu": 0},
                     {"name": "c", "model": "resnet18", "slo_ms": 50, "gpu": 1},
                     {"name": "d", "model": "resnet18", "slo_ms": 50, "gpu": 1}])
    p.assign_pcts()
    assert {n: a.gpu_pct for n, a in p.apps.items()} == {"a": 60, "b": 40, "c": 50, "d": 50}


def test_too_much_on_one_gpu_is_refused_naming_the_gpu() -> None:
    # The file check passes (auto instances count as one), sizing puts 2 x 60% on GPU 1.
    p = _on("cuda", [{"name": "a", "model": "resnet18", "slo_ms": 50, "gpu_pct": 100, "gpu": 0},
                     {"name": "b", "model": "resnet18", "slo_ms": 50, "gpu_pct": 60, "gpu": 1}])
    p.apps["b"].instances = 2
    with pytest.raises(PlacementError, match=r"GPU 1 add up to 120% .*b 60% x 2"):
        p.assign_pcts()


def test_on_the_cpu_backend_every_app_shares_the_one_cpu_device() -> None:
    p = _on("cpu", [{"name": "a", "model": "resnet18", "slo_ms": 50, "gpu_pct": 100, "gpu": 0},
                    {"name": "b", "model": "resnet18", "slo_ms": 50, "gpu_pct": 100, "gpu": 1}])
    with pytest.raises(PlacementError, match="CPU device add up to 200%"):
        p.assign_pcts()


def test_a_change_of_share_counts_only_the_apps_on_the_same_gpu() -> None:
    p = _on("cuda", [{"name": "a", "model": "resnet18", "slo_ms": 50, "gpu_pct": 50, "gpu": 0},
                     {"name": "b", "model": "resnet18", "slo_ms": 50, "gpu_pct": 90, "gpu": 1},
                     {"name": "c", "model": "resnet18", "slo_ms": 50, "gpu_pct": 10, "gpu": 1}])
    p.assign_pcts()
    p.check_share("a", 100)  # GPU 1's 100% does not count against GPU 0
    assert p.held_beside("b") == 10
    with pytest.raises(ValueError, match="would put GPU 1 at 101%"):
        p.check_share("b", 91)
