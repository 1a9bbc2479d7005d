"""Schedulers that decide when, on which GPU, at what GPU% and with what batch each app stage runs.

Both schedulers share one interface, free of simulation details so that the orchestrator can drive
them live with wall-clock time:

- ``plan(now_ms, queues, gpus=None) -> list[Dispatch]``: ``queues`` maps a stage's queue key
  ``"<app>/<stage>"`` to the absolute deadlines (ms) of its waiting requests, oldest first. The caller applies the
  returned dispatches in list order, each taking ``batch_size`` requests from the front of its
  queue: ``action == "run"`` starts them now on ``gpu`` at ``gpu_pct``; ``action == "reject"``
  answers them at once with a deadline-miss status (they cannot meet their deadline any more).
  ``gpus`` optionally limits the work to the GPUs whose queues or runs changed since the last call
  (an optimisation for callers that know; None considers every GPU).
- ``completed(dispatch, measured_ms)``: a run finished after ``measured_ms``; the caller has routed
  its outputs to the next stages' queues before calling ``plan`` again. ``aborted(dispatch)``: a run
  ended without a result (crashed instance); its GPU% and reserved later slots are released.
- ``next_wakeup_ms(now_ms)``: when ``plan`` wants to be called again even if nothing else happens
  (the next scheduling round), or None.

The caller calls ``plan`` after every completion, when a queue turns non-empty (it may skip that
call while ``can_start(key)`` is False), and at the wakeup. Times are milliseconds on any one
monotonic clock, the same for ``now_ms`` and the deadlines.

``SpatioTemporalScheduler`` ("spatiotemporal", paper V-F, Fig. 10): every stage runs in its own
instance at its fixed GPU%, and instances on one GPU run concurrently as long as the GPU% of what
runs at any instant sums to at most 100. A launch places the whole remaining chain of a request
batch: the stage starts now, each following stage is reserved at the earliest time its GPU% is free
after its predecessor's predicted end, and the batch size is the largest whose predicted chain end
meets the oldest request's deadline.
A later stage's slot is sized for the share of the batch expected to take that branch: the learned
fraction (exponential average of what earlier batches routed there; 1.0 until observed) plus
``route_margin_sigma`` binomial standard deviations, capped at the whole batch. When more requests
arrive at a reserved stage than its slot was sized for, it runs them all if the oldest still meets
its deadline (the plan slips; the 100% invariant still holds), else the slot's batch.
Stages that start now without a chain behind them are Batch-Latency gap fills: the batch is the
largest that ends before the next reservation that would collide (or the deadline). Each scheduling
round (default 30 ms) first offers a launch to every app that has not launched in this round, in
earliest-deadline order, then fills what is left. Predictions are profile latencies times a
per-(model, GPU%) correction learned from measured latencies (exponential average).

``TemporalScheduler`` ("temporal", the Triton-like baseline): one dispatch at a time per GPU with
exclusive access (100% GPU); apps take turns round-robin, a DAG app's later stages run before the
next app's turn, and each turn runs the largest batch whose predicted sequential chain meets the
deadline.

``probe_ms`` (optional, both schedulers; off by default): a profile far slower than reality makes
a scheduler reject an app's requests without ever running one, so it never learns otherwise. With
``probe_ms`` set, a stage whose queue head is about to be rejected, and that has not started a
run for ``probe_ms``, runs that head request at the smallest batch instead (a *probe*, when its instance
and GPU% are free and no slot is reserved for it); the measured time corrects the prediction like any
run. A later stage of a DAG app probes the same way (else one stale, too pessimistic correction of,
say, the face stage starves the whole chain while the router keeps being probed). At most one probe
per stage per ``probe_ms``; the other doomed requests are rejected as before.
The spatial scheduler's instances probe the same way after 1 s; the live node sets ``probe_ms=1000``.

``exclusive`` (optional): groups of app names whose stages never run at the same time, as if one
instance ran them all (on the CPU backend, apps whose instances were given the same core take turns
on it rather than running side by side at their profiled speed).

``instances`` (optional) maps stage keys to instance names: stages that share an instance (a DAG app
whose stages run in one process, as on a live node) never run at the same time; by default every stage
has its own instance.

The hard invariant of both: at every instant, the GPU% of the runs started on a GPU and not yet
completed sums to at most 100.
"""

from __future__ import annotations

import itertools
import math
import operator
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from gpuprims.profile.format import Profile, Stat
from gpuprims.sched.dag import App, Stage, validate_apps

Action = Literal["run", "reject"]
_EPS = 1e-9


@dataclass(frozen=True)
class Dispatch:
    """One decision: run (or reject) ``batch_size`` requests of stage ``stage`` of ``app``."""

    id: int
    app: str
    stage: str
    model: str
    gpu: int
    gpu_pct: int
    batch_size: int
    start_ms: float
    predicted_ms: float
    action: Action = "run"
    key: str = field(init=False, repr=False, compare=False)  # "<app>/<stage>": the queue it takes from

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", f"{self.app}/{self.stage}")

    @property
    def predicted_end_ms(self) -> float:
        """``start_ms + predicted_ms``."""
        return self.start_ms + self.predicted_ms


# A busy stretch of a GPU: (start ms, end ms, GPU%, instance key).
_Interval = tuple[float, float, int, str]


@dataclass(slots=True)
class _Reservation:
    """A later stage's slot, reserved when its predecessor was launched."""

    key: str
    app: str
    stage: str
    gpu: int
    pct: int
    batch_size: int
    start: float
    end: float
    upstream: int  # dispatch id of the predecessor
    upstream_batch: int = 0
    ready: bool = False


@dataclass
class _GpuState:
    running: dict[int, Dispatch] = field(default_factory=dict)
    reservations: list[_Reservation] = field(default_factory=list)
    pct: int = 0  # GPU% of the runs in ``running``
    busy: set[str] = field(default_factory=set)  # instance keys of the runs in ``running``

    def running_pct(self) -> int:
        return self.pct


class _KeyInfo:
    """What the schedulers look up about one stage queue key, gathered once."""

    __slots__ = ("app", "app_name", "cap", "gpu", "gs", "ikey", "index", "is_entry", "key", "lo", "model", "nexts",
                 "pct", "pred", "run", "stage", "succ")

    def __init__(self, key: str, app: App, stage: Stage, ikey: str, gpu: int, gs: _GpuState, index: int,
                 is_entry: bool, succ: tuple[str, ...], lo: int, cap: int, pred: dict[int, float]) -> None:
        self.key = key
        self.app = app
        self.app_name = app.name
        self.stage = stage.name
        self.ikey = ikey
        self.model = stage.model
        self.pct = stage.gpu_pct
        self.gpu = gpu
        self.gs = gs  # the GPU's state
        self.index = index  # the app's index on its GPU
        self.is_entry = is_entry
        self.succ = succ
        self.lo = lo  # smallest and largest batch the profile (and max_batch) allow
        self.cap = cap
        self.pred = pred  # batch size -> predicted ms at the stage's own GPU% (see Scheduler._pred)
        self.nexts: tuple[_KeyInfo, ...] = ()  # the infos of ``succ``, filled in once all exist
        # A run Dispatch's fields in declaration order, the per-run ones to be filled in (Scheduler._dispatch)
        self.run: dict[str, object] = {"id": 0, "app": self.app_name, "stage": self.stage, "model": self.model,
                                       "gpu": gpu, "gpu_pct": self.pct, "batch_size": 0, "start_ms": 0.0,
                                       "predicted_ms": 0.0, "action": "run", "key": key}


class Scheduler(ABC):
    """Common state: apps, profiles, placement, learned corrections, running dispatches per GPU."""

    name: ClassVar[str]
    _versioned_wakeups: ClassVar[bool] = False  # see _wake_version

    def __init__(self, apps: Sequence[App], profiles: Mapping[str, Profile], *, num_gpus: int = 1,
                 round_ms: float = 30.0, stat: Stat = "p50", learn_rate: float = 0.2,
                 max_batch: int | None = None, instances: Mapping[str, str] | None = None,
                 probe_ms: float | None = None, exclusive: Sequence[Sequence[str]] = ()) -> None:
        if num_gpus < 1:
            raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
        if not round_ms > 0:
            raise ValueError(f"round_ms must be > 0, got {round_ms}")
        if not 0.0 <= learn_rate <= 1.0:
            raise ValueError(f"learn_rate must be in [0, 1], got {learn_rate}")
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if stat not in ("p50", "p99"):
            raise ValueError(f"stat must be 'p50' or 'p99', got {stat!r}")
        if probe_ms is not None and not probe_ms > 0:
            raise ValueError(f"probe_ms must be > 0 or None, got {probe_ms}")
        if not apps:
            raise ValueError("need at least one app")
        validate_apps(apps, profiles)
        for a in apps:
            if a.gpu is not None and a.gpu >= num_gpus:
                raise ValueError(f"app {a.name!r}: gpu {a.gpu} does not exist (num_gpus={num_gpus})")
        self.apps: dict[str, App] = {a.name: a for a in apps}
        self.profiles = dict(profiles)
        self.num_gpus = num_gpus
        self.round_ms = float(round_ms)
        self.stat: Stat = stat
        self.learn_rate = learn_rate
        self.max_batch = max_batch
        self.probe_ms = None if probe_ms is None else float(probe_ms)
        self._last_start: dict[str, float] = {}  # entry key -> start of its last run seen (probe_ms only)
        self.probes = 0
        self.placement: dict[str, int] = self._place(apps)
        self.gpus = [_GpuState() for _ in range(num_gpus)]
        self._gpu_ids = frozenset(range(num_gpus))
        self._gpu_of = dict(enumerate(self.gpus))  # GPU index -> its state (no entry: no such GPU)
        self._correction: dict[tuple[str, int], float] = {}
        self._base_cache: dict[tuple[str, int, int], float] = {}
        self._ids = itertools.count(1)
        self._stage_of: dict[str, tuple[App, str]] = {a.key(s.name): (a, s.name) for a in apps for s in a.stages}
        self._ikey = self._instance_keys(instances or {})
        self._exclusive(exclusive)
        self._apps_on: list[list[App]] = [[a for a in self.apps.values() if self.placement[a.name] == g]
                                          for g in range(num_gpus)]
        # (app index on its GPU, app, stage name, queue key, is entry) per GPU, in app then stage order
        self._keys_on: list[list[tuple[int, App, str, str, bool]]] = [
            [(i, a, s.name, a.key(s.name), j == 0) for i, a in enumerate(self._apps_on[g])
             for j, s in enumerate(a.stages)] for g in range(num_gpus)]
        self._chain_cache: dict[str, float] = {}
        self._chain_by_batch: dict[tuple[str, int], float] = {}  # TemporalScheduler's chain times
        # The ready reservations (their predecessor has completed) that are still reserved. Reservations
        # are unique by (predecessor, stage), so list.remove finds the very one.
        self._ready: list[_Reservation] = []
        # Where _versioned_wakeups: a number that changes whenever next_wakeup_ms(now) may answer
        # otherwise than at its last call, for a later now before that answer (the simulator asks again
        # only then). SpatioTemporalScheduler's answer depends on the round and on _ready.
        self._wake_version = 0
        self._succ: dict[tuple[str, str], list[str]] = {(a.name, st.name): a.successors(st.name)
                                                        for a in apps for st in a.stages}
        self._stage_obj: dict[tuple[str, str], Stage] = {(a.name, st.name): st for a in apps for st in a.stages}
        self._caps: dict[str, tuple[int, int]] = {}
        for m, prof in self.profiles.items():
            bs = prof.batch_sizes
            self._caps[m] = (bs[0], bs[-1] if max_batch is None else min(bs[-1], max_batch))
        # (model, GPU%) -> {batch size: predicted ms}; emptied when that pair's correction changes.
        self._pred_tabs: dict[tuple[str, int], dict[int, float]] = {}
        self._kinfo: dict[str, _KeyInfo] = {}
        for g in range(num_gpus):
            for i, a in enumerate(self._apps_on[g]):
                for j, st in enumerate(a.stages):
                    k = a.key(st.name)
                    self._kinfo[k] = _KeyInfo(k, a, st, self._ikey[k], g, self.gpus[g], i, j == 0,
                                              tuple(self._succ[(a.name, st.name)]), *self._caps[st.model],
                                              self._pred_tab(st.model, st.gpu_pct))
        for info in self._kinfo.values():
            info.nexts = tuple(self._kinfo[info.app.key(n)] for n in info.succ)
        self._kinfo_on: list[list[_KeyInfo]] = [[self._kinfo[k] for _, _, _, k, _ in self._keys_on[g]]
                                                for g in range(num_gpus)]
        # Per GPU: (queue key, its info) in key order, for the queue scans.
        self._pairs_on: list[tuple[tuple[str, _KeyInfo], ...]] = [tuple((i.key, i) for i in infos)
                                                                 for infos in self._kinfo_on]
        self._min_pct_on = [min((i.pct for i in infos), default=101) for infos in self._kinfo_on]
        self._bound: Mapping[str, Sequence[float]] | None = None  # see _bind_queues
        self._bound_on: list[tuple[tuple[Sequence[float] | None, str, _KeyInfo], ...]] = []

    # --- placement and prediction ------------------------------------------------------------------
    def _place(self, apps: Sequence[App]) -> dict[str, int]:
        """Pinned apps keep their GPU; the others go, in order, to the least-loaded GPU (sum of GPU%)."""
        load = [0] * self.num_gpus
        out: dict[str, int] = {}
        for a in apps:
            if a.gpu is not None:
                out[a.name] = a.gpu
                load[a.gpu] += sum(s.gpu_pct for s in a.stages)
        for a in apps:
            if a.gpu is None:
                g = min(range(self.num_gpus), key=lambda i: (load[i], i))
                out[a.name] = g
                load[g] += sum(s.gpu_pct for s in a.stages)
        return out

    def _instance_keys(self, instances: Mapping[str, str]) -> dict[str, str]:
        """Stage key -> the key of the instance that runs it (itself unless ``instances`` says)."""
        unknown = sorted(set(instances) - set(self._stage_of))
        if unknown:
            raise ValueError(f"instances names unknown stage keys {unknown}; keys are '<app>/<stage>'")
        owner: dict[str, str] = {}
        for k, inst in instances.items():
            app = self._stage_of[k][0].name
            if owner.setdefault(inst, app) != app:
                raise ValueError(f"instance {inst!r} runs stages of two apps ({owner[inst]!r} and {app!r}); "
                                 "an instance serves one app")
        return {k: f"instance:{instances[k]}" if k in instances else k for k in self._stage_of}

    def _exclusive(self, groups: Sequence[Sequence[str]]) -> None:
        """Give every stage of each group's apps one instance key (they then never run at the same time)."""
        seen: set[str] = set()
        for grp in groups:
            unknown = sorted(set(grp) - set(self.apps))
            twice = sorted(set(grp) & seen)
            if unknown or twice:
                raise ValueError(f"exclusive group {list(grp)}: " + (f"unknown apps {unknown}" if unknown else
                                                                    f"apps {twice} are in two groups"))
            seen.update(grp)
            name = "exclusive:" + "+".join(sorted(grp))
            for k, (a, _) in self._stage_of.items():
                if a.name in grp:
                    self._ikey[k] = name

    def instance_key(self, key: str) -> str:
        """The key of the instance that runs stage ``key`` (stages with one instance run one at a time)."""
        return self._ikey[key]

    def correction(self, model: str, gpu_pct: int) -> float:
        """Learned factor measured/profiled latency for ``model`` at ``gpu_pct`` (1.0 until measured)."""
        return self._correction.get((model, gpu_pct), 1.0)

    def predict_ms(self, model: str, batch_size: int, gpu_pct: int) -> float:
        """Predicted latency: profile latency (``stat``) times the learned correction."""
        return self._base_ms(model, batch_size, gpu_pct) * self._correction.get((model, gpu_pct), 1.0)

    def _pred_tab(self, model: str, gpu_pct: int) -> dict[int, float]:
        tab = self._pred_tabs.get((model, gpu_pct))
        if tab is None:
            tab = self._pred_tabs[(model, gpu_pct)] = {}
        return tab

    def _pred(self, tab: dict[int, float], model: str, batch_size: int, gpu_pct: int) -> float:
        """``predict_ms(model, batch_size, gpu_pct)`` through ``tab``, that pair's ``_pred_tab``."""
        v = tab.get(batch_size)
        if v is None:
            v = tab[batch_size] = self.predict_ms(model, batch_size, gpu_pct)
        return v

    def _base_ms(self, model: str, batch_size: int, gpu_pct: int) -> float:
        k = (model, batch_size, gpu_pct)
        base = self._base_cache.get(k)
        if base is None:
            base = self._base_cache[k] = self.profiles[model].latency_ms(batch_size, gpu_pct, stat=self.stat)
        return base

    def _min_batch(self, model: str) -> int:
        return self._caps[model][0]

    # --- the interface -----------------------------------------------------------------------------
    @abstractmethod
    def plan(self, now_ms: float, queues: Mapping[str, Sequence[float]],
             gpus: Iterable[int] | None = None) -> list[Dispatch]:
        """Dispatches to apply now, in order (module docstring)."""

    def _plan_gpus(self, now_ms: float, queues: Mapping[str, Sequence[float]], glist: list[int]) -> list[Dispatch]:
        """``plan(now_ms, queues, glist)`` for a caller that passes valid GPU indexes, ascending and
        distinct, in a list it does not change (the simulator); subclasses skip re-checking them."""
        return self.plan(now_ms, queues, glist)

    def _bind_queues(self, queues: Mapping[str, Sequence[float]] | None) -> None:
        """For a caller (the simulator) whose ``queues`` keeps one sequence object per key (changed in
        place only) while bound: the queue scans of ``plan`` then read those objects without a lookup.
        None unbinds."""
        self._bound = queues
        self._bound_on = [] if queues is None else [tuple((queues.get(k), k, i) for k, i in pairs)
                                                    for pairs in self._pairs_on]

    def _scan(self, g: int, queues: Mapping[str, Sequence[float]]) -> Iterable[tuple[Sequence[float] | None, str,
                                                                                      _KeyInfo]]:
        """(queue or None, key, info) for GPU ``g``'s keys in order."""
        if queues is self._bound:
            return self._bound_on[g]
        get = queues.get
        return [(get(k), k, i) for k, i in self._pairs_on[g]]

    def _gpu_list(self, gpus: Iterable[int] | None) -> list[int]:
        if gpus is None:
            return list(range(self.num_gpus))
        out = sorted(gpus) if type(gpus) is set else sorted(set(gpus))
        if out and not (out[0] >= 0 and out[-1] < self.num_gpus):
            raise ValueError(f"gpus {out} must be in 0..{self.num_gpus - 1}")
        return out

    def next_wakeup_ms(self, now_ms: float) -> float | None:
        """When ``plan`` wants to run again even without a completion or arrival; None if never."""
        return None

    def _quiet(self, now_ms: float, gpu: int) -> bool:
        """True when ``plan(now_ms, queues, [gpu])`` with every queue of ``gpu`` empty would return
        nothing and change nothing, and ``next_wakeup_ms(now_ms)`` would name no time it has not
        named since the last ``plan``; a caller (the simulator) may then skip both. False: unknown."""
        return False

    def can_start(self, key: str) -> bool:
        """False when no run of stage ``key`` could start now (its instance or GPU% is taken).

        A caller may skip ``plan`` after an arrival at ``key`` when this is False: the completion that
        frees the instance or the GPU% triggers ``plan`` anyway. Raises ValueError for an unknown key.
        """
        self._info_of(key)
        return True

    def _info_of(self, key: str) -> _KeyInfo:
        info = self._kinfo.get(key)
        if info is None:
            raise ValueError(f"unknown queue key {key!r}")
        return info

    def stage_deadlines_ms(self) -> dict[str, float]:
        """Each stage's share of its app's deadline (given, or split by ``App.with_deadline_split``)."""
        out: dict[str, float] = {}
        for a in self.apps.values():
            split = a.with_deadline_split(self.profiles)
            out.update({split.key(s.name): float(s.deadline_ms or 0.0) for s in split.stages})
        return out

    def completed(self, dispatch: Dispatch, measured_ms: float) -> None:
        """Record that a run dispatch finished after ``measured_ms`` and learn from the error.

        Raises ValueError for a dispatch this scheduler is not running or a negative/NaN time.
        """
        if not measured_ms >= 0:
            raise ValueError(f"measured_ms must be >= 0, got {measured_ms}")
        gs = self._gpu_of.get(dispatch.gpu)
        did = dispatch.id
        if gs is None or gs.running.pop(did, None) is None:
            raise ValueError(f"dispatch {did} ({dispatch.key}) is not running on this scheduler")
        gs.pct -= dispatch.gpu_pct
        gs.busy.discard(self._ikey[dispatch.key])
        if self.probe_ms is not None:
            last = self._last_start.get(dispatch.key)
            if last is None or dispatch.start_ms > last:
                self._last_start[dispatch.key] = dispatch.start_ms
        lr = self.learn_rate
        if lr > 0:
            model, pct = dispatch.model, dispatch.gpu_pct
            base = self._base_cache.get((model, dispatch.batch_size, pct))
            if base is None:
                base = self._base_ms(model, dispatch.batch_size, pct)
            if base > 0:
                ratio = measured_ms / base  # clamped to [0.1, 10] (as min(10.0, max(0.1, ratio)))
                if ratio > 10.0:
                    ratio = 10.0
                elif not ratio > 0.1:
                    ratio = 0.1
                k = (model, pct)
                old = self._correction.get(k, 1.0)
                new = (1 - lr) * old + lr * ratio
                if new != old:
                    self._correction[k] = new
                    self._chain_cache.clear()
                    self._chain_by_batch.clear()
                    tab = self._pred_tabs.get(k)
                    if tab:
                        tab.clear()
        for r in gs.reservations:
            if r.upstream == did:
                r.ready = True
                self._ready.append(r)
                self._wake_version += 1

    def aborted(self, dispatch: Dispatch) -> None:
        """Forget a run that ended without a result (its instance crashed): free its GPU% and drop the
        slots reserved for its later stages; nothing is learned. ValueError if it is not running."""
        gs = self.gpus[dispatch.gpu] if 0 <= dispatch.gpu < self.num_gpus else None
        if gs is None or dispatch.id not in gs.running:
            raise ValueError(f"dispatch {dispatch.id} ({dispatch.key}) is not running on this scheduler")
        del gs.running[dispatch.id]
        gs.pct -= dispatch.gpu_pct
        gs.busy.discard(self._ikey[dispatch.key])
        gs.reservations = [r for r in gs.reservations if r.upstream != dispatch.id]
        self._ready = [r for r in self._ready if r.upstream != dispatch.id]
        self._wake_version += 1

    def running(self, gpu: int) -> list[Dispatch]:
        """Run dispatches started on ``gpu`` and not yet completed."""
        return list(self.gpus[gpu].running.values())

    # --- shared helpers ----------------------------------------------------------------------------
    def _dispatch(self, info: _KeyInfo, gpu: int, pct: int, batch: int, now: float, predicted: float) -> Dispatch:
        """A new run of ``info``'s stage, entered as running on ``gpu``."""
        # The same object as Dispatch(next id, app, stage, model, gpu, pct, batch, now, predicted) builds
        # (key == info.key), without the frozen dataclass's field-by-field object.__setattr__: this is
        # the schedulers' hot path.
        fields = info.run.copy()
        fields["id"] = next(self._ids)
        fields["gpu"] = gpu
        fields["gpu_pct"] = pct
        fields["batch_size"] = batch
        fields["start_ms"] = now
        fields["predicted_ms"] = predicted
        d = object.__new__(Dispatch)
        object.__setattr__(d, "__dict__", fields)
        gs = self.gpus[gpu]
        if gs.pct + pct > 100:
            raise RuntimeError(f"internal: GPU {gpu} would exceed 100% ({gs.pct} + {pct})")
        gs.running[d.id] = d
        gs.pct += pct
        gs.busy.add(info.ikey)
        return d

    def _stage_pct(self, app: App, stage: str) -> int:
        return self._stage_obj[(app.name, stage)].gpu_pct

    def _min_chain_ms(self, app: App, stage: str, *, sequential: bool) -> float:
        """Predicted time from starting ``stage`` with batch 1 to the end of its slowest continuation."""
        s = self._stage_obj[(app.name, stage)]
        own = self.predict_ms(s.model, self._min_batch(s.model), self._stage_pct(app, stage))
        nxt = [self._min_chain_ms(app, n, sequential=sequential) for n in self._succ[(app.name, stage)]]
        if not nxt:
            return own
        return own + (sum(nxt) if sequential else max(nxt))

    def _rejects(self, now: float, queues: Mapping[str, Sequence[float]], consumed: dict[str, int],
                 gpus: list[int], *, sequential: bool) -> list[Dispatch]:
        out: list[Dispatch] = []
        chains = self._chain_cache
        bound = queues is self._bound
        for g in gpus:
            for q, key, info in (self._bound_on[g] if bound else self._scan(g, queues)):
                if not q:
                    continue
                chain = chains.get(key)
                if chain is not None and q[0] >= now + chain - _EPS:
                    continue  # _reject_head's own first test: nothing to reject
                if self.probe_ms is not None:
                    p = self._probe(now, q, info, consumed, sequential)
                    if p is not None:
                        out.append(p)
                d = self._reject_head(now, q, info.app, info.stage, key, consumed, sequential)
                if d is not None:
                    out.append(d)
        return out

    def _probe(self, now: float, q: Sequence[float], info: _KeyInfo, consumed: dict[str, int],
               sequential: bool) -> Dispatch | None:
        """A probe run of ``info``'s queue head, if it is about to be rejected and a probe is due (``probe_ms``)."""
        key = info.key
        if info.ikey in info.gs.busy or not self.can_start(key):
            return None
        if any(r.key == key for r in info.gs.reservations):
            return None
        last = self._last_start.get(key)
        if last is not None and now - last < self.probe_ms:  # type: ignore[operator]
            return None
        c = consumed.get(key, 0)
        chain = self._chain_cache.get(key)
        if chain is None:
            chain = self._chain_cache[key] = self._min_chain_ms(info.app, info.stage, sequential=sequential)
        if len(q) <= c or q[c] >= now + chain - _EPS:
            return None  # not doomed: the ordinary launch decides
        pct = self._stage_pct(info.app, info.stage)
        if info.gs.pct + pct > 100:
            return None
        consumed[key] = c + info.lo if len(q) >= c + info.lo else len(q)
        batch = consumed[key] - c
        self._last_start[key] = now
        self.probes += 1
        return self._dispatch(info, info.gpu, pct, batch, now, self.predict_ms(info.model, batch, pct))

    def _reject_head(self, now: float, q: Sequence[float], app: App, stage: str, key: str,
                     consumed: dict[str, int], sequential: bool) -> Dispatch | None:
        chain = self._chain_cache.get(key)
        if chain is None:
            chain = self._chain_cache[key] = self._min_chain_ms(app, stage, sequential=sequential)
        too_soon = (now + chain) - _EPS  # deadlines before this cannot be met any more
        c0 = consumed.get(key, 0)  # taken by a probe just before
        if len(q) <= c0 or q[c0] >= too_soon:
            return None
        n = c0
        while n < len(q) and q[n] < too_soon:
            n += 1
        consumed[key] = n
        # Dispatch(next id, app, stage, model, placement, _stage_pct, n, now, 0.0, "reject") (see _dispatch)
        info = self._kinfo[key]
        fields = info.run.copy()
        fields["id"] = next(self._ids)
        fields["gpu_pct"] = self._stage_pct(app, stage)
        fields["batch_size"] = n - c0
        fields["start_ms"] = now
        fields["predicted_ms"] = 0.0
        fields["action"] = "reject"
        d = object.__new__(Dispatch)
        object.__setattr__(d, "__dict__", fields)
        return d


class SpatioTemporalScheduler(Scheduler):
    """Spatial (concurrent GPU% slices) and temporal (rounds, reservations, gap fills) scheduling."""

    name = "spatiotemporal"
    _versioned_wakeups = True

    def __init__(self, apps: Sequence[App], profiles: Mapping[str, Profile], *, num_gpus: int = 1,
                 round_ms: float = 30.0, stat: Stat = "p50", learn_rate: float = 0.2,
                 max_batch: int | None = None, route_margin_sigma: float = 1.0,
                 instances: Mapping[str, str] | None = None, probe_ms: float | None = None,
                 exclusive: Sequence[Sequence[str]] = ()) -> None:
        super().__init__(apps, profiles, num_gpus=num_gpus, round_ms=round_ms, stat=stat,
                         learn_rate=learn_rate, max_batch=max_batch, instances=instances, probe_ms=probe_ms,
                         exclusive=exclusive)
        if not route_margin_sigma >= 0:
            raise ValueError(f"route_margin_sigma must be >= 0, got {route_margin_sigma}")
        self.route_margin_sigma = route_margin_sigma
        self._round = -1
        self._launched: set[str] = set()
        self._route_frac: dict[str, float] = {}

    def can_start(self, key: str) -> bool:
        """False when ``key``'s instance is running or its GPU% is not free now (see ``Scheduler``)."""
        try:
            info = self._kinfo[key]
        except KeyError:
            info = self._info_of(key)  # raises
        gs = info.gs
        return gs.pct + info.pct <= 100 and info.ikey not in gs.busy

    def route_fraction(self, key: str) -> float:
        """Learned fraction of a predecessor's batch that reaches stage ``key`` (1.0 until observed)."""
        return self._route_frac.get(key, 1.0)

    def _branch_batch(self, key: str, batch: int) -> int:
        f = self._route_frac.get(key, 1.0)  # route_fraction(key)
        var = f * (1 - f)
        hi = f + self.route_margin_sigma * math.sqrt((0.0 if var < 0.0 else var) / batch)  # max(var, 0.0)
        # max(1, min(batch, ceil(batch * min(1.0, hi) - _EPS)))
        nb = math.ceil(batch * (hi if hi < 1.0 else 1.0) - _EPS)
        if nb > batch:
            nb = batch
        return nb if nb > 1 else 1

    def next_wakeup_ms(self, now_ms: float) -> float | None:
        """The next round start, or an earlier start of a ready reservation still waiting for its slot."""
        nxt = (math.floor(now_ms / self.round_ms + _EPS) + 1) * self.round_ms
        for r in self._ready:
            if now_ms < r.start < nxt:
                nxt = r.start
        return nxt

    def _quiet(self, now_ms: float, gpu: int) -> bool:
        # Still the last plan's round and no reservation ready on the GPU: with its queues empty,
        # plan has nothing to reject, start or launch there, and the wakeups stay what they were (the
        # ready reservations they depend on change only in plans and completions of their own GPU).
        for r in self.gpus[gpu].reservations:
            if r.ready:
                return False
        return math.floor(now_ms / self.round_ms + _EPS) == self._round

    def plan(self, now_ms: float, queues: Mapping[str, Sequence[float]],
             gpus: Iterable[int] | None = None) -> list[Dispatch]:
        """See the module docstring: rejects, ready reservations, round launches, then gap fills."""
        # (a set of valid GPUs, the common case, needs no more than _gpu_list's sort)
        return self._plan_gpus(now_ms, queues,
                               sorted(gpus) if type(gpus) is set and gpus <= self._gpu_ids else self._gpu_list(gpus))

    def _plan_gpus(self, now_ms: float, queues: Mapping[str, Sequence[float]], glist: list[int]) -> list[Dispatch]:
        rnd = math.floor(now_ms / self.round_ms + _EPS)
        if rnd != self._round:
            self._round = rnd
            self._launched.clear()
            self._wake_version += 1
            glist = list(range(self.num_gpus))  # a new round concerns every GPU
        consumed: dict[str, int] = {}
        out: list[Dispatch] = []
        chains = self._chain_cache
        launched = self._launched
        bound = queues is self._bound
        for g in glist:
            gs = self.gpus[g]
            # One scan of the GPU's queues: reject what cannot make it, collect what waits.
            waiting: list[tuple[float, int, _KeyInfo, Sequence[float]]] = []  # (head, app index, info, queue)
            for q, key, info in (self._bound_on[g] if bound else self._scan(g, queues)):
                if not q:
                    continue
                chain = chains.get(key)
                if chain is not None and q[0] >= now_ms + chain - _EPS:
                    waiting.append((q[0], info.index, info, q))  # nothing to reject (_reject_head's own test)
                    continue
                if self.probe_ms is not None:
                    p = self._probe(now_ms, q, info, consumed, False)
                    if p is not None:
                        out.append(p)
                        launched.add(info.app_name)
                rej = self._reject_head(now_ms, q, info.app, info.stage, key, consumed, False)
                if rej is not None:
                    out.append(rej)
                c = consumed.get(key, 0)
                if len(q) > c:
                    waiting.append((q[c], info.index, info, q))
            for r in gs.reservations:
                if r.ready:  # only ready slots can start (or learn, or go)
                    out += self._start_reservations(g, gs, now_ms, queues, consumed)
                    break
            if gs.pct >= 100 or not waiting:
                continue
            reserved = {r.key for r in gs.reservations} if gs.reservations else _NONE
            if len(waiting) == 1:
                # The two passes below come to one try: a second try would find the same state.
                _, _, info, q = waiting[0]
                key = info.key
                if key in reserved or info.ikey in gs.busy:
                    continue
                c = consumed.get(key, 0)
                hi = len(q) - c
                if hi <= 0:
                    continue
                if not gs.reservations and not info.succ:
                    # _try_launch's fast path, inlined (the common case)
                    pct = info.pct
                    if gs.pct + pct > 100:
                        continue
                    if hi > info.cap:
                        hi = info.cap
                    lo = info.lo
                    b = 0
                    tab = info.pred
                    limit = (q[c] - now_ms) + _EPS
                    if lo == hi:  # one candidate: the search below would make this one probe
                        p = tab.get(lo)
                        if p is None:
                            p = self._pred(tab, info.model, lo, pct)
                        if p <= limit:
                            b = lo
                    else:
                        while lo <= hi:
                            mid = (lo + hi) // 2
                            p = tab.get(mid)
                            if p is None:
                                p = self._pred(tab, info.model, mid, pct)
                            if p <= limit:
                                b, lo = mid, mid + 1
                            else:
                                hi = mid - 1
                    if b:
                        consumed[key] = c + b
                        # self._dispatch(info, g, pct, b, now_ms, tab[b]), inlined (gs.pct + pct <= 100 held)
                        fields = info.run.copy()
                        fields["id"] = did = next(self._ids)
                        fields["gpu"] = g
                        fields["gpu_pct"] = pct
                        fields["batch_size"] = b
                        fields["start_ms"] = now_ms
                        fields["predicted_ms"] = tab[b]
                        d = object.__new__(Dispatch)
                        object.__setattr__(d, "__dict__", fields)
                        gs.running[did] = d
                        gs.pct += pct
                        gs.busy.add(info.ikey)
                        out.append(d)
                        launched.add(info.app_name)
                    continue
                d = self._try_launch(g, info, now_ms, queues, consumed)
                if d is not None:
                    out.append(d)
                    launched.add(info.app_name)
                continue
            waiting.sort(key=_deadline_then_app)  # earliest deadline first, then app order (stable)
            # First the apps that have not launched in this round (their entry stage), then anything.
            failed: set[str] = set()  # keys whose try failed since the last launch: a retry would too
            room = 100 - self._min_pct_on[g]  # beyond this GPU%, no stage of the GPU fits any more
            for first_pass in (True, False):
                if gs.pct > room:
                    break  # every stage below would fail the GPU% test
                for _, _, info, q in waiting:
                    if first_pass and (not info.is_entry or info.app_name in launched):
                        continue
                    if gs.pct + info.pct > 100:
                        continue  # _try_launch's first test: no room now (and none comes during a plan)
                    key = info.key
                    if key in reserved or info.ikey in gs.busy or len(q) <= consumed.get(key, 0):
                        continue
                    if key in failed:
                        continue
                    d = self._try_launch(g, info, now_ms, queues, consumed)
                    if d is None:
                        failed.add(key)
                        continue
                    out.append(d)
                    launched.add(info.app_name)
                    failed.clear()
                    reserved = {r.key for r in gs.reservations}
                    if gs.pct > room:
                        break
        return out

    # --- pieces of plan ----------------------------------------------------------------------------
    def _start_reservations(self, g: int, gs: _GpuState, now: float, queues: Mapping[str, Sequence[float]],
                            consumed: dict[str, int]) -> list[Dispatch]:
        out: list[Dispatch] = []
        for r in sorted(gs.reservations, key=_start_of):
            if not r.ready:
                continue
            q = queues.get(r.key, ())
            c = consumed.get(r.key, 0)
            avail = len(q) - c
            if r.upstream_batch:
                frac = (avail if avail > 0 else 0) / r.upstream_batch  # min(1.0, max(avail, 0) / batch)
                if frac > 1.0:
                    frac = 1.0
                old = self._route_frac.get(r.key, 1.0)
                self._route_frac[r.key] = (1 - self.learn_rate) * old + self.learn_rate * frac
                r.upstream_batch = 0  # learn once per slot
            if avail <= 0:
                gs.reservations.remove(r)  # the predecessor routed nothing here
                self._ready.remove(r)
                self._wake_version += 1
                continue
            info = self._kinfo[r.key]
            if info.ikey in gs.busy:
                continue
            model = info.model
            tab = info.pred if r.pct == info.pct else self._pred_tab(model, r.pct)
            batch = min(avail, info.cap)
            while batch > r.batch_size and now + self._pred(tab, model, batch, r.pct) > q[c] + _EPS:
                batch -= 1
            pred = self._pred(tab, model, batch, r.pct)
            if now + _EPS < r.start and not _fits(self._intervals(gs, now, exclude=r), r.pct, now, now + pred,
                                                  info.ikey):
                continue  # early, and starting early would collide: wait for the reserved start
            if gs.pct + r.pct > 100:
                continue  # the slot slipped (a predecessor or neighbour overran); retry on completion
            gs.reservations.remove(r)
            self._ready.remove(r)
            self._wake_version += 1
            consumed[r.key] = consumed.get(r.key, 0) + batch
            out.append(self._dispatch(info, g, r.pct, batch, now, pred))
        return out

    def _intervals(self, gs: _GpuState, now: float, exclude: _Reservation | None = None) -> list[_Interval]:
        ikey = self._ikey
        soonest = now + _EPS
        ivs = [(d.start_ms, max(d.start_ms + d.predicted_ms, soonest), d.gpu_pct, ikey[d.key])
               for d in gs.running.values()]
        for r in gs.reservations:
            if r is exclude:
                continue
            # A slot whose start has passed without starting still needs its full length from now.
            shift = max(0.0, now - r.start)
            ivs.append((r.start + shift, r.end + shift, r.pct, ikey[r.key]))
        return ivs

    def _try_launch(self, g: int, info: _KeyInfo, now: float, queues: Mapping[str, Sequence[float]],
                    consumed: dict[str, int]) -> Dispatch | None:
        gs = self.gpus[g]
        pct = info.pct
        if gs.pct + pct > 100 or info.ikey in gs.busy:
            return None
        key = info.key
        q = queues.get(key, ())
        c = consumed.get(key, 0)
        lo, hi = info.lo, len(q) - c
        if hi > info.cap:
            hi = info.cap
        if hi < lo:
            return None
        deadline = q[c]
        if not gs.reservations and not info.succ:
            # Fast path, same answer: nothing is reserved ahead and the running slices only end, so
            # a stage that fits now fits throughout; only the deadline bounds the batch.
            # The largest batch predicted to end by the deadline (binary search, as if the prediction
            # grew with the batch).
            b = 0
            tab = info.pred
            limit = (deadline - now) + _EPS
            while lo <= hi:
                mid = (lo + hi) // 2
                p = tab.get(mid)
                if p is None:
                    p = self._pred(tab, info.model, mid, pct)
                if p <= limit:
                    b, lo = mid, mid + 1
                else:
                    hi = mid - 1
            if not b:
                return None
            consumed[key] = c + b
            return self._dispatch(info, g, pct, b, now, tab[b])
        ivs = self._intervals(gs, now)
        best: tuple[int, list[_Reservation], float] | None = None
        # Binary search for the largest batch whose chain fits; every candidate is checked in full.
        while lo <= hi:
            mid = (lo + hi) // 2
            placed = self._place_chain(ivs, info, mid, now, deadline, g)
            if placed is None:
                hi = mid - 1
            else:
                best = (mid, *placed)
                lo = mid + 1
        if best is None:
            return None
        batch, reservations, pred = best
        consumed[key] = c + batch
        d = self._dispatch(info, g, pct, batch, now, pred)
        for r in reservations:
            r.upstream = d.id
            r.upstream_batch = batch
        gs.reservations.extend(reservations)
        return d

    def _place_chain(self, ivs: list[_Interval], info: _KeyInfo, batch: int, now: float,
                     deadline: float, g: int) -> tuple[list[_Reservation], float] | None:
        pct = info.pct
        pred = self._pred(info.pred, info.model, batch, pct)
        if now + pred > deadline + _EPS or not _fits(ivs, pct, now, now + pred, info.ikey):
            return None
        work = list(ivs)
        work.append((now, now + pred, pct, info.ikey))
        res: list[_Reservation] = []
        end0 = now + pred
        frontier = [(n, end0) for n in info.nexts]
        limit = deadline + _EPS
        while frontier:
            ni, not_before = frontier.pop(0)
            nb = self._branch_batch(ni.key, batch)
            if nb > ni.cap:
                nb = ni.cap
            if nb < ni.lo:
                return None
            dur = self._pred(ni.pred, ni.model, nb, ni.pct)
            start = _earliest_fit(work, ni.pct, dur, not_before, ni.ikey)
            if start + dur > limit:
                return None
            work.append((start, start + dur, ni.pct, ni.ikey))
            res.append(_Reservation(ni.key, ni.app_name, ni.stage, g, ni.pct, nb, start, start + dur, 0))  # upstream: set on launch
            if ni.nexts:
                frontier.extend((n, start + dur) for n in ni.nexts)
        return res, pred


_NONE: frozenset[str] = frozenset()
_start_of = operator.attrgetter("start")


_deadline_then_app = operator.itemgetter(0, 1)  # the waiting sort key: (deadline, app index)


def _occupancy(ivs: list[_Interval], t: float) -> int:
    """GPU% of ``ivs`` busy at ``t``."""
    upto = t + _EPS
    occ = 0
    for start, end, pct, _ in ivs:
        if start <= upto and t < end - _EPS:
            occ += pct
    return occ


def _fits(ivs: list[_Interval], pct: int, start: float, end: float, key: str) -> bool:
    """True if ``pct`` more fits on top of ``ivs`` throughout [start, end) and ``key`` is not busy then.

    The GPU% is checked at ``start`` and at every interval start inside, with ``_occupancy``. Every
    interval that counts at one of those points starts by ``max(start, end - _EPS) + _EPS`` and ends
    after ``start`` (as the tests below round), so when those together leave room, all points do.
    """
    before = end - _EPS
    upto = (start if start > before else before) + _EPS
    room = 100 - pct
    bound = 0
    for s, e, p, k in ivs:
        if start < e - _EPS:
            if k == key and s < before:
                return False
            if s <= upto:
                bound += p
    if bound <= room:
        return True
    if _occupancy(ivs, start) > room:
        return False
    for s, _, _, _ in ivs:  # noqa: SIM110 - a plain loop: all() over a generator costs more here
        if start < s < before and _occupancy(ivs, s) > room:
            return False
    return True


def _earliest_fit(ivs: list[_Interval], pct: int, dur: float, not_before: float, key: str) -> float:
    """The earliest start >= not_before where ``pct`` fits for ``dur`` (ends of intervals are candidates)."""
    if _fits(ivs, pct, not_before, not_before + dur, key):
        return not_before  # the first candidate
    ends = [e for _, e, _, _ in ivs]
    for t in sorted({e for e in ends if e > not_before}):  # the other candidates, in order
        if _fits(ivs, pct, t, t + dur, key):
            return t
    return max([not_before, *ends])


class TemporalScheduler(Scheduler):
    """Round-robin with exclusive GPU access and Triton-style batching (the paper's baseline)."""

    name = "temporal"

    def __init__(self, apps: Sequence[App], profiles: Mapping[str, Profile], *, num_gpus: int = 1,
                 round_ms: float = 30.0, stat: Stat = "p50", learn_rate: float = 0.2,
                 max_batch: int | None = None, instances: Mapping[str, str] | None = None,
                 probe_ms: float | None = None, exclusive: Sequence[Sequence[str]] = ()) -> None:
        super().__init__(apps, profiles, num_gpus=num_gpus, round_ms=round_ms, stat=stat,
                         learn_rate=learn_rate, max_batch=max_batch, instances=instances, probe_ms=probe_ms,
                         exclusive=exclusive)
        for a in apps:
            for s in a.stages:
                if self.profiles[s.model].gpu_pcts[-1] < 100:
                    raise ValueError(f"temporal scheduling runs {s.model!r} at 100% GPU, but its profile "
                                     f"stops at {self.profiles[s.model].gpu_pcts[-1]}%")
        self._turn = [0] * self.num_gpus
        self._order = self._apps_on
        self._entries_on = [[self._kinfo[a.key(a.entry.name)] for a in order] for order in self._order]
        self._later_on = [[info for info in infos if not info.is_entry] for infos in self._kinfo_on]
        self._tab100 = {k: self._pred_tab(info.model, 100) for k, info in self._kinfo.items()}

    def _stage_pct(self, app: App, stage: str) -> int:
        return 100

    def _quiet(self, now_ms: float, gpu: int) -> bool:
        return True  # no queued work on the GPU: no reject, no turn; and no wakeups ever

    def can_start(self, key: str) -> bool:
        """False while ``key``'s GPU runs anything (exclusive access; see ``Scheduler``)."""
        try:
            info = self._kinfo[key]
        except KeyError:
            info = self._info_of(key)  # raises
        return not info.gs.running

    def plan(self, now_ms: float, queues: Mapping[str, Sequence[float]],
             gpus: Iterable[int] | None = None) -> list[Dispatch]:
        """Rejects, then on every idle GPU: a DAG's pending later stage, else the next app's turn."""
        # (a set of valid GPUs, the common case, needs no more than _gpu_list's sort)
        return self._plan_gpus(now_ms, queues,
                               sorted(gpus) if type(gpus) is set and gpus <= self._gpu_ids else self._gpu_list(gpus))

    def _plan_gpus(self, now_ms: float, queues: Mapping[str, Sequence[float]], glist: list[int]) -> list[Dispatch]:
        consumed: dict[str, int] = {}
        out = self._rejects(now_ms, queues, consumed, glist, sequential=True)
        for g in glist:
            gs = self.gpus[g]
            if gs.running or not self._order[g]:
                continue
            d = self._next(g, now_ms, queues, consumed)
            if d is not None:
                out.append(d)
        return out

    def _next(self, g: int, now: float, queues: Mapping[str, Sequence[float]],
              consumed: dict[str, int]) -> Dispatch | None:
        # Later stages of DAG apps first: a started request finishes before another app's turn.
        get = queues.get
        for info in self._later_on[g]:
            if not get(info.key):
                continue  # _launch finds nothing to run
            d = self._launch(g, info, now, queues, consumed)
            if d is not None:
                return d
        entries = self._entries_on[g]
        n = len(entries)
        turn = self._turn[g]
        for i in range(n):
            info = entries[(turn + i) % n]
            if not get(info.key):
                continue
            d = self._launch(g, info, now, queues, consumed)
            if d is not None:
                self._turn[g] = (turn + i + 1) % n
                return d
        return None

    def _chain_ms(self, info: _KeyInfo, batch: int) -> float:
        """Predicted sequential time of ``info``'s stage and every stage after it, all at ``batch``."""
        k = (info.key, batch)
        v = self._chain_by_batch.get(k)
        if v is None:
            own = self._pred(self._tab100[info.key], info.model, min(batch, info.cap), 100)
            v = self._chain_by_batch[k] = own + sum(self._chain_ms(self._kinfo[info.app.key(n)], batch)
                                                    for n in info.succ)
        return v

    def _launch(self, g: int, info: _KeyInfo, now: float, queues: Mapping[str, Sequence[float]],
                consumed: dict[str, int]) -> Dispatch | None:
        key = info.key
        q = queues.get(key, ())
        c = consumed.get(key, 0)
        hi = min(len(q) - c, info.cap)
        lo = info.lo
        if hi < lo:
            return None
        limit = q[c] + _EPS
        best = 0
        while lo <= hi:
            mid = (lo + hi) // 2
            if now + self._chain_ms(info, mid) <= limit:
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        if not best:
            return None
        consumed[key] = c + best
        return self._dispatch(info, g, 100, best, now, self._pred(self._tab100[key], info.model, best, 100))


SCHEDULERS: dict[str, type[Scheduler]] = {
    SpatioTemporalScheduler.name: SpatioTemporalScheduler,
    TemporalScheduler.name: TemporalScheduler,
}


def make_scheduler(name: str, apps: Sequence[App], profiles: Mapping[str, Profile], **kw: object) -> Scheduler:
    """The scheduler called ``name`` ("spatiotemporal" or "temporal") over ``apps``; kw as ``Scheduler``."""
    cls = SCHEDULERS.get(name)
    if cls is None:
        raise ValueError(f"unknown scheduler {name!r}; choose one of {sorted(SCHEDULERS)}")
    return cls(apps, profiles, **kw)
