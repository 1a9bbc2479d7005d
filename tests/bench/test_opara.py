"""bench/opara's own bookkeeping: the flat summary rows, the paper's figures beside ours."""

from __future__ import annotations

import pytest

from bench.opara import (
    CPU_MODES,
    GPU_MODES,
    MIN_TIMED,
    Budget,
    latency_rows,
    main,
    planning_rows,
    timed_rounds,
    timing_summary,
)


def test_timing_summary() -> None:
    assert timing_summary([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0}
    assert timing_summary([]) == {"median": None, "min": None}


def test_planning_rows_put_the_papers_figures_beside_ours() -> None:
    plan = {"num_streams": 28, "num_events": 36, "num_waits": 54, "ops": 199}
    rows = planning_rows("googlenet", [0.5, 0.3, 0.4], [0.2, 0.1, 0.3], plan)
    assert rows["googlenet_planning_ms"] == 0.4 and rows["googlenet_planning_min_ms"] == 0.3
    assert rows["googlenet_allocation_ms"] == 0.2 and rows["googlenet_allocation_min_ms"] == 0.1
    # The paper's Table I times Algorithm 1 alone: its figure sits beside our allocation time.
    assert rows["googlenet_paper_allocation_ms"] == 0.27 and rows["googlenet_paper_streams"] == 28
    assert "googlenet_paper_planning_ms" not in rows
    assert (rows["googlenet_streams"], rows["googlenet_events"], rows["googlenet_waits"]) == (28, 36, 54)
    assert planning_rows("inception_v3", [1.0], [1.0], plan)["inception_v3_paper_allocation_ms"] == 0.5


def test_latency_rows_speedups_equality_and_null_gpu_rows() -> None:
    samples = {"eager": [10.0, 12.0, 11.0], "streams": [20.0, 22.0, 21.0], "streams_capped": [5.5]}
    equal = {"streams": True, "streams_capped": False}
    rows = latency_rows("googlenet", 8, samples, equal)
    assert rows["googlenet_b8_eager_ms"] == 11.0
    assert rows["googlenet_b8_streams_speedup"] == 11.0 / 21.0
    assert rows["googlenet_b8_streams_capped_speedup"] == 2.0
    assert rows["googlenet_b8_streams_equal_eager"] is True
    assert rows["googlenet_b8_streams_capped_equal_eager"] is False
    # onnxruntime not installed: its modes are null, not missing
    assert rows["googlenet_b8_ort_parallel_ms"] is None and rows["googlenet_b8_ort_parallel_speedup"] is None
    for mode in GPU_MODES:
        assert rows[f"googlenet_b8_{mode}_ms"] is None
    assert {k for k in rows if k.endswith("_ms")} == {f"googlenet_b8_{m}_ms" for m in (*CPU_MODES, *GPU_MODES)}


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_budget_shares_what_is_left_over_the_rows_left() -> None:
    clock = FakeClock()
    b = Budget(60.0, rows=3, clock=clock)
    assert b.next_row() == 120.0  # 60 s over 3 rows
    clock.t = 105.0  # the first row took 5 s of its 20: the rest passes on
    assert b.next_row() == 105.0 + 55.0 / 2
    clock.t = 170.0  # past the limit: the last row is skipped
    assert b.next_row() is None
    assert b.elapsed_s() == 70.0


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan")])
def test_budget_refuses_a_bad_limit_by_value(bad: float) -> None:
    with pytest.raises(ValueError, match="max_seconds"):
        Budget(bad, rows=1)


def test_timed_rounds_stop_at_the_row_deadline_after_the_minimum() -> None:
    clock = FakeClock()
    # Deadline not reached: every warm-up and timed round.
    assert [t for _, t in timed_rounds(2, 5, row_deadline=1e9, clock=clock)] == [False] * 2 + [True] * 5
    # Deadline passed from the start: the warm-up and MIN_TIMED timed rounds, no more.
    got = list(timed_rounds(1, 30, row_deadline=0.0, clock=clock))
    assert [t for _, t in got] == [False] + [True] * MIN_TIMED
    assert [i for i, _ in got] == list(range(1 + MIN_TIMED))


@pytest.mark.parametrize("args, msg", [
    (["--max-seconds", "0"], "--max-seconds"),
    (["--repeats-batched", "0"], "--repeats-batched"),
    (["--batches", "0"], "--batches"),
])
def test_bad_arguments_are_refused_by_name(args: list[str], msg: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err
