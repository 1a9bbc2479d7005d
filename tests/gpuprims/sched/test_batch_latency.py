from __future__ import annotations

import pytest

from gpuprims.sched.batch_latency import batch_latency, largest_batch
from tests.gpuprims.sched._profiles import grid

A = grid("a", {50: {1: 4.0, 2: 6.0, 4: 10.0}, 100: {1: 2.0, 2: 3.0, 4: 5.0}})
B = grid("b", {25: {1: 8.0, 8: 40.0}, 100: {1: 1.0, 8: 4.5}})


def test_known_answers() -> None:
    assert batch_latency({"a": A, "b": B}, 100, 4.0) == {"a": 3, "b": 7}  # a: L(3)=4.0; b: L(7)=4.0
    assert batch_latency([A, B], 50, 7.0) == {"a": 2, "b": 1}  # b at 50%: L(1)=5.67, L(2)=8.88
    assert batch_latency([A], 75, 3.0) == {"a": 1}
    assert batch_latency([A, B], 100, 0.5) == {"a": 0, "b": 0}
    assert batch_latency([A], 30, 100.0) == {"a": 0}  # below a's measured GPU%: no prediction
    assert batch_latency([A, B], 100, 1000.0) == {"a": 4, "b": 8}


def test_b_at_50_pct_is_interpolated() -> None:
    # b at 50%: batch 1 = 8 - (8-1)/3 = 5.667 ms, so 6 ms fits one request
    assert B.latency_ms(1, 50) == pytest.approx(17 / 3)
    assert batch_latency([B], 50, 6.0) == {"b": 1}


def test_largest_batch_with_scale_and_cap() -> None:
    assert largest_batch(A, 100, 5.0) == 4
    assert largest_batch(A, 100, 5.0, scale=2.0) == 1  # predicted 4 ms for batch 1, 6 ms for batch 2
    assert largest_batch(A, 100, 5.0, max_batch=2) == 2
    with pytest.raises(ValueError, match="scale"):
        largest_batch(A, 100, 5.0, scale=0)


@pytest.mark.parametrize(("pct", "interval", "needle"), [(0, 5.0, "gpu_pct"), (101, 5.0, "gpu_pct"),
                                                         (50, -1.0, "interval_ms"),
                                                         (50, float("nan"), "interval_ms")])
def test_bad_input(pct: float, interval: float, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        batch_latency([A], pct, interval)
