"""Adaptive batching: a batch-latency model learnt online and a deadline-aware batch-size policy.

An inference instance asks its `BatchPolicy` how many queued requests to take each time it could start
a batch, and tells it how long each batch took, when requests arrived and when it answered. The policy
takes the largest batch whose predicted latency still lets the oldest request meet its deadline, waits
(up to `max_wait_ms` after the oldest arrived) for a fuller batch only when waiting can pay: another
request is expected while these are held, and a bigger batch is needed to keep up with the arrival
rate (see `BatchPolicy.decide`, rule 4). It also says which requests can no longer meet their deadline
at all (the instance answers those with an explicit DEADLINE_MISSED status instead of running them).

All times are milliseconds; ages and deadlines are relative to a request's arrival. Pure logic, no
clocks and no threads: the caller measures and passes the numbers in. Not thread-safe.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol


def _check_batch(label: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{label} must be an integer >= 1, got {value!r}")
    return value


def _check_ms(label: str, value: object, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{label} must be a finite number of milliseconds, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{label} must be {'> 0' if positive else '>= 0'} ms, got {value!r}")
    return float(value)


def _quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile of `values` with linear interpolation between order statistics (numpy's default)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class LatencyProfile(Protocol):
    """What `LatencyModel.from_profile` needs of a profile (`gpuprims.profile.format.Profile` has it)."""

    @property
    def batch_sizes(self) -> list[int]: ...

    def latency_ms(self, batch_size: float, gpu_pct: float, *, stat: str = ...) -> float: ...


class LatencyModel:
    """Predicts a batch's latency from measured latencies per batch size.

    Per batch size it keeps the last `window` measurements and uses their `quantile` (p90 by
    default: robust to one-off spikes, pessimistic enough for deadlines). A batch size with no
    measurement yet uses its profile value (`profile`, e.g. from a warm-up or a stored profile), if
    any. A caller that passes ``at_s`` to `observe` can `forget` measurements older than a time, so a
spell of slow batches (a neighbour's burst, a process starting beside the instance) stops counting
once it is over instead of after `window` new measurements of each size. The point estimates are then made non-decreasing in batch size (running maximum: a larger
    batch never predicts faster than a smaller one) and, for an unseen batch size b:

    - between two known sizes: linear interpolation;
    - above the largest known size s_m: linear extrapolation with the steeper of the last segment's
      slope and the average slope over all known sizes; with a single known size s, ``t(s) * b / s``
      (no batching gain assumed);
    - below the smallest known size: the smallest size's value.
    """

    def __init__(
        self,
        *,
        window: int = 32,
        quantile: float = 0.9,
        profile: Mapping[int, float] | None = None,
    ) -> None:
        self.window = _check_batch("window", window)
        if isinstance(quantile, bool) or not isinstance(quantile, (int, float)) or not 0 < quantile <= 1:
            raise ValueError(f"quantile must be in (0, 1], got {quantile!r}")
        self.quantile = float(quantile)
        self._samples: dict[int, deque[float]] = {}
        self._times: dict[int, deque[float]] = {}
        self._profile: dict[int, float] = {}
        self._points: list[tuple[int, float]] | None = None
        # No finite measurement time is below this (a lower bound: the window may have pushed the
        # oldest out since), so `forget` is O(1) when there is nothing to forget: an instance calls
        # it before every batch.
        self._oldest = math.inf
        if profile is not None:
            self.seed(profile)

    @classmethod
    def from_profile(
        cls,
        profile: LatencyProfile,
        gpu_pct: int,
        *,
        stat: str = "p99",
        window: int = 32,
        quantile: float = 0.9,
    ) -> LatencyModel:
        """A model seeded with `profile`'s `stat` latency at `gpu_pct` for each profiled batch size.

        The profile raises ValueError if `gpu_pct` lies outside its measured range or `stat` is unknown.
        """
        if isinstance(gpu_pct, bool) or not isinstance(gpu_pct, int) or not 1 <= gpu_pct <= 100:
            raise ValueError(f"gpu_pct must be an integer from 1 to 100, got {gpu_pct!r}")
        seeds = {size: profile.latency_ms(size, gpu_pct, stat=stat) for size in profile.batch_sizes}
        return cls(window=window, quantile=quantile, profile=seeds)

    def seed(self, profile: Mapping[int, float]) -> None:
        """Set prior latencies (ms) per batch size, used for sizes with no measurement yet."""
        if not isinstance(profile, Mapping):
            raise ValueError(f"profile must map batch size to latency_ms, got {profile!r}")
        checked = {
            _check_batch("profile batch size", size): _check_ms(f"profile latency for batch {size}", latency)
            for size, latency in profile.items()
        }
        self._profile.update(checked)
        self._points = None

    def observe(self, batch_size: int, latency_ms: float, *, at_s: float | None = None) -> None:
        """Record that a batch of `batch_size` requests took `latency_ms`, measured at `at_s` (any
        monotonic clock in seconds; `forget` compares against it; none: never forgotten)."""
        _check_batch("batch_size", batch_size)
        latency = _check_ms("latency_ms", latency_ms)
        at = -math.inf if at_s is None else float(at_s)
        if math.isnan(at):
            raise ValueError("at_s must be a time in seconds, got nan")
        self._samples.setdefault(batch_size, deque(maxlen=self.window)).append(latency)
        self._times.setdefault(batch_size, deque(maxlen=self.window)).append(at)
        if -math.inf < at < self._oldest:
            self._oldest = at
        self._points = None

    def forget(self, before_s: float) -> int:
        """Drop the measurements taken before `before_s` (those observed with `at_s`); returns how many.
        A batch size left with none predicts from its profile value or its neighbours again."""
        if not self._oldest < before_s:
            return 0
        dropped = 0
        for size in list(self._times):
            times = self._times[size]
            if not any(-math.inf < t < before_s for t in times):
                continue
            kept = [(t, v) for t, v in zip(times, self._samples[size]) if not -math.inf < t < before_s]
            dropped += len(times) - len(kept)
            if kept:
                self._times[size] = deque((t for t, _ in kept), maxlen=self.window)
                self._samples[size] = deque((v for _, v in kept), maxlen=self.window)
            else:
                del self._samples[size], self._times[size]
        if dropped:
            self._points = None
        self._oldest = min((t for times in self._times.values() for t in times if t > -math.inf), default=math.inf)
        return dropped

    @property
    def known(self) -> bool:
        """True once there is at least one measurement or profile value to predict from."""
        return bool(self._samples or self._profile)

    def samples(self, batch_size: int) -> int:
        """How many measurements of `batch_size` the window currently holds."""
        return len(self._samples.get(_check_batch("batch_size", batch_size), ()))

    def points(self) -> dict[int, float]:
        """The (non-decreasing) latency estimate, ms, for each batch size seen or profiled."""
        return dict(self._curve())

    def _curve(self) -> list[tuple[int, float]]:
        if self._points is None:
            raw = dict(self._profile)
            for size, window in self._samples.items():
                raw[size] = _quantile(window, self.quantile)
            points: list[tuple[int, float]] = []
            running = 0.0
            for size in sorted(raw):
                running = max(running, raw[size])
                points.append((size, running))
            self._points = points
        return self._points

    def predict(self, batch_size: int) -> float:
        """Predicted latency (ms) of a batch of `batch_size` requests.

        Raises ValueError for a bad batch size, and LookupError if nothing was observed or profiled.
        """
        _check_batch("batch_size", batch_size)
        points = self._curve()
        if not points:
            raise LookupError("no batch latency observed or profiled yet")
        first_size, first_ms = points[0]
        if batch_size <= first_size:
            return first_ms
        last_size, last_ms = points[-1]
        if batch_size > last_size:
            if len(points) == 1:
                return last_ms * batch_size / last_size
            prev_size, prev_ms = points[-2]
            slope = max((last_ms - prev_ms) / (last_size - prev_size), (last_ms - first_ms) / (last_size - first_size))
            return last_ms + slope * (batch_size - last_size)
        # first_size < batch_size <= last_size: interpolate on the segment that holds batch_size.
        high = bisect.bisect_left(points, batch_size, key=lambda point: point[0])
        (low_size, low_ms), (high_size, high_ms) = points[high - 1], points[high]
        return low_ms + (high_ms - low_ms) * (batch_size - low_size) / (high_size - low_size)


class BatchDecision(NamedTuple):
    """What to do now: take `take` requests (0: take none yet) and otherwise re-decide within `wait_ms`."""

    take: int
    wait_ms: float


class ArrivalGaps:
    """The recent gap between arrivals (ms), from the last ``window`` arrival times: what tells the
    batching policy whether waiting for a bigger batch will be rewarded by another request."""

    def __init__(self, window: int = 16) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 2:
            raise ValueError(f"window must be an integer >= 2, got {window!r}")
        self.times_ms: deque[float] = deque(maxlen=window)

    def note(self, times_ms: Sequence[float]) -> None:
        """Arrival times (ms, one monotonic clock) of requests just taken, in any order."""
        for t in (times_ms if len(times_ms) == 1 else sorted(times_ms)):  # one at a time: the common case
            t = float(t)
            if not math.isfinite(t):
                raise ValueError(f"arrival times must be finite milliseconds, got {t!r}")
            if self.times_ms and t < self.times_ms[-1]:
                t = self.times_ms[-1]  # taken late, arrived earlier than the last one noted: no gap
            self.times_ms.append(t)

    def mean_gap_ms(self, now_ms: float | None = None) -> float | None:
        """Mean gap over the window, None with fewer than two arrivals. With ``now_ms``, the time since
        the last arrival counts as a gap still open, so a stream that stopped is seen as slow at once."""
        n = len(self.times_ms)
        if n < 2:
            return None
        span = self.times_ms[-1] - self.times_ms[0]
        gaps = n - 1
        if now_ms is not None and now_ms > self.times_ms[-1]:
            open_gap = now_ms - self.times_ms[-1]
            if open_gap > span / gaps:
                span += open_gap
                gaps += 1
        return span / gaps


class HeldArrivals:
    """Which arrivals came while the instance held requests (admitted and not yet answered), and how
    long it held them: what tells a closed-loop client from an open-loop stream.

    A closed-loop client sends its next request only after it has the answer to the last one, so none
    of its requests arrives while its own is held: holding it for a fuller batch waits for a request
    that cannot come. An open-loop stream does not care whether anything is held (a Poisson stream
    arrives at the same rate whatever the instance is doing). So the rate that tells whether a wait can
    be rewarded is not the arrival rate but the rate of arrivals *while requests are held*: the number
    of arrivals that came while something was held over the time something was held, over the last
    ``window`` arrivals. It is learnt from the traffic alone (no setting says "closed loop"): one
    closed-loop client gives none in any time held; open-loop load gives its own rate; one closed-loop
    stream beside open-loop load gives at least the open-loop rate; c closed-loop clients give what the
    other c - 1 send while one is held. The window is of arrivals, so a change of traffic is learnt
    within ``window`` arrivals.

    The caller says what it holds: `note_arrivals` when requests are taken in (with their arrival
    times), `note_answered` after answering (with how many it still holds, so requests answered on
    other paths, such as expiry, never leave a count drifting). An arrival noted only after the answer
    that emptied the instance, but timed before it (it waited in the ring while the batch ran), came
    while the instance held requests: it is counted so, and the held span goes on. Times are ms on one
    monotonic clock. Pure logic, no clocks.
    """

    def __init__(self, window: int = 16) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 2:
            raise ValueError(f"window must be an integer >= 2, got {window!r}")
        self.window = window
        #: The last ``window`` arrivals: (time_ms, whether the instance held requests when it came).
        self.arrivals: deque[tuple[float, bool]] = deque(maxlen=window)
        # Closed held spans (start_ms, end_ms), oldest first: every span that can overlap the window
        # (each starts with an arrival, so at most window + 1 do).
        self._spans: deque[tuple[float, float]] = deque(maxlen=window + 1)
        self._open_ms: float | None = None  # start of the span held now (None: nothing held)
        self._came_held = 0  # arrivals in the window after its first that came while requests were held
        self.held = 0  #: requests the caller holds, as far as it told

    def note_arrivals(self, times_ms: Sequence[float]) -> None:
        """Arrival times (ms) of requests just taken in, in any order; each is held until answered."""
        for t in (times_ms if len(times_ms) == 1 else sorted(times_ms)):
            t = float(t)
            if not math.isfinite(t):
                raise ValueError(f"arrival times must be finite milliseconds, got {t!r}")
            if self._open_ms is not None:
                came_held = True
                self._open_ms = min(self._open_ms, t)
            elif self._spans and t < self._spans[-1][1]:
                # It waited (in the ring) while the last span's batch ran: that span never ended.
                came_held = True
                self._open_ms = self._spans.pop()[0]
            else:
                came_held = False
                self._open_ms = t
            self.held += 1
            if self.arrivals:  # the window's first arrival only marks its start: not counted
                if len(self.arrivals) == self.window:
                    self._came_held -= self.arrivals[1][1]  # the second becomes the first
                self._came_held += came_held
            self.arrivals.append((t, came_held))

    def note_answered(self, at_ms: float, held: int) -> None:
        """The caller answered requests at `at_ms` and now holds `held` (0: everything is answered)."""
        at = float(at_ms)
        if not math.isfinite(at):
            raise ValueError(f"at_ms must be a finite time in milliseconds, got {at_ms!r}")
        if isinstance(held, bool) or not isinstance(held, int) or held < 0:
            raise ValueError(f"held must be an integer >= 0, got {held!r}")
        self.held = held
        if held == 0 and self._open_ms is not None:
            self._spans.append((self._open_ms, max(at, self._open_ms)))
            self._open_ms = None
        elif held > 0 and self._open_ms is None:
            self._open_ms = at  # held requests it was not told of: held from now on

    def held_ms(self, now_ms: float | None = None) -> float:
        """How long (ms) requests were held since the window's first arrival (the span held now counted
        up to `now_ms`, else up to the last arrival)."""
        if not self.arrivals:
            return 0.0
        since = self.arrivals[0][0]
        total = 0.0
        for start, end in reversed(self._spans):
            if end <= since:
                break
            total += end - max(start, since)
        if self._open_ms is not None:
            end = now_ms if now_ms is not None else self.arrivals[-1][0]
            total += max(0.0, end - max(self._open_ms, since))
        return total

    def came_held(self) -> int:
        """How many arrivals of the window (after its first) came while requests were held."""
        return self._came_held

    def mean_gap_ms(self, now_ms: float | None = None) -> float | None:
        """Mean time held between arrivals that came while requests were held: the gap a held request
        can expect before another one comes. ``inf`` when none came (a closed loop of one client);
        None while fewer than two arrivals are known."""
        if len(self.arrivals) < 2:
            return None
        if self._came_held == 0:
            return math.inf
        return self.held_ms(now_ms) / self._came_held


class BatchPolicy:
    """Deadline-aware adaptive batch size for one instance.

    `max_batch` bounds a batch; `max_wait_ms` bounds how long after its arrival the oldest queued
    request may be held back to grow a batch; `slo_ms` is the latency target of every request (its
    deadline relative to arrival, unless a request carries its own); `margin_ms` is added to every
    predicted latency for work outside the model (gather, response). `model` defaults to an empty
    `LatencyModel`; seed it with a profile or a warm-up (`gpuprims.device.warm_up`).

    The caller tells it what happens: `observe` each batch's latency, `note_arrivals` the requests it
    takes in and `note_answered` what it still holds after answering. From the last two it learns
    whether a wait for a fuller batch can be rewarded (`wait_pays`): not for a client that waits for
    each answer before it sends again, whatever `max_wait_ms` allows.
    """

    def __init__(
        self,
        max_batch: int,
        max_wait_ms: float,
        slo_ms: float,
        *,
        model: LatencyModel | None = None,
        margin_ms: float = 0.0,
    ) -> None:
        self.max_batch = _check_batch("max_batch", max_batch)
        self.max_wait_ms = _check_ms("max_wait_ms", max_wait_ms)
        self.slo_ms = _check_ms("slo_ms", slo_ms, positive=True)
        self.margin_ms = _check_ms("margin_ms", margin_ms)
        if model is not None and not isinstance(model, LatencyModel):
            raise ValueError(f"model must be a LatencyModel, got {type(model).__name__}")
        self.model = model if model is not None else LatencyModel()
        self.arrivals = ArrivalGaps()
        self.held = HeldArrivals()

    def note_arrivals(self, times_ms: Sequence[float], *, queries_ms: Sequence[float] | None = None) -> None:
        """Arrival times (ms, monotonic) of requests just queued (held until `note_answered` says they
        are not): rule 4 of `decide` learns from them whether a wait for a bigger batch can pay.

        ``queries_ms``: the arrival times of the queries these requests end, when some are samples of a
        MultiStream query (wire ``FLAG_MORE``): such a query counts once, at its last sample, for what
        arrives while requests are held (`HeldArrivals`), so its own samples, sent together, do not make
        a closed-loop MultiStream client look like open-loop load. Default: every request is a query."""
        self.arrivals.note(times_ms)
        self.held.note_arrivals(times_ms if queries_ms is None else queries_ms)

    def note_answered(self, at_ms: float, held: int) -> None:
        """The caller answered requests at `at_ms` (ms, the clock of `note_arrivals`) and now holds
        `held` of those it was told of (0: all answered): what tells rule 4 of `decide` whether
        requests arrive while others are held, or only after their answers (a closed loop)."""
        self.held.note_answered(at_ms, held)

    def observe(self, batch_size: int, latency_ms: float) -> None:
        """Record a measured batch latency (see `LatencyModel.observe`)."""
        self.model.observe(batch_size, latency_ms)

    def predict(self, batch_size: int) -> float:
        """Predicted time (ms) from starting a batch of `batch_size` to its responses, margin included."""
        return self.model.predict(batch_size) + self.margin_ms

    def decide(self, queue_len: int, oldest_age_ms: float, *, slack_ms: float | None = None,
               now_ms: float | None = None, more: bool = False) -> BatchDecision:
        """Decide how many of `queue_len` queued requests to start now.

        `oldest_age_ms` is how long the oldest queued request has waited; its time left is
        ``slo_ms - oldest_age_ms`` unless `slack_ms` (the least time left among the requests at the
        head of the queue, for requests with their own deadlines) is given. Rules:

        1. Empty queue: take nothing and wait for arrivals (``wait_ms`` is `max_wait_ms`).
        2. No latency known yet: take 1, so the first measurement comes quickly.
        3. Take the largest b <= min(queue_len, max_batch) whose predicted latency fits the time left.
        4. But if all queued requests fit, the queue is shorter than `max_batch`, the oldest has waited
           less than `max_wait_ms`, even one more request would still fit, *and the wait can pay*,
           take nothing yet and re-decide within ``wait_ms`` = the smaller of the wait left and the
           slack over that larger batch (or sooner, when a request arrives). `max_wait_ms` is a
           ceiling, not a target. The wait pays only when both hold (`wait_pays`):

           a. a bigger batch is needed to keep up: at the arrival rate (`note_arrivals`, the gap still
              open at `now_ms` counted), batches of the queue's size served back to back, each taking
              its predicted latency, would fall behind (``predict(n) > n * mean gap``). Otherwise
              sending now loses no throughput, and whatever queues meanwhile forms the next batch;
           b. another request is expected within the wait *while these are held*: the mean gap
              between arrivals that came while requests were held (`HeldArrivals`, told by
              `note_arrivals` and `note_answered`) is shorter than the wait. A closed-loop client
              never sends while its request is held, so its gap is infinite and it is served at once;
              open-loop load arrives whatever is held, so it waits as before.

           Until two arrivals are known it waits (the first requests teach the policy the traffic).

           `more` (the newest queued request says more of its query follow at once: a MultiStream
           query of several samples, ``Client.infer_many`` or an OIP request of several rows, wire
           ``FLAG_MORE``) makes the wait pay without a or b: the rest of the query is on its way, and
           serving its first samples alone would run the engine several times for one answer. The
           other bounds stay (`max_wait_ms` after the oldest arrived, the deadline of a batch one
           larger, `max_batch`), so a query whose last request is lost waits no longer than any wait.
        5. If not even one request fits (its deadline is lost anyway), take min(queue_len, max_batch)
           to drain the backlog fastest; `expired` tells which requests to answer as missed instead.
        """
        if isinstance(queue_len, bool) or not isinstance(queue_len, int) or queue_len < 0:
            raise ValueError(f"queue_len must be an integer >= 0, got {queue_len!r}")
        age = _check_ms("oldest_age_ms", oldest_age_ms)
        if slack_ms is not None and (
            isinstance(slack_ms, bool) or not isinstance(slack_ms, (int, float)) or not math.isfinite(slack_ms)
        ):
            raise ValueError(f"slack_ms must be a finite number of milliseconds or None, got {slack_ms!r}")
        if queue_len == 0:
            return BatchDecision(0, self.max_wait_ms)
        if not self.model.known:
            return BatchDecision(1, 0.0)
        left_ms = (self.slo_ms - age) if slack_ms is None else float(slack_ms)
        cap = min(queue_len, self.max_batch)
        fit = 0
        for size in range(cap, 0, -1):
            if self.predict(size) <= left_ms:
                fit = size
                break
        if fit == 0:
            return BatchDecision(cap, 0.0)
        if fit == cap and cap < self.max_batch and age < self.max_wait_ms:
            room_ms = left_ms - self.predict(cap + 1)
            wait_ms = min(self.max_wait_ms - age, room_ms)
            if room_ms > 0 and (more or self.wait_pays(cap, wait_ms, now_ms=now_ms)):
                return BatchDecision(0, wait_ms)
        return BatchDecision(fit, 0.0)

    def wait_pays(self, queued: int, wait_ms: float, *, now_ms: float | None = None) -> bool:
        """Whether holding `queued` requests up to `wait_ms` for a fuller batch can pay (rule 4 of
        `decide`, a and b): a bigger batch is needed to keep up with the arrival rate, and another
        request is expected within the wait while these are held. True while fewer than two arrivals
        are known."""
        gap_ms = self.arrivals.mean_gap_ms(now_ms)
        if gap_ms is None:
            return True
        if self.predict(queued) <= queued * gap_ms:
            return False  # batches of this size keep up: a wait would only add latency
        held_gap_ms = self.held.mean_gap_ms(now_ms)
        return held_gap_ms is None or held_gap_ms < wait_ms

    def early_drop(self, ages_ms: Sequence[float], deadlines_ms: Sequence[float | None] | None = None) -> int:
        """How many requests at the head of a backlog to give up on so that a full batch behind them
        meets its deadline (0: none). ``ages_ms`` are the queued requests' ages, oldest first
        (``deadlines_ms`` their own deadlines, default `slo_ms`).

        The largest batch the oldest request's deadline allows can be small when a backlog has built
        up; serving such small batches one after another lets every later request age too, and the
        instance then runs at the throughput of its smallest batches (measured: batches of 1 at
        about half the capacity, bench/overlap after a switch, bench/peer above capacity). So when at
        least a full batch (`max_batch`) waits behind the head and serving the head's batch first would
        make the next full batch miss, the head requests up to the first one a full batch can still
        serve in time are given up on (answered DEADLINE_MISSED by the caller): fewer misses than
        letting the whole backlog age. Returns 0 when no latency is known yet.
        """
        n = len(ages_ms)
        if deadlines_ms is not None and len(deadlines_ms) != n:
            raise ValueError(f"deadlines_ms has {len(deadlines_ms)} entries but ages_ms has {n}")
        if n <= self.max_batch or not self.model.known:
            return 0
        deadlines = [self.slo_ms if d is None else float(d) for d in (deadlines_ms or [None] * n)]
        ages = [_check_ms("age_ms", a) for a in ages_ms]
        full_ms = self.predict(self.max_batch)
        left0 = deadlines[0] - ages[0]
        fit = 0
        for size in range(self.max_batch, 0, -1):
            if self.predict(size) <= left0:
                fit = size
                break
        if fit == 0 or fit >= self.max_batch:
            return 0  # nothing fits at all (expiry's business), or a full batch does
        # Serving the head's batch first: does the full batch right behind it still make it?
        nxt = fit
        if ages[nxt] + self.predict(fit) + full_ms <= deadlines[nxt]:
            return 0
        for k in range(1, n - self.max_batch + 1):
            if ages[k] + full_ms <= deadlines[k]:
                return k
        return 0

    def choose(self, queue_len: int, oldest_age_ms: float, *, slack_ms: float | None = None) -> int | None:
        """How many requests to take now, or None to wait (see `decide` for the rules and `wait_ms`)."""
        take = self.decide(queue_len, oldest_age_ms, slack_ms=slack_ms).take
        return take or None

    def wait_ms(self, queue_len: int, oldest_age_ms: float, *, slack_ms: float | None = None) -> float:
        """How long (ms) the caller may wait for arrivals before deciding again; 0 when it should take now."""
        return self.decide(queue_len, oldest_age_ms, slack_ms=slack_ms).wait_ms

    def expired(self, age_ms: float, deadline_ms: float | None = None) -> bool:
        """True if a request of age `age_ms` cannot meet its deadline even as a batch of one.

        `deadline_ms` (relative to arrival) defaults to `slo_ms`. Before any latency is known only a
        request already past its deadline counts as expired.
        """
        age = _check_ms("age_ms", age_ms)
        deadline = self.slo_ms if deadline_ms is None else _check_ms("deadline_ms", deadline_ms)
        needed_ms = self.predict(1) if self.model.known else 0.0
        return age + needed_ms > deadline or age >= deadline

    def expired_indices(
        self, ages_ms: Sequence[float], deadlines_ms: Sequence[float | None] | None = None
    ) -> list[int]:
        """Indices (ascending) of the requests in `ages_ms` that `expired` says cannot make it."""
        if deadlines_ms is not None and len(deadlines_ms) != len(ages_ms):
            raise ValueError(
                f"deadlines_ms has {len(deadlines_ms)} entries but ages_ms has {len(ages_ms)}"
            )
        deadlines = deadlines_ms if deadlines_ms is not None else [None] * len(ages_ms)
        return [i for i, (age, deadline) in enumerate(zip(ages_ms, deadlines)) if self.expired(age, deadline)]
