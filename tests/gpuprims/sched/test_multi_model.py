from __future__ import annotations

import pytest

from gpuprims.profile import paper_profile
from gpuprims.sched.multi_model import multi_model
from tests.gpuprims.sched._profiles import grid

P = grid("m", {10: {1: 60.0, 2: 100.0}, 20: {1: 25.0, 2: 40.0}, 25: {1: 15.0, 2: 30.0},
               33: {1: 12.0, 2: 20.0}, 50: {1: 10.0, 2: 14.0}, 100: {1: 10.0, 2: 12.0}})


def test_known_answers() -> None:
    # 1x100: 100 rps, 2x50: 200, 3x33: 250, 4x25: 266.7, 5x20: 25 ms misses 20 ms
    assert multi_model(P, 100, 20.0) == (4, 25)
    assert multi_model(P, 100, 12.0) == (3, 33)
    assert multi_model(P, 100, 10.0) == (2, 50)  # ties with 1x100 on latency, wins on throughput
    assert multi_model(P, 100, 5.0) == (0, 0)
    assert multi_model(P, 50, 20.0) == (2, 25)  # 2x25: 133 rps; 1x50: 100 rps
    assert multi_model(P, 100, 20.0, max_instances=2) == (2, 50)
    # batch 2: 1x100 167, 2x50 286, 3x33 300, 4x25 at 30 ms misses 20 ms
    assert multi_model(P, 100, 20.0, batch_size=2) == (3, 33)


def test_paper_resnet50_prefers_two_halves_at_batch_8() -> None:
    # Table IV: Multi-Model suggests 2 instances of ResNet-50 at 50% each (30 ms SLO)
    assert multi_model(paper_profile("resnet50"), 100, 30.0, batch_size=8) == (2, 50)


@pytest.mark.parametrize(("kw", "needle"), [
    ({"available_pct": 0, "deadline_ms": 10.0}, "available_pct"),
    ({"available_pct": 101, "deadline_ms": 10.0}, "available_pct"),
    ({"available_pct": 50, "deadline_ms": 0.0}, "deadline_ms"),
    ({"available_pct": 50, "deadline_ms": 10.0, "batch_size": 3}, "batch_size 3"),
    ({"available_pct": 50, "deadline_ms": 10.0, "max_instances": 0}, "max_instances"),
])
def test_bad_input(kw: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        multi_model(P, **kw)
