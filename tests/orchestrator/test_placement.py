"""Placement: what a share gives an instance, and the change that really changes it."""

from __future__ import annotations

import pytest

from orchestrator import placement as placement_mod
from orchestrator.config import parse_config
from orchestrator.placement import Placement
from orchestrator.state import AppState


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
