from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

from gpuprims.stats import (
    DURATION_BUCKETS_S,
    STAGES,
    DurationHistogram,
    RequestHistograms,
    Reservoir,
    StageClock,
    add_wire,
    percentiles,
)


def test_buckets_hold_values_up_to_their_bound() -> None:
    h = DurationHistogram()
    h.observe([0.0005, 0.0006, 0.001, 31.0, -1.0])
    cum = dict(h.cumulative())
    assert cum[0.0005] == 2  # the bound itself and the negative value (counted as 0)
    assert cum[0.001] == 4 and cum[30.0] == 4 and cum[math.inf] == 5
    assert h.count == 5 and h.sum_s == pytest.approx(0.0005 + 0.0006 + 0.001 + 31.0)
    h.observe(0.02)
    assert h.count == 6 and dict(h.cumulative())[0.02] == 5
    with pytest.raises(ValueError, match="NaN"):
        h.observe([float("nan")])
    assert len(h.cumulative()) == len(DURATION_BUCKETS_S) + 1


def test_batch_observation_and_wire_round_trip() -> None:
    r = RequestHistograms()
    first = np.array([1_000_000_000, 1_002_000_000], np.int64)
    r.observe_batch(first, start_ns=1_004_000_000, end_ns=1_014_000_000, done_ns=1_015_000_000)
    assert r.request.count == r.queue.count == r.compute.count == 2
    assert r.request.sum_s == pytest.approx(0.015 + 0.013)
    assert r.queue.sum_s == pytest.approx(0.004 + 0.002)
    assert r.compute.sum_s == pytest.approx(0.020)  # each request counts its batch's 10 ms
    wire = json.loads(json.dumps(r.to_wire()))
    back = RequestHistograms.from_wire(wire)
    assert back.to_wire() == r.to_wire()
    r.observe_answered(first, compute_s=0.010, done_ns=1_015_000_000)
    assert r.queue.sum_s == pytest.approx(0.004 + 0.002 + 0.005 + 0.003)  # compute ended at the answer
    r.observe_batch([], start_ns=0, end_ns=0, done_ns=0)  # nothing answered: nothing counted
    with pytest.raises(ValueError, match="start_ns"):
        r.observe_batch(first, start_ns=5, end_ns=4, done_ns=6)


def test_add_wire_sums_live_and_retired() -> None:
    a, b = RequestHistograms(), RequestHistograms()
    a.request.observe([0.001, 0.002])
    b.request.observe([0.5])
    total = add_wire(a.to_wire(), b.to_wire())
    assert sum(total["request"]["counts"]) == 3 and total["request"]["sum_s"] == pytest.approx(0.503)
    assert add_wire(None, b.to_wire()) == b.to_wire() and add_wire(None, None) == RequestHistograms().to_wire()


@pytest.mark.parametrize(("bad", "fragment"), [
    ([], "mapping"),
    ({"request": {"counts": [1, 2]}}, "integers"),
    ({"request": {"counts": [-1] * (len(DURATION_BUCKETS_S) + 1)}}, "integers"),
    ({"request": {"counts": [0] * (len(DURATION_BUCKETS_S) + 1), "sum_s": float("inf")}}, "sum_s"),
    ({"queue": "x"}, "mapping"),
])
def test_malformed_wire_is_refused(bad: object, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        RequestHistograms.from_wire(bad)


def test_stage_clock_adds_laps_per_stage_and_commits_one_sample_per_batch() -> None:
    clock = StageClock(("a", "b", "c"), window=4)
    clock.start(time.monotonic_ns() - 5_000_000)  # the batch's first request was taken 5 ms ago
    clock.lap("a")
    clock.lap("b")
    clock.lap("a")  # a stage may be lapped twice in one batch: both laps count
    clock.observe("c", 2_000_000)
    clock.observe("c", -7)  # a negative duration counts as 0
    assert clock.running
    clock.end()
    assert not clock.running and clock.batches == 1
    got = clock.samples_ms()
    assert got["a"][0] >= 5.0 and got["b"][0] >= 0.0 and got["c"][0] == 2.0
    clock.end()  # nothing running: nothing committed
    assert clock.batches == 1


def test_stage_clock_reservoir_keeps_the_last_window_batches_in_order() -> None:
    clock = StageClock(("a",), window=3)
    for ms in (1, 2, 3, 4, 5):
        clock.start()
        clock.observe("a", ms * 1_000_000)
        clock.end()
    clock.start()
    clock.observe("a", 99_000_000)
    clock.cancel()  # a batch that was not served leaves no sample
    assert clock.batches == 5
    assert clock.samples_ms()["a"].tolist() == [3.0, 4.0, 5.0]
    snap = clock.snapshot()
    assert snap["batches"] == 5
    assert snap["a"] == {"p50_ms": 4.0, "p99_ms": 4.98, "mean_ms": 4.0}
    assert json.loads(json.dumps(snap)) == snap


def test_stage_clock_before_any_batch_and_bad_arguments() -> None:
    snap = StageClock().snapshot()
    assert snap["batches"] == 0 and set(snap) == {"batches", *STAGES}
    assert snap["model"] == {"p50_ms": None, "p99_ms": None, "mean_ms": None}
    with pytest.raises(ValueError, match="distinct"):
        StageClock(("a", "a"))
    with pytest.raises(ValueError, match="window"):
        StageClock(window=0)
    clock = StageClock()
    clock.start()
    with pytest.raises(KeyError):
        clock.lap("nope")


@pytest.mark.parametrize("n", [1, 3, 16, 17, 40])
def test_small_batches_count_exactly_as_the_vectorised_path(n: int) -> None:
    rng = np.random.default_rng(n)
    done = 10_000_000_000
    first = done - rng.integers(0, 3_000_000_000, n)  # up to 3 s old, across many buckets
    first[0] = done + 5  # a clock step: a negative duration counts as 0
    fast, ref = RequestHistograms(), RequestHistograms()
    fast.observe_batch(first, start_ns=done - 7_000_000, end_ns=done - 1_000, done_ns=done)
    ref.request.observe((done - first) / 1e9)
    ref.queue.observe((done - 7_000_000 - first) / 1e9)
    ref.compute.observe(np.full(n, (7_000_000 - 1_000) / 1e9))
    for k in ("request", "queue", "compute"):
        a, b = getattr(fast, k), getattr(ref, k)
        assert a.counts.tolist() == b.counts.tolist(), k
        assert a.sum_s == pytest.approx(b.sum_s, rel=1e-12), k


def test_scalar_add_follows_observe_rules() -> None:
    h = DurationHistogram()
    h.add(DURATION_BUCKETS_S[2], count=3)  # on a bound: that bucket
    h.add(math.inf)  # the +Inf bucket, not in the sum
    h.add(-1.0)  # negative: 0
    assert h.counts[2] == 3 and h.counts[-1] == 1 and h.counts[0] == 1
    assert h.sum_s == pytest.approx(3 * DURATION_BUCKETS_S[2])
    with pytest.raises(ValueError, match="NaN"):
        h.add(float("nan"))


@pytest.mark.parametrize("n", [1, 2, 3, 7, 100, 4096])
def test_partition_percentiles_equal_numpy_and_leave_the_input_alone(n: int) -> None:
    rng = np.random.default_rng(n)
    qs = (0, 1, 50, 99, 99.9, 100)
    v = rng.lognormal(0, 1, n)
    before = v.copy()
    np.testing.assert_allclose(percentiles(v, qs), np.percentile(v, qs), rtol=1e-12, atol=0)
    assert np.array_equal(v, before)
    rows = rng.integers(0, 10**7, (5, n))  # integer rows (a stage clock's ns), one series per row
    np.testing.assert_allclose(percentiles(rows, qs), np.percentile(rows, qs, axis=-1).T, rtol=1e-12, atol=0)
    ties = np.full(n, 2.5)
    assert percentiles(ties, (50, 99)).tolist() == [2.5, 2.5]
    with pytest.raises(ValueError, match="empty"):
        percentiles(np.zeros(0), (50,))


def test_reservoir_keeps_the_last_values_in_order_across_wraps() -> None:
    r = Reservoir(5)
    assert len(r) == 0 and r.percentiles((50,)) is None and r.values().size == 0
    with pytest.raises(IndexError):
        r.last()
    r.add(1.0)
    r.extend(np.array([2.0, 3.0]))
    assert r.values().tolist() == [1.0, 2.0, 3.0] and r.last() == 3.0 and r.added == 3
    r.extend([4.0, 5.0, 6.0, 7.0])  # wraps: the two oldest go
    assert r.values().tolist() == [3.0, 4.0, 5.0, 6.0, 7.0] and r.last() == 7.0 and len(r) == 5
    r.add(8.0)
    assert r.values().tolist() == [4.0, 5.0, 6.0, 7.0, 8.0]
    r.extend(np.arange(100, 112, dtype=np.float64))  # more than the ring holds: the newest `size` of them
    assert r.values().tolist() == [107.0, 108.0, 109.0, 110.0, 111.0] and r.last() == 111.0
    r.extend([])
    assert r.added == 20 and len(r) == 5
    assert r.percentiles((50, 100)) == [109.0, 111.0]
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="size"):
            Reservoir(bad)  # type: ignore[arg-type]


def test_reservoir_percentiles_are_numpys_over_the_window() -> None:
    rng = np.random.default_rng(3)
    r = Reservoir(4096)
    seen: list[float] = []
    for _ in range(700):  # batches of 1-12, wrapping the ring a few times
        batch = rng.exponential(3.0, int(rng.integers(1, 13)))
        r.extend(batch)
        seen.extend(batch.tolist())
    window = np.asarray(seen[-4096:])
    assert np.array_equal(r.values(), window)
    np.testing.assert_allclose(r.percentiles((50, 99)), np.percentile(window, (50, 99)), rtol=1e-12)
