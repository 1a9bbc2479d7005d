from __future__ import annotations

import pytest

from gpuprims.profile import paper_profiles
from gpuprims.profile.knee import knee
from tests.gpuprims.sched._profiles import grid

P = grid("k", {10: {1: 10.0, 2: 20.0}, 20: {1: 5.0, 2: 10.0}, 50: {1: 2.2, 2: 3.0}, 100: {1: 2.0, 2: 3.0}})


def test_knee_known_answers() -> None:
    # within 10% of 2.0 ms first happens exactly at the 50% point
    assert knee(P, 1) == 50
    # within 50% (3.0 ms): L(p) = 5 - 2.8 (p - 20) / 30 <= 3  <=>  p >= 41.43
    assert knee(P, 1, tolerance=0.5) == 42
    # batch 2 is flat from 50% on; between 20 and 50 it falls from 10 to 3
    assert knee(P, 2, tolerance=0.0) == 50
    assert knee(P, 1, tolerance=10.0) == 10


def test_knee_of_paper_profiles_grows_with_batch() -> None:
    for p in paper_profiles().values():
        assert knee(p, 1) <= knee(p, 8)


@pytest.mark.parametrize(("batch", "tol", "needle"), [(3, 0.1, "batch_size 3"), (1, -0.1, "tolerance"),
                                                      (1, 11.0, "tolerance")])
def test_knee_bad_input(batch: int, tol: float, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        knee(P, batch, tolerance=tol)
