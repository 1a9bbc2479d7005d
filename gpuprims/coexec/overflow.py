"""SIR+ (Kumar et al., SYSTOR'22): overflow work from the accelerator to the host CPU when it finishes sooner.

Two granularities, both pure:

- ``OverflowRouter``: per request (or per batch), the node's decision. The predicted finish on each
  device is its queue wait (requests ahead of this one, divided over the device's workers, times
  its service time) plus the profiled execution time, plus ``transfer_ms`` on the CPU path (the input
  is gathered on the host rather than straight into accelerator memory, and the answer comes back
  from there). The CPU takes the request only if its predicted finish plus ``alpha_ms`` (the
  paper's 100 us threshold for switching to the slower device) is earlier than the accelerator's:
  SIR+'s QD rule, "S.T. on the CPU < Q.T. + S.T. on the GPU", made conservative by alpha. So it
  overflows only when it helps, i.e. under load. Service times start from the profiles and follow
  the measured ones (``observe``; exponential average of measured/profiled).
- ``comm_sd``: per task of one model's graph, the paper's Algorithm 1 (Comm+SD): start from SD
  (tasks whose CPU time is within ``alpha_ms`` of their fastest time go to the CPU), then, in
  topological order and until nothing changes, send a task back to its fastest device when its
  current time plus the transfers its placement causes exceeds the fastest time plus alpha. The
  placement is then rated by the shared cost model (``graph.schedule``) and never returned when a
  single device is rated better.

``simulate_overflow`` is a small exact FIFO simulation of Poisson requests on one accelerator and a
CPU pool, with or without a router, for the ``paper-sir`` scenario.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuprims.coexec.graph import CPU, GPU, PCIE, Link, Plan, TaskGraph, best_of, schedule

#: The paper's threshold for moving work to the slower device (GPU kernel launch overheads are 10-100 us).
DEFAULT_ALPHA_MS = 0.1

LatencyModel = float | Callable[[int], float]


@dataclass(frozen=True)
class RouteDecision:
    """Where one request (or batch) goes and the finish times predicted for each device (ms from now)."""

    device: str
    accel_finish_ms: float
    cpu_finish_ms: float

    @property
    def overflow(self) -> bool:
        """True when the work goes to the CPU."""
        return self.device == CPU


class OverflowRouter:
    """Per-request (or per-batch) choice between the accelerator and the CPU pool (module docstring).

    ``accel_ms`` and ``cpu_ms`` are the profiled execution times, either one number (batch 1) or a
    function of the batch size. ``accel_workers``/``cpu_workers`` are how many requests each device
    serves at once (instances, or CPU instances of one core each). ``learn_rate`` is the weight of a
    new measurement in the exponential average of measured/profiled time per device (0 disables it).
    """

    def __init__(self, accel_ms: LatencyModel, cpu_ms: LatencyModel, *, transfer_ms: float = 0.0,
                 alpha_ms: float = DEFAULT_ALPHA_MS, accel_workers: int = 1, cpu_workers: int = 1,
                 learn_rate: float = 0.2) -> None:
        for label, v in (("transfer_ms", transfer_ms), ("alpha_ms", alpha_ms)):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{label} must be finite and >= 0, got {v}")
        if accel_workers < 1 or cpu_workers < 1:
            raise ValueError(f"accel_workers and cpu_workers must be >= 1, got {accel_workers}, {cpu_workers}")
        if not 0 <= learn_rate <= 1:
            raise ValueError(f"learn_rate must be in [0, 1], got {learn_rate}")
        self._model = {GPU: _as_model("accel_ms", accel_ms), CPU: _as_model("cpu_ms", cpu_ms)}
        self._scale = {GPU: 1.0, CPU: 1.0}
        self._workers = {GPU: accel_workers, CPU: cpu_workers}
        self.transfer_ms = transfer_ms
        self.alpha_ms = alpha_ms
        self.learn_rate = learn_rate
        self.decisions = {GPU: 0, CPU: 0}

    def service_ms(self, device: str, batch: int = 1) -> float:
        """Predicted execution time of ``batch`` requests on ``device`` (profile times learned scale)."""
        if device not in self._model:
            raise ValueError(f"device must be {GPU!r} or {CPU!r}, got {device!r}")
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        return self._model[device](batch) * self._scale[device]

    def predict(self, *, accel_queue: int, cpu_queue: int, batch: int = 1) -> RouteDecision:
        """Predicted finish on each device for work arriving now; ``*_queue`` counts requests (or
        batches of this size) ahead of it on that device, running or waiting. Does not count a decision."""
        if accel_queue < 0 or cpu_queue < 0:
            raise ValueError(f"queue lengths must be >= 0, got accel {accel_queue}, cpu {cpu_queue}")
        fin = {}
        for dev, q in ((GPU, accel_queue), (CPU, cpu_queue)):
            rounds = q // self._workers[dev] + 1  # service rounds until this one is done
            fin[dev] = rounds * self.service_ms(dev, batch)
        fin[CPU] += self.transfer_ms
        dev = CPU if fin[CPU] + self.alpha_ms < fin[GPU] else GPU
        return RouteDecision(dev, fin[GPU], fin[CPU])

    def route(self, *, accel_queue: int, cpu_queue: int, batch: int = 1) -> RouteDecision:
        """``predict`` and count the decision (``decisions[device]``)."""
        d = self.predict(accel_queue=accel_queue, cpu_queue=cpu_queue, batch=batch)
        self.decisions[d.device] += 1
        return d

    def observe(self, device: str, measured_ms: float, batch: int = 1) -> None:
        """Fold a measured execution time into the device's learned scale (exponential average of
        measured/profiled). A non-positive or non-finite measurement raises ValueError."""
        if not (math.isfinite(measured_ms) and measured_ms > 0):
            raise ValueError(f"measured_ms must be a positive finite number, got {measured_ms}")
        base = self._model[device](batch) if device in self._model else None
        if base is None:
            raise ValueError(f"device must be {GPU!r} or {CPU!r}, got {device!r}")
        if base > 0 and self.learn_rate > 0:
            r = self.learn_rate
            self._scale[device] = (1 - r) * self._scale[device] + r * (measured_ms / base)


def _as_model(label: str, m: LatencyModel) -> Callable[[int], float]:
    if callable(m):
        return m
    v = float(m)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{label} must be a positive finite number or a function of the batch size, got {m!r}")
    return lambda batch: v * batch


# ---- Algorithm 1 (Comm+SD), per task ------------------------------------------------------------


def sd_placement(graph: TaskGraph, *, alpha_ms: float = DEFAULT_ALPHA_MS) -> dict[str, str]:
    """SD (paper 4.2): a task goes to the CPU when its CPU time exceeds its fastest time by < alpha."""
    out = {}
    for t in graph.tasks:
        fast = t.fastest()
        slow_ok = t.runs_on(CPU) and t.latency_ms[CPU] - t.latency_ms[fast] < alpha_ms
        out[t.name] = CPU if slow_ok else fast
    return out


def comm_sd_placement(graph: TaskGraph, *, link: Link = PCIE, alpha_ms: float = DEFAULT_ALPHA_MS,
                      max_iter: int = 10, start: dict[str, str] | None = None) -> tuple[dict[str, str], int]:
    """Algorithm 1 of the paper from ``start`` (default: ``sd_placement``); returns (placement, iterations)."""
    if max_iter < 1:
        raise ValueError(f"max_iter must be >= 1, got {max_iter}")
    place = dict(start) if start is not None else sd_placement(graph, alpha_ms=alpha_ms)
    graph.check_placement(place)
    it = 0
    while it < max_iter:
        it += 1
        changed = False
        for n in graph.topo_order():
            t = graph.task(n)
            here = place[n]
            comm = sum(link.transfer_ms(graph.task(p).out_mb) for p in graph.preds(n) if place[p] != here)
            comm += sum(link.transfer_ms(t.out_mb) for s in graph.succs(n) if place[s] != here)
            fast = t.fastest()
            if t.latency_ms[here] + comm > t.latency_ms[fast] + alpha_ms and here != fast:
                place[n] = fast
                changed = True
        if not changed:
            break
    return place, it


def comm_sd(graph: TaskGraph, *, link: Link = PCIE, alpha_ms: float = DEFAULT_ALPHA_MS, cpu_slots: int = 1,
            max_iter: int = 10) -> Plan:
    """SIR+'s Comm+SD placement of one model's tasks, rated by ``schedule`` (makespan, ms).

    Returns the best single-device placement instead (``Plan.fallback``) when the cost model rates
    that lower.
    """
    cand, iters = comm_sd_placement(graph, link=link, alpha_ms=alpha_ms, max_iter=max_iter)

    def cost(p: dict[str, str]) -> float:
        return schedule(graph, p, link=link, cpu_slots=cpu_slots).makespan_ms

    best, c, base, fb = best_of(graph, cand, cost)
    s = schedule(graph, best, link=link, cpu_slots=cpu_slots)
    return Plan(best, c, s.makespan_ms, s.gpu_mem_mb, base, fb,
                {"iterations": iters, "candidate": cand, "candidate_ms": cost(cand)})


# ---- request-level simulation (paper-sir) -----------------------------------------------------------


def simulate_overflow(*, rate_rps: float, duration_s: float, accel_ms: float, cpu_ms: float,
                      router: OverflowRouter | None, accel_workers: int = 1, cpu_workers: int = 1,
                      jitter_sigma: float = 0.0, seed: int = 0, warmup_s: float = 0.0) -> dict[str, Any]:
    """Poisson requests served FIFO by ``accel_workers`` accelerator slots and ``cpu_workers`` CPU slots.

    Without a router every request goes to the accelerator. With one, each arrival is routed on the
    requests in system on each device at that instant (what a node measures). Execution times are the
    given ones times an optional log-normal jitter. Returns latency mean/p50/p99 (ms) of the requests
    arriving in ``[warmup_s, duration_s)``, throughput (completions per second inside that window),
    the share overflowed and the raw latencies.
    Every figure is simulated (``"simulated": True``).
    """
    if not (rate_rps > 0 and duration_s > 0 and accel_ms > 0 and cpu_ms > 0):
        raise ValueError("rate_rps, duration_s, accel_ms and cpu_ms must be > 0")
    if not 0 <= warmup_s < duration_s:
        raise ValueError(f"warmup_s must be in [0, duration_s), got {warmup_s}")
    rng = np.random.default_rng(seed)
    n = int(rate_rps * duration_s * 1.2 + 20)
    arrivals = np.cumsum(rng.exponential(1000.0 / rate_rps, n))
    arrivals = arrivals[arrivals < duration_s * 1000.0]
    noise = rng.lognormal(0.0, jitter_sigma, len(arrivals)) if jitter_sigma > 0 else np.ones(len(arrivals))
    slots = {GPU: [0.0] * accel_workers, CPU: [0.0] * cpu_workers}
    in_system: dict[str, list[float]] = {GPU: [], CPU: []}  # finish-time heaps
    base = {GPU: accel_ms, CPU: cpu_ms}
    lat, fin_all, dev_all = [], [], []
    for t, z in zip(arrivals.tolist(), noise.tolist()):
        for d in in_system:
            h = in_system[d]
            while h and h[0] <= t:
                heapq.heappop(h)
        if router is None:
            dev = GPU
        else:
            dev = router.route(accel_queue=len(in_system[GPU]), cpu_queue=len(in_system[CPU])).device
        sl = slots[dev]
        i = min(range(len(sl)), key=sl.__getitem__)
        start = max(t, sl[i])
        dur = base[dev] * z + (router.transfer_ms if (router is not None and dev == CPU) else 0.0)
        fin = start + dur
        sl[i] = fin
        heapq.heappush(in_system[dev], fin)
        if router is not None:
            router.observe(dev, base[dev] * z)
        lat.append(fin - t)
        fin_all.append(fin)
        dev_all.append(dev)
    a = np.asarray(arrivals)
    lat_a, fin_a = np.asarray(lat), np.asarray(fin_all)
    win = (a >= warmup_s * 1000.0)
    span_ms = duration_s * 1000.0 - warmup_s * 1000.0
    # Completions inside the window, whenever they arrived: under overload a device serves at its
    # capacity throughout, but the work it finishes may have arrived before the window.
    done = (fin_a >= warmup_s * 1000.0) & (fin_a < duration_s * 1000.0)
    measured = lat_a[win]
    return {
        "simulated": True,
        "offered_rps": rate_rps,
        "requests": int(win.sum()),
        "throughput_rps": float(done.sum() / (span_ms / 1000.0)),
        "latency_mean_ms": float(measured.mean()) if len(measured) else math.nan,
        "latency_p50_ms": float(np.percentile(measured, 50)) if len(measured) else math.nan,
        "latency_p99_ms": float(np.percentile(measured, 99)) if len(measured) else math.nan,
        "overflow_share": float(np.mean([d == CPU for d, w in zip(dev_all, win) if w])) if len(measured) else 0.0,
        "latencies_ms": measured.round(4).tolist(),
    }
