"""Duration histograms an inference instance keeps and ships in its heartbeat.

Prometheus histograms (``_bucket``/``_sum``/``_count``) need every request's duration, which a
latency reservoir does not keep. `RequestHistograms` counts each answered request's durations into
fixed buckets (`DURATION_BUCKETS_S`, the same for every instance, so the orchestrator adds them up
exactly): the whole request (first datagram to answer sent), its time queued (to the start of the
batch that served it) and its batch's compute time. Counts are cumulative since the instance
started, so a lost heartbeat loses nothing; `to_wire` is the plain-JSON form for ``Heartbeat.stats``
and `add_wire` adds one such form into another (the orchestrator sums live instances with the ones
that are gone, so an app's series never go backwards).

An instance does, once per answered batch::

    self.stats.hist.observe_answered(info["first_ns"], compute_s=model_ms / 1e3, done_ns=done_ns)

and puts ``"hist": self.stats.hist.to_wire()`` into its heartbeat.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["DURATION_BOUNDS_S", "DURATION_BUCKETS_S", "HISTOGRAMS", "STAGES", "DurationHistogram", "RequestHistograms", "Reservoir",
           "StageClock", "add_wire", "percentiles"]

#: Upper bounds (seconds) of the duration buckets; a last, implicit bucket is +Inf.
DURATION_BUCKETS_S: tuple[float, ...] = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
)
#: The same bounds as a read-only float64 array (what the serving loop's native answer counts over).
DURATION_BOUNDS_S = np.array(DURATION_BUCKETS_S, dtype=np.float64)
DURATION_BOUNDS_S.flags.writeable = False
#: The histograms of one instance, by wire key.
HISTOGRAMS = ("request", "queue", "compute")
#: Up to this many durations at once are counted one by one in Python: an instance's batch is small,
#: and a handful of scalar updates costs far less than a dozen numpy calls on a core whose caches the
#: model has just filled (bench/stage_cost).
_SMALL = 16


def percentiles(values: np.ndarray, qs: Sequence[float], *, overwrite: bool = False) -> np.ndarray:
    """``np.percentile(values, qs, axis=-1)`` (linear interpolation) by one partition, no sort; the
    result has the percentiles on the last axis (shape ``values.shape[:-1] + (len(qs),)``).

    The heartbeat's percentiles are taken on the serving thread between two batches, where
    ``np.percentile`` spends most of its time in Python-level checks and converting its input. Same
    figures (to rounding), a fraction of the time on a few thousand values (bench/stage_cost
    ``heartbeat``). `values` must not be empty along its last axis; with ``overwrite`` it is
    partitioned in place (pass a copy you own), else it is left as it was.
    """
    n = values.shape[-1]
    if n == 0:
        raise ValueError("percentiles of an empty series")
    # Positions in Python: on a few values each numpy call costs more than the arithmetic it does.
    pos = [float(q) * (n - 1) / 100.0 for q in qs]
    lo = [math.floor(p) for p in pos]
    hi = [min(k + 1, n - 1) for k in lo]
    part = values if overwrite else values.copy()
    part.partition(sorted({*lo, *hi}), axis=-1)
    if part.ndim == 1:
        return np.array([float(part[a]) + (float(part[b]) - float(part[a])) * (p - a)
                         for p, a, b in zip(pos, lo, hi)])
    low, high = part[..., lo], part[..., hi]
    return low + (high - low) * np.array([p - a for p, a in zip(pos, lo)])


class Reservoir:
    """The last `size` values of a series in a preallocated numpy ring, with cheap percentiles.

    Replaces a ``deque`` of floats for the heartbeat's latency window: adding a batch's values is one
    slice assignment, and `percentiles` partitions one copy of the ring instead of converting every
    element of a deque (bench/stage_cost ``heartbeat``). Not thread-safe.
    """

    __slots__ = ("_buf", "_count", "_next", "added")

    def __init__(self, size: int) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be an integer >= 1, got {size!r}")
        self._buf = np.zeros(size, np.float64)
        self._next = 0
        self._count = 0
        self.added = 0  # values ever added: unchanged means the percentiles are too

    def __len__(self) -> int:
        return self._count

    @property
    def size(self) -> int:
        return self._buf.size

    def add(self, value: float) -> None:
        """Add one value (the oldest goes once the ring is full)."""
        self._buf[self._next] = value
        self._next = (self._next + 1) % self._buf.size
        self._count = min(self._count + 1, self._buf.size)
        self.added += 1

    def extend(self, values: np.ndarray | Sequence[float]) -> None:
        """Add values in order (a batch's latencies)."""
        v = np.asarray(values, dtype=np.float64).reshape(-1)
        n, size = v.size, self._buf.size
        self.added += n
        if n >= size:
            self._buf[:] = v[n - size:]
            self._next, self._count = 0, size
            return
        end = self._next + n
        if end <= size:
            self._buf[self._next:end] = v
        else:
            k = size - self._next
            self._buf[self._next:] = v[:k]
            self._buf[:n - k] = v[k:]
        self._next = end % size
        self._count = min(self._count + n, size)

    def last(self) -> float:
        """The newest value (IndexError when empty)."""
        if not self._count:
            raise IndexError("the reservoir is empty")
        return float(self._buf[self._next - 1])

    def values(self) -> np.ndarray:
        """A copy of the values held, oldest first."""
        if self._count < self._buf.size:
            return self._buf[:self._count].copy()
        return np.concatenate((self._buf[self._next:], self._buf[:self._next]))

    def percentiles(self, qs: Sequence[float]) -> list[float] | None:
        """The `qs` percentiles (0-100, linear interpolation) of the values held; None when empty."""
        if not self._count:
            return None
        return percentiles(self._buf[:self._count].copy(), qs, overwrite=True).tolist()


class DurationHistogram:
    """Counts of durations (seconds) per bucket of `DURATION_BUCKETS_S` (+Inf last), their sum."""

    __slots__ = ("counts", "sum_s")

    def __init__(self) -> None:
        self.counts = np.zeros(len(DURATION_BUCKETS_S) + 1, np.int64)
        self.sum_s = 0.0

    @property
    def count(self) -> int:
        return int(self.counts.sum())

    def observe(self, seconds: float | Sequence[float] | np.ndarray) -> None:
        """Add one duration or an array of them; negative values count as 0, NaN is refused."""
        v = np.maximum(np.asarray(seconds, dtype=np.float64).reshape(-1), 0.0)
        if v.size == 0:
            return
        if np.isnan(v).any():
            raise ValueError("durations must not be NaN")
        idx = np.searchsorted(np.asarray(DURATION_BUCKETS_S), v, side="left")
        self.counts += np.bincount(idx, minlength=self.counts.size)
        self.sum_s += float(v[np.isfinite(v)].sum())

    def add(self, seconds: float, count: int = 1) -> None:
        """Add `count` observations of one duration (the scalar form of `observe`, same rules)."""
        v = float(seconds)
        if v != v:
            raise ValueError("durations must not be NaN")
        v = max(v, 0.0)
        self.counts[bisect.bisect_left(DURATION_BUCKETS_S, v)] += count
        if v != math.inf:
            self.sum_s += v * count

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= bound) for every bucket, ending with (inf, count)."""
        cum = np.cumsum(self.counts)
        return [(b, int(c)) for b, c in zip((*DURATION_BUCKETS_S, math.inf), cum)]

    def to_wire(self) -> dict[str, Any]:
        """``{"counts": [per bucket, +Inf last], "sum_s": total}`` (plain JSON)."""
        return {"counts": [int(c) for c in self.counts], "sum_s": self.sum_s}

    @classmethod
    def from_wire(cls, d: Any) -> DurationHistogram:
        """Rebuild from `to_wire` output; ValueError says what is wrong."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a histogram must be a mapping, got {type(d).__name__}")
        counts = d.get("counts")
        if not isinstance(counts, list) or len(counts) != len(DURATION_BUCKETS_S) + 1 or not all(
                isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
            raise ValueError(f"histogram counts must be {len(DURATION_BUCKETS_S) + 1} integers >= 0, got {counts!r}")
        s = d.get("sum_s", 0.0)
        if isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s) or s < 0:
            raise ValueError(f"histogram sum_s must be a finite number >= 0, got {s!r}")
        h = cls()
        h.counts = np.asarray(counts, np.int64)
        h.sum_s = float(s)
        return h

    def merge(self, other: DurationHistogram) -> None:
        self.counts += other.counts
        self.sum_s += other.sum_s


class RequestHistograms:
    """The request, queue and compute duration histograms of one instance."""

    def __init__(self) -> None:
        self.request = DurationHistogram()
        self.queue = DurationHistogram()
        self.compute = DurationHistogram()

    def observe_batch(self, first_ns: np.ndarray | Sequence[int], *, start_ns: int, end_ns: int,
                      done_ns: int) -> None:
        """One answered batch: each request arrived at ``first_ns`` (CLOCK_MONOTONIC ns, as the pool's
        records hold it), the batch computed from ``start_ns`` to ``end_ns`` and was answered at
        ``done_ns``. Every request observes the batch's compute time (as Triton counts it)."""
        first = np.asarray(first_ns, dtype=np.int64).reshape(-1)
        if first.size == 0:
            return
        if not start_ns <= end_ns <= done_ns:
            raise ValueError(f"need start_ns <= end_ns <= done_ns, got {start_ns}, {end_ns}, {done_ns}")
        if first.size <= _SMALL:
            for f in first.tolist():
                self.request.add((done_ns - f) / 1e9)
                self.queue.add((start_ns - f) / 1e9)
            self.compute.add((end_ns - start_ns) / 1e9, first.size)
            return
        self.request.observe((done_ns - first) / 1e9)
        self.queue.observe((start_ns - first) / 1e9)
        self.compute.observe(np.full(first.size, (end_ns - start_ns) / 1e9))

    def observe_answered(self, first_ns: np.ndarray | Sequence[int], *, compute_s: float, done_ns: int) -> None:
        """`observe_batch` for a batch answered at ``done_ns`` after ``compute_s`` seconds of compute
        that ended just before the answers went out (what an instance measures with perf_counter)."""
        compute_ns = max(0, round(compute_s * 1e9))
        self.observe_batch(first_ns, start_ns=done_ns - compute_ns, end_ns=done_ns, done_ns=done_ns)

    def to_wire(self) -> dict[str, Any]:
        """The heartbeat form: ``{"request": {...}, "queue": {...}, "compute": {...}}``."""
        return {k: getattr(self, k).to_wire() for k in HISTOGRAMS}

    @classmethod
    def from_wire(cls, d: Any) -> RequestHistograms:
        """Rebuild from `to_wire` output (a missing histogram is empty); ValueError says what is wrong."""
        if not isinstance(d, Mapping):
            raise ValueError(f"histograms must be a mapping, got {type(d).__name__}")
        h = cls()
        for k in HISTOGRAMS:
            if k in d:
                setattr(h, k, DurationHistogram.from_wire(d[k]))
        return h

    def merge(self, other: RequestHistograms) -> None:
        for k in HISTOGRAMS:
            getattr(self, k).merge(getattr(other, k))


def add_wire(into: Mapping[str, Any] | None, other: Mapping[str, Any] | None) -> dict[str, Any]:
    """The wire form of ``into`` plus ``other`` (either may be None or empty); malformed input raises
    ValueError."""
    h = RequestHistograms.from_wire(into or {})
    h.merge(RequestHistograms.from_wire(other or {}))
    return h.to_wire()


#: The stages of an instance's per-batch path, in order, as `StageClock` reports them.
#: ``reassembly``: first datagram at the ingest to the request complete (oldest request of the batch);
#: ``delivery``: complete to the instance taking it off its ring (ring hand-off and wake-up);
#: ``wait``: taken to the start of the gather (expiry, the batching decision, any batching wait);
#: ``gather``, ``preprocess``, ``model``: the seams of the data path; ``respond``: the logits to
#: numpy plus the answer seam (responses sent and records released).
STAGES: tuple[str, ...] = ("reassembly", "delivery", "wait", "gather", "preprocess", "model", "respond")


class StageClock:
    """Per-batch stage durations on CLOCK_MONOTONIC, cheap enough to leave on in the serving loop.

    A batch is ``start()``-ed when its first request is taken (``start_ns`` defaults to now), each
    stage is closed with ``lap(stage)`` (the time since the previous mark, added to that stage: a
    stage may be lapped several times in one batch), ``observe(stage, ns)`` adds a duration measured
    elsewhere, and ``end()`` commits the batch: one sample per stage (0 for a stage the batch did not
    go through) into a bounded reservoir of the last `window` batches. Costs two clock reads and a
    list update per lap; percentiles are computed only by `snapshot`. Not thread-safe.

    `clock` is the time source in ns (CLOCK_MONOTONIC, the pool's clock; a benchmark may pass
    ``time.thread_time_ns`` to see the CPU time of each stage, where durations observed from the
    pool's timestamps mean nothing).
    """

    __slots__ = ("_clock", "_cur", "_index", "_last_ns", "_samples", "batches", "running", "stages", "start_ns",
                 "window")

    def __init__(self, stages: Sequence[str] = STAGES, window: int = 1024,
                 clock: Callable[[], int] = time.monotonic_ns) -> None:
        if not stages or len(set(stages)) != len(stages):
            raise ValueError(f"stages must be distinct names, got {stages!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
        self.stages = tuple(stages)
        self.window = window
        self._clock = clock
        self._index = {s: i for i, s in enumerate(self.stages)}
        self._samples = np.zeros((window, len(self.stages)), np.int64)
        self._cur = [0] * len(self.stages)
        self.batches = 0  # committed since creation (the reservoir holds the last `window`)
        self.running = False
        self.start_ns = 0
        self._last_ns = 0

    def start(self, start_ns: int | None = None) -> None:
        """Begin a batch (a batch already running is dropped uncommitted)."""
        now = self._clock() if start_ns is None else int(start_ns)
        self._cur = [0] * len(self.stages)
        self.start_ns = self._last_ns = now
        self.running = True

    def lap(self, stage: str) -> None:
        """Add the time since the previous mark to `stage` (KeyError for an unknown stage)."""
        now = self._clock()
        self._cur[self._index[stage]] += now - self._last_ns
        self._last_ns = now

    def observe(self, stage: str, ns: int) -> None:
        """Add a duration measured elsewhere to `stage` (negative durations count as 0)."""
        self._cur[self._index[stage]] += max(0, int(ns))

    def cancel(self) -> None:
        """Drop the running batch uncommitted (it was not served: all its requests failed)."""
        self.running = False

    def end(self) -> None:
        """Commit the running batch (nothing happens if none runs)."""
        if not self.running:
            return
        self._samples[self.batches % self.window] = self._cur
        self.batches += 1
        self.running = False

    def samples_ms(self) -> dict[str, np.ndarray]:
        """The reservoir, per stage, in ms (oldest first)."""
        n = min(self.batches, self.window)
        rows = np.roll(self._samples, -(self.batches % self.window), axis=0)[-n:] if n else self._samples[:0]
        return {s: rows[:, i] / 1e6 for i, s in enumerate(self.stages)}

    def snapshot(self) -> dict[str, Any]:
        """``{"batches": n, "<stage>": {"p50_ms", "p99_ms", "mean_ms"}, ...}`` over the reservoir
        (plain JSON; the stage figures are None before the first batch)."""
        out: dict[str, Any] = {"batches": self.batches}
        n = min(self.batches, self.window)
        if not n:
            return {**out, **{s: {"p50_ms": None, "p99_ms": None, "mean_ms": None} for s in self.stages}}
        # One row per stage (order does not matter here), partitioned in place: the heartbeat takes this
        # on the serving thread, so it must cost tens of microseconds, not hundreds (bench/stage_cost).
        cols = np.array(self._samples[:n].T, dtype=np.float64, order="C")
        pct = percentiles(cols, (50, 99), overwrite=True) / 1e6
        p50, p99 = pct[:, 0].tolist(), pct[:, 1].tolist()
        mean = (cols.sum(axis=1) / (n * 1e6)).tolist()
        for i, s in enumerate(self.stages):
            out[s] = {"p50_ms": round(p50[i], 4), "p99_ms": round(p99[i], 4), "mean_ms": round(mean[i], 4)}
        return out
