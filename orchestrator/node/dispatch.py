"""The live scheduler of a node: ``node.scheduler`` ``spatiotemporal`` or ``temporal``.

The same scheduler classes the simulator runs (``gpuprims.sched.scheduler``) decide, on the wall
clock, when each app stage runs, at what GPU% and with what batch. The node runs one *dispatched*
instance per app (a DAG app's stages share it, so they run one at a time there; the scheduler knows
through its ``instances`` mapping) and this class connects the two:

- **Queues.** An entry stage's queue is its instance's ring in the packet pool. ``tick`` looks at
  every ring with ``PacketPool.peek`` (read-only, absolute ring positions, only what arrived since
  the last look) and keeps each request's absolute deadline (first packet's arrival on
  CLOCK_MONOTONIC plus its deadline, or the app's SLO). A later stage's queue is what earlier
  batches routed there, as each ``BatchDone`` reports it.
- **Decisions.** ``tick`` calls ``plan`` when requests arrived, a batch completed, or the
  scheduler's wake-up time has come, and sends each dispatch to the stage's instance as a
  ``RunBatch`` (run, or reject: answer DEADLINE_MISSED). The instance takes exactly that many
  requests from the front of the queue, which is what the scheduler saw.
- **Feedback.** ``on_done`` reports the measured model time to the scheduler, which corrects its
  predictions (``completed``); a failed batch or a dead instance ``aborted``s its dispatches.

Profiles: a model's profile from ``node.profiles`` when one matches the app's input shape and
covers the stage's GPU%; otherwise what the instance measured in its warm-up at that GPU% (batch
sizes 1, 2, 4, ... max_batch). Either way the learned correction takes over from measurements, and an
app the profile condemns is probed once a second (``PROBE_MS``) so a too-slow profile cannot starve it.
"""

from __future__ import annotations

import collections
import datetime
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuprims.profile.format import Conditions, Profile, ProfilePoint
from gpuprims.sched.dag import App, Stage
from gpuprims.sched.scheduler import Dispatch, Scheduler, make_scheduler
from orchestrator.config.schema import AppConfig
from orchestrator.control.messages import BatchDone, Message, RunBatch

log = logging.getLogger("gpuprims.dispatch")

#: How often the node looks at the rings for new requests while it waits for messages.
TICK_MS = 1.0
#: An app whose profile says its requests cannot make their deadline, and that has not run for this
#: long, runs its queue head anyway (a probe) so that the scheduler measures it; as spatial instances do.
PROBE_MS = 1000.0


def stage_names(app: AppConfig) -> list[str]:
    """The scheduler's stage names of an app: its DAG stages, or ``main`` for one model."""
    return [s.name for s in app.stages] if app.stages else ["main"]


def stage_pcts(app: AppConfig, app_pct: int, scheduler: str) -> dict[str, int]:
    """GPU% per stage: 100 under ``temporal`` (exclusive access); else the stage's own share, or the
    app's where the stage (or the app) says auto."""
    if scheduler == "temporal":
        return {s: 100 for s in stage_names(app)}
    if not app.stages:
        return {"main": app_pct}
    return {s.name: s.gpu_pct if isinstance(s.gpu_pct, int) else app_pct for s in app.stages}


def sched_app(app: AppConfig, pcts: Mapping[str, int], gpu: int | None = None) -> App:
    """The scheduler's view of an app; each stage's model is ``<app>.<stage>`` (its own profile)."""
    if not app.stages:
        return App(app.name, (Stage("main", f"{app.name}.main", pcts["main"]),), app.slo_ms, gpu)
    entry = app.entry_stages()[0]
    order = [s for s in app.stages if s.name == entry] + [s for s in app.stages if s.name != entry]
    stages = tuple(Stage(s.name, f"{app.name}.{s.name}", pcts[s.name], {str(i): r for i, r in enumerate(s.routes)})
                   for s in order)
    return App(app.name, stages, app.slo_ms, gpu)


def core_groups(cores: Mapping[str, Sequence[int] | None]) -> list[list[str]]:
    """Apps whose instances' CPU core sets overlap, directly or through others (connected components).

    On the CPU backend a GPU% is a set of cores, and two instances given the same core do not run side
    by side at their profiled speed: they take turns on it. The live scheduler treats each group as one
    instance (its stages never run at the same time), which is what the core really does. Apps without
    a core set (GPU backend) are left alone. Groups of one are included; order follows ``cores``.
    """
    names = [a for a, c in cores.items() if c]
    parent = {a: a for a in names}

    def find(a: str) -> str:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if set(cores[a] or ()) & set(cores[b] or ()):
                parent[find(b)] = find(a)
    groups: dict[str, list[str]] = {}
    for a in names:
        groups.setdefault(find(a), []).append(a)
    return list(groups.values())


def measured_profile(model: str, measured: Mapping[str, float], gpu_pct: int, *, backend: str,
                     input_shape: tuple[int, ...], dtype: str, note: str) -> Profile:
    """A one-column profile from an instance's warm-up measurement ``{batch: ms}`` at ``gpu_pct``."""
    if not measured:
        raise ValueError(f"no measured latencies for {model}")
    points = []
    for b, ms in sorted(((int(b), float(ms)) for b, ms in measured.items())):
        ms = max(ms, 1e-3)
        points.append(ProfilePoint(batch_size=b, gpu_pct=gpu_pct, latency_p50_ms=ms, latency_p99_ms=ms,
                                   peak_mem_mb=0.0, throughput_rps=b * 1000.0 / ms))
    return Profile(model=model, source="measured", source_note=note, backend=backend,  # type: ignore[arg-type]
                   device=backend, conditions=Conditions(input_shape=tuple(input_shape), dtype=dtype,
                                                         date=datetime.date.today().isoformat(), repeats=3),
                   points=tuple(points))


def rename_profile(prof: Profile, model: str) -> Profile:
    """``prof`` under another model name (each app stage has its own profile in the scheduler)."""
    return prof.model_copy(update={"model": model})


@dataclass
class _Entry:
    """An entry stage's queue: the instance's ring, mirrored as deadlines."""

    instance: str | None = None
    consumer: int = -1
    taken: int = 0  # ring position up to which requests were dispatched
    seen: int = 0  # ring position up to which deadlines were read
    slo_ms: float = 0.0


#: How many completed runs ``LiveScheduler.run_log`` keeps (the most recent).
RUN_LOG_LEN = 20000


@dataclass(frozen=True, slots=True)
class RunRecord:
    """One completed run as the node saw it, for finding where deadline misses come from.

    ``predicted_ms``: the scheduler's prediction; ``measured_ms``: the model time the instance reported;
    ``overhead_ms``: from sending the RunBatch to receiving its BatchDone, minus ``measured_ms`` (message
    passing both ways, the instance's gather and answer, waits for the control loop); ``slack_ms``: the
    oldest request's deadline minus the dispatch time minus the prediction (what the plan left spare).
    The head request is late when ``measured_ms + overhead_ms > predicted_ms + slack_ms``.
    """

    key: str
    batch: int
    predicted_ms: float
    measured_ms: float
    overhead_ms: float
    slack_ms: float

    @property
    def late(self) -> bool:
        return self.measured_ms + self.overhead_ms > self.predicted_ms + self.slack_ms


@dataclass
class LiveStats:
    plans: int = 0
    runs: int = 0
    rejects: int = 0
    run_requests: int = 0
    rejected_requests: int = 0
    aborted: int = 0
    short_batches: int = 0
    batch_sizes: collections.Counter[int] = field(default_factory=collections.Counter)


class LiveScheduler:
    """Drives a ``Scheduler`` from a node's rings and instances (see the module docstring)."""

    def __init__(self, name: str, apps: list[AppConfig], pcts: Mapping[str, Mapping[str, int]],
                 profiles: Mapping[str, Profile], pool: Any, send: Callable[[str, Message], None], *,
                 round_ms: float = 30.0, clock_ms: Callable[[], float] | None = None,
                 exclusive: Sequence[Sequence[str]] = ()) -> None:
        """``exclusive``: groups of apps that must never run at the same time (see ``core_groups``)."""
        self.apps = {a.name: a for a in apps}
        self.pcts = {k: dict(v) for k, v in pcts.items()}
        self.pool = pool
        self.send = send
        self.clock_ms = clock_ms or (lambda: time.monotonic_ns() / 1e6)
        sapps = [sched_app(a, pcts[a.name]) for a in apps]
        self.exclusive = [sorted(g) for g in exclusive if len(g) > 1]
        instances = {a.key(s.name): a.name for a in sapps for s in a.stages} if any(
            len(a.stages) > 1 for a in sapps) else None
        self.scheduler: Scheduler = make_scheduler(name, sapps, profiles, round_ms=round_ms, instances=instances,
                                                   max_batch=max(a.max_batch for a in apps), probe_ms=PROBE_MS,
                                                   exclusive=self.exclusive)
        self.sapps = {a.name: a for a in sapps}
        self.entry_key = {a.name: a.key(a.entry.name) for a in sapps}
        self.queues: dict[str, collections.deque[float]] = {a.key(s.name): collections.deque()
                                                            for a in sapps for s in a.stages}
        self.entries = {a.name: _Entry(slo_ms=self.apps[a.name].slo_ms) for a in sapps}
        self.inflight: dict[int, tuple[Dispatch, str]] = {}
        self._sent: dict[int, tuple[float, float]] = {}  # run id -> (sent at, head deadline)
        self.run_log: collections.deque[RunRecord] = collections.deque(maxlen=RUN_LOG_LEN)
        self.stats = LiveStats()
        self._dirty = False
        self._wake: float | None = None

    # -- instances ------------------------------------------------------------------------------------
    def bind(self, app: str, instance: str, consumer: int) -> None:
        """``instance`` (consumer ``consumer``) now serves ``app``; its queued requests become visible."""
        e = self.entries[app]
        _, head, _ = self.pool.peek(consumer, 0, 0)
        e.instance, e.consumer, e.taken, e.seen = instance, consumer, head, head
        self.queues[self.entry_key[app]].clear()
        self._dirty = True
        log.info("scheduler: %s served by %s (consumer %d)", app, instance, consumer)

    def instance_lost(self, instance: str) -> None:
        """``instance`` died: forget its runs and the requests it held (the ingest answers them)."""
        for did, (d, inst) in list(self.inflight.items()):
            if inst == instance:
                del self.inflight[did]
                self._sent.pop(did, None)
                self.scheduler.aborted(d)
                self.stats.aborted += 1
        for app, e in self.entries.items():
            if e.instance == instance:
                e.instance, e.consumer = None, -1
                for s in self.sapps[app].stages:
                    self.queues[self.sapps[app].key(s.name)].clear()
        self._dirty = True

    # -- the loop -------------------------------------------------------------------------------------
    def wait_ms(self) -> float:
        """How long the node may wait for messages before the next ``tick``."""
        if self._wake is None:
            return TICK_MS
        return max(0.0, min(TICK_MS, self._wake - self.clock_ms()))

    def _look(self) -> bool:
        """Read new arrivals from every bound ring; True if any."""
        new = False
        for app, e in self.entries.items():
            if e.instance is None:
                continue
            recs, head, _ = self.pool.peek(e.consumer, e.seen)
            q = self.queues[self.entry_key[app]]
            if head > e.taken:  # the instance took requests on its own (draining): forget them
                for _ in range(min(len(q), head - e.taken)):
                    q.popleft()
                e.taken = head
            e.seen = max(e.seen, head)
            if recs.size:
                rows = self.pool.requests(recs)
                dl = rows["first_ns"].astype(np.float64) / 1e6 + np.where(
                    rows["deadline_us"] > 0, rows["deadline_us"] / 1e3, e.slo_ms)
                q.extend(dl.tolist())
                e.seen += int(recs.size)
                new = True
        return new

    def tick(self) -> int:
        """Look at the queues and, if anything changed or the wake-up came, plan and dispatch.
        Returns how many dispatches were sent."""
        if self._look():
            self._dirty = True
        now = self.clock_ms()
        if not self._dirty and (self._wake is None or now < self._wake):
            return 0
        self._dirty = False
        self.stats.plans += 1
        sent = 0
        for d in self.scheduler.plan(now, self.queues):
            sent += self._apply(d)
        self._wake = self.scheduler.next_wakeup_ms(now)
        return sent

    def _apply(self, d: Dispatch) -> int:
        q = self.queues[d.key]
        e = self.entries[d.app]
        n = min(d.batch_size, len(q))
        head = q[0] if q else float("nan")
        for _ in range(n):
            q.popleft()
        if d.key == self.entry_key[d.app]:
            e.taken += n
        if e.instance is None:  # cannot happen: an unbound app has empty queues
            if d.action == "run":
                self.scheduler.aborted(d)
            return 0
        # Taken before the send: a dispatcher descheduled right after it (a busy machine) would otherwise
        # start the round trip late, and the run could look shorter than the model time the instance took.
        t_sent = self.clock_ms()
        self.send(e.instance, RunBatch(instance=e.instance, id=d.id, stage=d.stage, batch=d.batch_size,
                                       gpu_pct=d.gpu_pct, action=d.action))
        if d.action == "run":
            self.inflight[d.id] = (d, e.instance)
            self._sent[d.id] = (t_sent, head)
            self.stats.runs += 1
            self.stats.run_requests += d.batch_size
            self.stats.batch_sizes[d.batch_size] += 1
        else:
            self.stats.rejects += 1
            self.stats.rejected_requests += d.batch_size
        return 1

    def on_done(self, msg: BatchDone) -> None:
        """A RunBatch finished: learn from its time, queue what it routed on, plan again."""
        entry = self.inflight.pop(msg.id, None)
        if entry is None:
            return  # a reject's acknowledgement, or a run of an instance already given up
        d, _ = entry
        sent = self._sent.pop(msg.id, None)
        if sent is not None and not msg.error:
            t_sent, head = sent
            self.run_log.append(RunRecord(d.key, d.batch_size, d.predicted_ms, max(0.0, msg.measured_ms),
                                          self.clock_ms() - t_sent - max(0.0, msg.measured_ms),
                                          head - t_sent - d.predicted_ms))
        if msg.taken < d.batch_size:
            self.stats.short_batches += 1
            log.warning("scheduler: %s took %d of the %d requests dispatched", d.key, msg.taken, d.batch_size)
        app = self.sapps[d.app]
        for stage, deadlines in msg.routed.items():
            key = app.key(stage)
            if key in self.queues and isinstance(deadlines, list):
                self.queues[key].extend(float(x) for x in deadlines)
        if msg.error:
            self.scheduler.aborted(d)
            self.stats.aborted += 1
        else:
            self.scheduler.completed(d, max(0.0, msg.measured_ms))
        self._dirty = True

    def status(self) -> dict[str, Any]:
        """What the node's status shows under ``scheduler``."""
        s = self.stats
        return {
            "name": self.scheduler.name, "round_ms": self.scheduler.round_ms, "plans": s.plans, "runs": s.runs,
            "rejects": s.rejects, "run_requests": s.run_requests, "rejected_requests": s.rejected_requests,
            "aborted": s.aborted, "short_batches": s.short_batches, "inflight": len(self.inflight),
            "probes": self.scheduler.probes, "exclusive": self.exclusive,
            "mean_batch": (s.run_requests / s.runs) if s.runs else None,
            "queued": {k: len(q) for k, q in self.queues.items() if q},
            # measured / predicted latency per stage, as the scheduler has learned it
            "corrections": {a.key(st.name): round(self.scheduler.correction(st.model, pct), 3)
                            for a in self.sapps.values() for st in a.stages
                            for pct in [self.pcts[a.name][st.name]]},
        }
