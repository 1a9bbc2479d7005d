"""Discrete-event simulation of one or many GPUs driven by profiles, arrivals and a real scheduler.

The simulator drives the same ``Scheduler`` classes the orchestrator runs live: it keeps one FIFO
queue of request deadlines per app stage, calls ``plan`` whenever a run completes, a queue turns
non-empty or the scheduler's wakeup comes, applies the dispatches in order, and reports each run's
simulated execution time back through ``completed``. It leaves out the calls that provably change
nothing: ``plan`` after an arrival that cannot start (``can_start``) or after completions on GPUs
with nothing queued where the scheduler says such a plan is a no-op (``Scheduler._quiet``), and
``next_wakeup_ms`` while the scheduler's answer cannot have changed (``_wake_version``). The
reported ``plans`` counts the calls made.

Execution model (stated, not measured): a run of ``batch`` requests of ``model`` at ``gpu_pct``
takes the profile's p50 latency there, times an optional per-model ``true_scale`` (to model a
profile that is off, which the scheduler must learn) and an optional log-normal jitter. Runs that
share a GPU do not slow each other (controlled spatial sharing isolates them, paper IV-B); the
simulator refuses any dispatch that would take a GPU above 100%.

Every result dict carries ``"simulated": True``. Requests are counted when they arrive inside
``[warmup_ms, duration_ms)``; a request meets its deadline when its last stage ends at or before
``arrival + app.deadline_ms``. ``throughput_rps`` counts requests that met their deadline (goodput);
``miss_rate`` is 1 - met/offered, so it includes rejected, late and unfinished requests.
"""

from __future__ import annotations

import bisect
import gc
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from multiprocessing import get_context
from typing import Any, Literal

import numpy as np
import numpy.ma  # np.percentile loads it on first use: once here, not inside the first (timed) run
import numpy.random  # numpy loads it lazily otherwise, in the first run

from gpuprims.profile.format import Profile
from gpuprims.sched.dag import App
from gpuprims.sched.scheduler import Dispatch, Scheduler, make_scheduler

_EPS = 1e-9


@dataclass(frozen=True)
class Arrival:
    """An arrival process: ``poisson`` at ``rate_rps``, or ``constant``: ``burst`` requests at once
    every ``burst / rate_rps`` seconds starting at ``offset_ms`` (e.g. synchronised camera frames)."""

    kind: Literal["poisson", "constant"]
    rate_rps: float
    burst: int = 1
    offset_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("poisson", "constant"):
            raise ValueError(f"arrival kind must be 'poisson' or 'constant', got {self.kind!r}")
        if not self.rate_rps > 0 or not math.isfinite(self.rate_rps):
            raise ValueError(f"rate_rps must be a positive finite number, got {self.rate_rps}")
        if self.burst < 1:
            raise ValueError(f"burst must be >= 1, got {self.burst}")
        if self.kind == "poisson" and self.burst != 1:
            raise ValueError(f"burst applies to constant arrivals only, got burst={self.burst} for poisson")
        if not self.offset_ms >= 0:
            raise ValueError(f"offset_ms must be >= 0, got {self.offset_ms}")

    def times_ms(self, duration_ms: float, rng: np.random.Generator) -> np.ndarray:
        """Sorted arrival times in [offset_ms, duration_ms)."""
        span = duration_ms - self.offset_ms
        if span <= 0:
            return np.empty(0)
        if self.kind == "constant":
            period_ms = 1000.0 * self.burst / self.rate_rps
            starts = self.offset_ms + period_ms * np.arange(math.ceil(span / period_ms))
            starts = starts[starts < duration_ms]
            return np.repeat(starts, self.burst)
        mean_gap_ms = 1000.0 / self.rate_rps
        n = int(span / mean_gap_ms * 1.1 + 10 * math.sqrt(span / mean_gap_ms) + 10)
        t = self.offset_ms + np.cumsum(rng.exponential(mean_gap_ms, n))
        while t[-1] < duration_ms:
            t = np.concatenate([t, t[-1] + np.cumsum(rng.exponential(mean_gap_ms, n))])
        return t[t < duration_ms]


@dataclass(frozen=True)
class Workload:
    """An app, its arrivals and the label probabilities of its routing stages.

    ``route_probs[stage][label]`` is the probability that a request leaving ``stage`` carries
    ``label``; the remaining probability (and any label the stage does not route) ends the request.
    """
    app: App
    arrival: Arrival
    route_probs: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for stage, probs in self.route_probs.items():
            self.app.stage(stage)
            total = sum(probs.values())
            if any(p < 0 for p in probs.values()) or total > 1 + 1e-9:
                raise ValueError(f"app {self.app.name!r} stage {stage!r}: route probabilities must be >= 0 "
                                 f"and sum to at most 1, got {dict(probs)}")


@dataclass
class _AppStats:
    offered: int = 0
    met: int = 0
    late: int = 0
    rejected: int = 0
    latencies: list[float] = field(default_factory=list)
    entry_batches: list[int] = field(default_factory=list)


def simulate(scheduler: Scheduler, workloads: Sequence[Workload], *, duration_ms: float,
             warmup_ms: float = 0.0, seed: int = 0, jitter_sigma: float = 0.0,
             true_scale: Mapping[str, float] | None = None, record_dispatches: bool = False,
             drain_ms: float | None = None) -> dict[str, Any]:
    """Run the workloads through ``scheduler`` for ``duration_ms`` of simulated time; see module doc.

    Arrivals stop at ``duration_ms``; the simulation then drains for up to ``drain_ms`` (default:
    four times the largest app deadline). Raises ValueError when the workloads do not match the
    scheduler's apps or an argument is out of range, and RuntimeError if the scheduler ever takes a
    GPU above 100% or starts a run on a busy stage instance.
    """
    scale, drain = _check_args(scheduler, workloads, duration_ms, warmup_ms, jitter_sigma, true_scale, drain_ms)
    wall0 = time.perf_counter()
    raw = _simulate(scheduler, workloads, duration_ms=duration_ms, warmup_ms=warmup_ms, seed=seed,
                    jitter_sigma=jitter_sigma, scale=scale, record_dispatches=record_dispatches, drain=drain)
    return _report([raw], scheduler_name=scheduler.name, num_gpus=scheduler.num_gpus, duration_ms=duration_ms,
                   warmup_ms=warmup_ms, seed=seed, wall_s=time.perf_counter() - wall0)


def _check_args(scheduler: Scheduler, workloads: Sequence[Workload], duration_ms: float, warmup_ms: float,
                jitter_sigma: float, true_scale: Mapping[str, float] | None,
                drain_ms: float | None) -> tuple[dict[str, float], float]:
    """Validate simulation arguments; returns (true_scale as a dict, drain in ms)."""
    if not duration_ms > 0:
        raise ValueError(f"duration_ms must be > 0, got {duration_ms}")
    if not 0 <= warmup_ms < duration_ms:
        raise ValueError(f"warmup_ms must be in [0, duration_ms), got {warmup_ms}")
    if jitter_sigma < 0:
        raise ValueError(f"jitter_sigma must be >= 0, got {jitter_sigma}")
    scale = dict(true_scale or {})
    for m, v in scale.items():
        if not v > 0:
            raise ValueError(f"true_scale for {m!r} must be > 0, got {v}")
    names = [w.app.name for w in workloads]
    if sorted(names) != sorted(scheduler.apps) or len(set(names)) != len(names):
        raise ValueError(f"workloads cover apps {sorted(names)} but the scheduler has {sorted(scheduler.apps)}")
    for w in workloads:
        if w.app != scheduler.apps[w.app.name]:
            raise ValueError(f"workload app {w.app.name!r} differs from the scheduler's app of that name")
    drain = 4 * max(w.app.deadline_ms for w in workloads) if drain_ms is None else drain_ms
    if drain < 0:
        raise ValueError(f"drain_ms must be >= 0, got {drain}")
    return scale, drain


class _Uniforms:
    """The routing draws, ``n`` at a time in the order the completions ask. Where nothing else draws
    from ``rng`` meanwhile (no jitter), the same numbers are drawn from the stream in blocks
    (``Generator.random`` fills in stream order); otherwise each call draws its own."""

    def __init__(self, rng: np.random.Generator, *, in_blocks: bool) -> None:
        self.rng = rng
        self.in_blocks = in_blocks
        self.block: list[float] = []
        self.used = 0

    def __call__(self, n: int) -> list[float]:
        if not self.in_blocks:
            return self.rng.random(n).tolist()
        used = self.used
        if used + n > len(self.block):
            self.block = self.block[used:] + self.rng.random(max(4096, n)).tolist()
            used = 0
        self.used = used + n
        return self.block[used:used + n]


@dataclass
class _Raw:
    """What one simulation (or one shard of one) hands back for reporting."""

    stats: dict[str, _AppStats]
    gpu_busy_pct_ms: dict[int, float]  # global GPU index -> sum of GPU% x ms
    span_ms: float
    plans: int
    cpu_s: float
    trace: list[dict[str, Any]]


def _simulate(scheduler: Scheduler, workloads: Sequence[Workload], *, duration_ms: float, warmup_ms: float,
              seed: int, jitter_sigma: float, scale: Mapping[str, float], record_dispatches: bool,
              drain: float, gpu_ids: Sequence[int] | None = None) -> _Raw:
    # The event loop makes no reference cycles (reference counting frees all it drops), but it keeps
    # many small containers alive, which makes the cyclic collector's passes over them a tenth of the
    # run time; it is paused for the run (as timeit does) and restored after.
    paused = gc.isenabled()
    gc.disable()
    try:
        return _run_events(scheduler, workloads, duration_ms=duration_ms, warmup_ms=warmup_ms, seed=seed,
                           jitter_sigma=jitter_sigma, scale=scale, record_dispatches=record_dispatches,
                           drain=drain, gpu_ids=gpu_ids)
    finally:
        scheduler._bind_queues(None)
        if paused:
            gc.enable()


def _run_events(scheduler: Scheduler, workloads: Sequence[Workload], *, duration_ms: float, warmup_ms: float,
                seed: int, jitter_sigma: float, scale: Mapping[str, float], record_dispatches: bool,
                drain: float, gpu_ids: Sequence[int] | None) -> _Raw:
    rng = np.random.default_rng(seed)
    profiles: Mapping[str, Profile] = scheduler.profiles
    apps = [w.app for w in workloads]
    queues: dict[str, deque[float]] = {a.key(s.name): deque() for a in apps for s in a.stages}
    scheduler._bind_queues(queues)  # its deques are only ever changed in place
    ikey = {k: scheduler.instance_key(k) for k in queues}
    entry_keys = [w.app.key(w.app.entry.name) for w in workloads]
    entry_queues = [queues[k] for k in entry_keys]
    entry_gpus = [scheduler.placement[w.app.name] for w in workloads]
    entry_key_set = set(entry_keys)
    gpu_queues: list[list[deque[float]]] = [[] for _ in range(scheduler.num_gpus)]
    for a in apps:
        gpu_queues[scheduler.placement[a.name]] += [queues[a.key(s.name)] for s in a.stages]
    quiet, completed, plan, next_wakeup, can_start = (scheduler._quiet, scheduler.completed, scheduler.plan,
                                                      scheduler.next_wakeup_ms, scheduler.can_start)
    # Finished requests per app: the times they finished and their deadlines (stats are made at the end).
    done: dict[str, tuple[list[float], list[float]]] = {a.name: ([], []) for a in apps}
    lat_cache: dict[tuple[str, int, int], float] = {}
    stats = {a.name: _AppStats() for a in apps}
    deadline_of = {a.name: a.deadline_ms for a in apps}
    # key -> (the queue each label leads to, None where the request ends; cumulative probabilities)
    routes: dict[str, tuple[list[deque[float] | None], list[float]]] = {}
    for w in workloads:
        for s in w.app.stages:
            if not s.routes:
                continue
            probs = w.route_probs.get(s.name, {})
            labels: list[str | None] = [s.routes.get(lb) for lb in probs]
            p = list(probs.values())
            labels.append(None)
            p.append(max(0.0, 1.0 - sum(p)))
            cum = np.cumsum(np.asarray(p) / sum(p))
            cum[-1] = 1.0
            routes[w.app.key(s.name)] = ([None if lb is None else queues[w.app.key(lb)] for lb in labels],
                                         cum.tolist())
    uniforms = _Uniforms(rng, in_blocks=jitter_sigma == 0)  # the routing draws

    # Every app's arrivals merged in time order; requests of one app join its entry queue in order.
    times = [w.arrival.times_ms(duration_ms, rng) for w in workloads]
    for a, tm in zip(apps, times):
        stats[a.name].offered = int(np.count_nonzero((tm >= warmup_ms) & (tm < duration_ms)))
    all_t = np.concatenate([np.empty(0), *times])
    order = np.argsort(all_t, kind="stable")
    arr_t: list[float] = all_t[order].tolist()
    arr_app: list[int] = np.repeat(np.arange(len(workloads)), [len(tm) for tm in times])[order].tolist()
    arr_dl: list[float] = (all_t + np.repeat([a.deadline_ms for a in apps], [len(tm) for tm in times]))[order].tolist()
    arr_t.append(math.inf)  # a sentinel: no arrival after the last
    ai = 0
    next_arr = arr_t[0]
    last_arrival = max((tm[-1] for tm in times if len(tm)), default=0.0)

    heap: list[tuple[Any, ...]] = []  # the events other than arrivals (entries described below)
    heappush, heappop = heapq.heappush, heapq.heappop
    seq = 0
    running_pct = [0] * scheduler.num_gpus
    busy_keys: set[str] = set()
    gpu_busy_pct_ms = [0.0] * scheduler.num_gpus
    wakes: set[float] = set()
    trace: list[dict[str, Any]] = []
    end_ms = duration_ms + drain
    plans = 0
    t = 0.0
    cpu0 = time.process_time()

    # Per queue key: (queue, instance key, its app's lists of finished requests, route or None, entry
    # batch sizes of its app where the key is an entry stage, else None).
    Per = tuple[deque[float], str, tuple[list[float], list[float]], Any, "list[int] | None"]
    per: dict[str, Per] = {}
    for a in apps:
        for s in a.stages:
            k = a.key(s.name)
            per[k] = (queues[k], ikey[k], done[a.name], routes.get(k),
                      stats[a.name].entry_batches if k in entry_key_set else None)
    # Heap entries: (time, kind, seq, dispatch, its deadlines, its time, GPU, GPU%, instance key, its
    # app's lists of finished requests, route) for a run's completion (kind 0); (time, 2, seq, time,
    # None, ...) for a wakeup; ordered by (time, kind, seq) as before the arrivals left the heap.
    heap.append((math.inf, 3, -1, None, None, None, 0, 0, "", None, None))  # a sentinel: never empty
    arrivals = list(map([(entry_queues[i], entry_gpus[i], entry_keys[i]) for i in range(len(workloads))].__getitem__,
                        arr_app))  # per arrival: (entry queue, GPU, entry key) of its app

    touched: set[int] | list[int] | None
    # The last answer of next_wakeup_ms (while the scheduler keeps _wake_version; else -inf: ask every
    # time) and the _wake_version then.
    asked_until = -math.inf
    last_wv = -1
    versioned = scheduler._versioned_wakeups
    jitter = jitter_sigma > 0
    plan_gpus = scheduler._plan_gpus
    one_gpu = [[g] for g in range(scheduler.num_gpus)]  # never changed (Scheduler._plan_gpus)
    busy_add, busy_discard = busy_keys.add, busy_keys.discard
    while True:
        tn = heap[0][0]
        lone = False
        if next_arr < tn:
            limit = next_arr + _EPS
            if tn > limit and arr_t[ai + 1] > limit:
                # A lone arrival (the common event): the general batch below, cut short.
                lone = True
                t = next_arr
                q, g, key = arrivals[ai]
                q.append(arr_dl[ai])
                ai += 1
                next_arr = arr_t[ai]
                # (can_start does not depend on the queues)
                if len(q) > 1 or not can_start(key):
                    continue  # it waits behind others, or cannot start: no plan is due
                touched = one_gpu[g]
            else:
                tn = next_arr
        elif tn <= end_ms and heap[0][1] == 0 and next_arr > (limit := tn + _EPS):
            ev = heappop(heap)
            if heap[0][0] <= limit:
                heappush(heap, ev)  # not lone: back for the general batch below
            else:
                # A lone completion (the next common event): the same as the general batch below, cut
                # short.
                lone = True
                t = tn
                _, _, _, d, dls, measured, g, pct, ik, (fin_t, fin_dl), route = ev
                running_pct[g] -= pct
                busy_discard(ik)
                completed(d, measured)
                if route is None:
                    if len(dls) == 1:
                        fin_t.append(t)
                        fin_dl.append(dls[0])
                    else:
                        fin_t += [t] * len(dls)
                        fin_dl += dls
                else:
                    to, p = route
                    for dl, u in zip(dls, uniforms(len(dls))):
                        nxt = to[bisect.bisect_right(p, u)]
                        if nxt is not None:
                            nxt.append(dl)
                        else:
                            fin_t.append(t)
                            fin_dl.append(dl)
                if not any(gpu_queues[g]) and quiet(t, g):
                    continue  # the plan would do nothing (Scheduler._quiet)
                touched = one_gpu[g]
        if not lone:
            if tn > end_ms:
                if tn != math.inf:
                    t = tn
                break
            t = tn
            limit = t + _EPS
            need_plan = 0  # 1: runs completed (the plan may be skippable), 2: a plan is due
            touched = set()  # GPUs whose queues or runs changed; None: all of them
            while heap[0][0] <= limit:
                _, kind, _, d, dls, measured, g, pct, ik, fin, route = heappop(heap)
                if kind == 2:
                    wakes.discard(d)
                    need_plan = 2
                    touched = None
                    continue
                running_pct[g] -= pct
                busy_discard(ik)
                completed(d, measured)
                if need_plan == 0:
                    need_plan = 1
                if touched is not None:
                    touched.add(g)
                if route is None:
                    fin_t, fin_dl = fin
                    if len(dls) == 1:
                        fin_t.append(t)
                        fin_dl.append(dls[0])
                    else:
                        fin_t += [t] * len(dls)
                        fin_dl += dls
                    continue
                to, p = route
                fin_t, fin_dl = fin
                for dl, u in zip(dls, uniforms(len(dls))):
                    nxt = to[bisect.bisect_right(p, u)]
                    if nxt is not None:
                        nxt.append(dl)
                    else:
                        fin_t.append(t)
                        fin_dl.append(dl)
            while next_arr <= limit:
                q, g, key = arrivals[ai]
                # A plan is due anyway once its GPU is touched; else only if the request could start now.
                if not q and touched is not None and g not in touched and can_start(key):
                    need_plan = 2
                    touched.add(g)
                q.append(arr_dl[ai])
                ai += 1
                next_arr = arr_t[ai]
            if not need_plan:
                continue
            if need_plan == 1 and touched is not None:
                # Only completions: skip the plan where it would do nothing and the wakeup would not change
                # (Scheduler._quiet).
                for g in touched:
                    if any(gpu_queues[g]) or not quiet(t, g):
                        break
                else:
                    continue
        plans += 1
        # (a lone event's GPU goes as a ready-made list: plan_gpus skips the hint's checks)
        for d in (plan_gpus(t, queues, touched) if lone else plan(t, queues, touched)):
            key = d.key
            q, ik, fin, route, entry_batches = per[key]
            b = d.batch_size
            if not 0 < b <= len(q):
                raise RuntimeError(f"scheduler dispatched {b} from {key} holding {len(q)}")
            dls = [q.popleft()] if b == 1 else [q.popleft() for _ in range(b)]
            if d.action == "reject":
                dl_app = deadline_of[d.app]
                st = stats[d.app]
                for dl in dls:
                    if warmup_ms <= dl - dl_app < duration_ms:
                        st.rejected += 1
                if record_dispatches:
                    trace.append(_trace_row(d, t))
                continue
            g, pct = d.gpu, d.gpu_pct
            now_pct = running_pct[g] + pct
            if now_pct > 100:
                raise RuntimeError(f"scheduler took GPU {g} above 100% at t={t} ms ({running_pct[g]} + {pct})")
            if ik in busy_keys:
                raise RuntimeError(f"scheduler started {key} at t={t} ms while its instance was busy")
            running_pct[g] = now_pct
            busy_add(ik)
            lk = (d.model, b, pct)
            actual = lat_cache.get(lk)
            if actual is None:
                actual = lat_cache[lk] = profiles[d.model].latency_ms(b, pct) * scale.get(d.model, 1.0)
            if jitter:
                actual *= float(np.exp(rng.normal(0.0, jitter_sigma)))
            gpu_busy_pct_ms[g] += pct * actual
            heappush(heap, (t + actual, 0, seq, d, dls, actual, g, pct, ik, fin, route))
            seq += 1
            if entry_batches is not None:
                entry_batches.append(b)
            if record_dispatches:
                trace.append(_trace_row(d, t, actual))
        # The wakeup: unless the scheduler says its answer cannot have changed and that answer is still
        # pending (then next_wakeup_ms(t) would name it again, and it is already queued).
        if not (t < asked_until and scheduler._wake_version == last_wv and asked_until in wakes):
            w = next_wakeup(t)
            # (runs in flight: the heap holds more than the sentinel and the wakeups)
            if w is not None and w > limit and w not in wakes and (
                    len(heap) > len(wakes) + 1 or t < last_arrival or any(queues.values())):
                wakes.add(w)
                heappush(heap, (w, 2, seq, w, None, None, 0, 0, "", None, None))
                seq += 1
            if versioned and w is not None:
                asked_until, last_wv = w, scheduler._wake_version
    for name, (fin_t, fin_dl) in done.items():
        st = stats[name]
        end = np.fromiter(fin_t, float, len(fin_t))  # (as np.asarray(..., dtype=float), without the shape search)
        dl = np.fromiter(fin_dl, float, len(fin_dl))
        arrival = dl - deadline_of[name]
        counted = (warmup_ms <= arrival) & (arrival < duration_ms)
        st.latencies = (end - arrival)[counted].tolist()
        st.met = int(np.count_nonzero((end <= dl + _EPS) & counted))
        st.late = int(np.count_nonzero(counted)) - st.met
    ids = list(gpu_ids) if gpu_ids is not None else list(range(scheduler.num_gpus))
    if record_dispatches:
        for row in trace:
            row["gpu"] = ids[row["gpu"]]
    return _Raw(stats, {ids[g]: b for g, b in enumerate(gpu_busy_pct_ms)}, max(t, duration_ms), plans,
                time.process_time() - cpu0, trace)


def _report(raws: Sequence[_Raw], *, scheduler_name: str, num_gpus: int, duration_ms: float, warmup_ms: float,
            seed: int, wall_s: float) -> dict[str, Any]:
    stats: dict[str, _AppStats] = {}
    busy: dict[int, float] = {}
    for r in raws:
        stats.update(r.stats)
        busy.update(r.gpu_busy_pct_ms)
    window_s = (duration_ms - warmup_ms) / 1000.0
    per_app: dict[str, dict[str, Any]] = {}
    unfinished_total = 0
    for name, st in stats.items():
        unfinished = st.offered - st.met - st.late - st.rejected
        unfinished_total += unfinished
        per_app[name] = _summary(st, unfinished, window_s)
    total = _AppStats(
        offered=sum(s.offered for s in stats.values()), met=sum(s.met for s in stats.values()),
        late=sum(s.late for s in stats.values()), rejected=sum(s.rejected for s in stats.values()),
        latencies=list(itertools.chain.from_iterable(s.latencies for s in stats.values())),
        entry_batches=list(itertools.chain.from_iterable(s.entry_batches for s in stats.values())))
    span_ms = max(r.span_ms for r in raws)
    cpu_s = sum(r.cpu_s for r in raws)
    out: dict[str, Any] = {
        "simulated": True,
        "scheduler": scheduler_name,
        "num_gpus": num_gpus,
        "duration_ms": duration_ms,
        "warmup_ms": warmup_ms,
        "seed": seed,
        "apps": per_app,
        "total": _summary(total, unfinished_total, window_s),
        "gpu_util": [round(busy.get(g, 0.0) / (100.0 * span_ms), 4) for g in range(num_gpus)],
        "plans": sum(r.plans for r in raws),
        "wall_s": wall_s,
        "cpu_s": cpu_s,
        "sim_requests_per_wall_s": (total.offered / wall_s) if wall_s > 0 else float("inf"),
        "sim_requests_per_cpu_s": (total.offered / cpu_s) if cpu_s > 0 else float("inf"),
    }
    if any(r.trace for r in raws):
        out["dispatches"] = sorted((row for r in raws for row in r.trace), key=lambda row: row["start_ms"])
    return out


def _trace_row(d: Dispatch, t: float, actual: float | None = None) -> dict[str, Any]:
    return {"id": d.id, "app": d.app, "stage": d.stage, "model": d.model, "gpu": d.gpu, "gpu_pct": d.gpu_pct,
            "batch_size": d.batch_size, "action": d.action, "start_ms": t,
            "end_ms": None if actual is None else t + actual, "predicted_ms": d.predicted_ms}


def _summary(st: _AppStats, unfinished: int, window_s: float) -> dict[str, Any]:
    lat = np.fromiter(st.latencies, float, len(st.latencies))
    pct = {f"latency_p{p:g}_ms": (float(np.percentile(lat, p)) if lat.size else None) for p in (50, 99)}
    return {
        "simulated": True,
        "offered": st.offered,
        "met": st.met,
        "late": st.late,
        "rejected": st.rejected,
        "unfinished": unfinished,
        "throughput_rps": st.met / window_s,
        "completed_rps": (st.met + st.late) / window_s,
        "miss_rate": (1.0 - st.met / st.offered) if st.offered else 0.0,
        **pct,
        "mean_entry_batch": float(np.mean(st.entry_batches)) if st.entry_batches else None,
    }


def _run_shard(args: tuple[Any, ...]) -> _Raw:
    (name, sched_kw, profiles, workloads, gpu_ids, sim_kw) = args

    sch = make_scheduler(name, [w.app for w in workloads], profiles, num_gpus=len(gpu_ids), **sched_kw)
    return _simulate(sch, workloads, gpu_ids=gpu_ids, **sim_kw)


def simulate_sharded(scheduler_name: str, workloads: Sequence[Workload], profiles: Mapping[str, Profile], *,
                     num_gpus: int, processes: int, duration_ms: float, scheduler_kw: Mapping[str, Any] | None = None,
                     warmup_ms: float = 0.0, seed: int = 0, jitter_sigma: float = 0.0,
                     true_scale: Mapping[str, float] | None = None, record_dispatches: bool = False,
                     drain_ms: float | None = None) -> dict[str, Any]:
    """``simulate`` split by GPU over ``processes`` spawn processes, for long many-GPU traces.

    Apps are placed as ``make_scheduler(scheduler_name, ..., num_gpus=num_gpus)`` places them, then
    each process simulates its share of the GPUs with its own scheduler of the same class (schedulers
    place each app on one GPU, so GPUs only share time and the learned corrections). Differences from
    one ``simulate``: corrections are learned per shard, and each shard draws from its own random
    stream (seed ``seed * 1000 + shard``). The result has the same shape, plus ``"processes"``.
    Raises ValueError for bad arguments (as ``simulate``) or ``processes`` < 1.
    """
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    kw = dict(scheduler_kw or {})
    whole = make_scheduler(scheduler_name, [w.app for w in workloads], profiles, num_gpus=num_gpus, **kw)
    scale, drain = _check_args(whole, workloads, duration_ms, warmup_ms, jitter_sigma, true_scale, drain_ms)
    n = min(processes, num_gpus)
    jobs = []
    for k in range(n):
        gpu_ids = list(range(k, num_gpus, n))
        local = {g: i for i, g in enumerate(gpu_ids)}
        mine = [Workload(replace(w.app, gpu=local[whole.placement[w.app.name]]), w.arrival, w.route_probs)
                for w in workloads if whole.placement[w.app.name] in local]
        if not mine:
            continue
        sim_kw = {"duration_ms": duration_ms, "warmup_ms": warmup_ms, "seed": seed * 1000 + k,
                  "jitter_sigma": jitter_sigma, "scale": scale, "record_dispatches": record_dispatches,
                  "drain": drain}
        jobs.append((scheduler_name, kw, dict(profiles), mine, gpu_ids, sim_kw))
    wall0 = time.perf_counter()
    if n == 1:
        raws = [_run_shard(j) for j in jobs]
    else:
        with ProcessPoolExecutor(max_workers=n, mp_context=get_context("spawn")) as pool:
            raws = list(pool.map(_run_shard, jobs))
    out = _report(raws, scheduler_name=whole.name, num_gpus=num_gpus, duration_ms=duration_ms,
                  warmup_ms=warmup_ms, seed=seed, wall_s=time.perf_counter() - wall0)
    out["processes"] = n
    return out
