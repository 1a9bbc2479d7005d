"""CPU overflow on a node (SIR+, issue #18): each app's CPU pool and the per-request choice of device.

The node calls ``start_overflow(cfg, profiles)`` once at start. For every app with ``overflow: cpu``
it gets an ``OverflowPool`` (a core set of ``overflow_cores`` cores, disjoint from the other pools and
from the ``node.overflow_reserved_cores`` lowest cores, where the ingest runs) to start the app's CPU
instance on, and an ``AppOverflow``: the decision point the dispatcher asks for each request (or
batch) before queueing it. ``AppOverflow.route`` predicts the finish on the accelerator (its
profile at the app's GPU%, the requests ahead of it) and on the CPU pool (its CPU profile at the
pool's cores) and answers ``"gpu"`` or ``"cpu"`` (``gpuprims.coexec.OverflowRouter``); ``finished``
feeds measured execution times back so the prediction follows reality (a busy accelerator, a
profile measured on another machine). It counts what it routed where. Thread-safe; no I/O.

The wiring into the node (start the CPU instance with the pool's affinity beside the accelerator
instances, call ``route``/``finished`` in the dispatch path) is the node's; see
docs/cpu-coexecution.md for the exact calls.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apps.zoo.names import canonical_name
from gpuprims.coexec.graph import CPU, GPU
from gpuprims.coexec.overflow import OverflowRouter, RouteDecision
from gpuprims.cpushare import CpuShare, available_cores
from gpuprims.profile.format import Profile, ProfileError, load_profile
from orchestrator.config.schema import AppConfig, NodeConfig
from orchestrator.control.records import InstanceStats, Role
from orchestrator.node.state import InstanceState


class OverflowSetupError(ValueError):
    """Overflow cannot be set up as configured (missing profile, not enough cores); names the app."""


@dataclass(frozen=True)
class OverflowPool:
    """The CPU pool of one app: the cores its CPU instance is pinned to and its alpha."""

    app: str
    cores: tuple[int, ...]
    alpha_ms: float

    def env(self) -> dict[str, str]:
        """Thread-count variables for the CPU instance (set before torch is imported)."""
        n = str(len(self.cores))
        return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}


def plan_pools(cfg: NodeConfig, cores: Sequence[int] | None = None) -> dict[str, OverflowPool]:
    """Disjoint core sets for every overflow app, taken from the highest cores down (module docstring).

    Raises OverflowSetupError naming the app that does not fit (config validation refuses that earlier).
    """
    avail = sorted(cores) if cores is not None else available_cores()
    reserved = cfg.node.overflow_reserved_cores
    free = avail[reserved:]
    out: dict[str, OverflowPool] = {}
    for a in cfg.apps:
        n = a.cpu_overflow_cores
        if not n:
            continue
        if n > len(free):
            raise OverflowSetupError(f"app {a.name!r}: overflow_cores={n} but only {len(free)} cores are left "
                                 f"(of {avail}, {reserved} reserved, the rest given to earlier apps)")
        take, free = free[-n:], free[:-n]
        out[a.name] = OverflowPool(a.name, tuple(take), a.overflow_alpha_ms)
    return out


def _batch_model(prof: Profile, pct: float) -> Callable[[int], float]:
    """Latency (ms) of a batch at ``pct`` from a profile, linear beyond its largest measured batch."""
    lo, hi = prof.gpu_pcts[0], prof.gpu_pcts[-1]
    p = min(max(pct, lo), hi)
    bmin, bmax = prof.batch_sizes[0], prof.batch_sizes[-1]

    def model(batch: int) -> float:
        if batch <= bmin:
            return prof.latency_ms(bmin, p) * batch / bmin
        if batch > bmax:
            return prof.latency_ms(bmax, p) * batch / bmax
        return prof.latency_ms(batch, p)

    return model


class AppOverflow:
    """One app's decision point (module docstring). ``route`` counts the work as in flight on the
    device it picked until ``finished`` reports it; queue lengths the node measures may be given
    instead."""

    def __init__(self, app: AppConfig, pool: OverflowPool, accel: Profile, cpu: Profile, *,
                 accel_workers: int = 1) -> None:
        pct = app.gpu_pct if app.gpu_pct != "auto" else accel.gpu_pcts[-1]
        cpu_pct = 100.0 * len(pool.cores) / (cpu.cpu_cores or len(pool.cores))
        self.app = app.name
        self.pool = pool
        self._router = OverflowRouter(_batch_model(accel, pct), _batch_model(cpu, cpu_pct), alpha_ms=pool.alpha_ms,
                                      accel_workers=accel_workers, cpu_workers=1)
        self._lock = threading.Lock()
        self._in_flight = {GPU: 0, CPU: 0}
        self.routed = {GPU: 0, CPU: 0}
        self.closed = False

    def route(self, *, batch: int = 1, accel_queue: int | None = None, cpu_queue: int | None = None) -> RouteDecision:
        """Where this request (or batch of ``batch``) goes; marks it in flight there. After ``close``
        everything goes to the accelerator (the CPU instance may be gone)."""
        with self._lock:
            if self.closed:
                d = RouteDecision(GPU, self._router.service_ms(GPU, batch), float("inf"))
                self._in_flight[GPU] += batch
                self.routed[GPU] += batch
                return d
            d = self._router.route(accel_queue=self._in_flight[GPU] if accel_queue is None else accel_queue,
                                   cpu_queue=self._in_flight[CPU] if cpu_queue is None else cpu_queue, batch=batch)
            self._in_flight[d.device] += batch
            self.routed[d.device] += batch
            return d

    def finished(self, device: str, measured_ms: float | None, *, batch: int = 1) -> None:
        """Work routed to ``device`` ended; ``measured_ms`` (its execution time) updates the prediction.
        None (an error, no timing) only releases it. Raises ValueError for an unknown device."""
        if device not in self._in_flight:
            raise ValueError(f"device must be {GPU!r} or {CPU!r}, got {device!r}")
        with self._lock:
            self._in_flight[device] = max(0, self._in_flight[device] - batch)
            if measured_ms is not None:
                self._router.observe(device, measured_ms, batch)

    def observe(self, device: str, measured_ms: float, *, batch: int = 1) -> None:
        """Fold a measured execution time of ``batch`` requests on ``device`` into its model (as
        ``finished`` does, without counting anything as released)."""
        with self._lock:
            self._router.observe(device, measured_ms, batch)

    def service_ms(self, device: str, batch: int = 1) -> float:
        """Predicted execution time of ``batch`` requests on ``device`` (profile times measured scale)."""
        with self._lock:
            return self._router.service_ms(device, batch)

    def close(self) -> None:
        """From now on every request goes to the accelerator; idempotent."""
        with self._lock:
            self.closed = True

    def in_flight(self) -> dict[str, int]:
        """Requests routed and not yet finished, per device."""
        with self._lock:
            return dict(self._in_flight)


@dataclass
class OverflowHandle:
    """What ``start_overflow`` returns: pools and decision points by app name; ``close()`` ends it."""

    pools: dict[str, OverflowPool]
    apps: dict[str, AppOverflow] = field(default_factory=dict)
    closed: bool = False

    def app(self, name: str) -> AppOverflow | None:
        """The decision point of app ``name``, or None when it has no CPU overflow."""
        return self.apps.get(name)

    def close(self) -> None:
        """Stop routing to the CPU pools: later ``route`` calls answer the accelerator; idempotent."""
        self.closed = True
        for a in self.apps.values():
            a.close()

    def __enter__(self) -> OverflowHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_overflow(cfg: NodeConfig, profiles: Iterable[Profile], *, cores: Sequence[int] | None = None,
                   accel_workers: Mapping[str, int] | None = None) -> OverflowHandle:
    """Pools and decision points for every ``overflow: cpu`` app of ``cfg`` (module docstring).

    ``profiles`` must hold, per overflowing app's model, one accelerator profile and one CPU profile
    (``Profile.kind``; ``gpuprims-profile MODEL --device cpu --cores N`` makes the latter). A DAG app
    is routed on its entry stage's model. Raises OverflowSetupError naming the app and the missing profile.
    """
    by_kind: dict[tuple[str, str], Profile] = {}
    for p in profiles:
        by_kind.setdefault((p.model, p.kind), p)
    pools = plan_pools(cfg, cores)
    handle = OverflowHandle(pools)
    for a in cfg.apps:
        if a.name not in pools:
            continue
        model = a.model if a.stages is None else a.stages[0].model
        assert model is not None
        missing = [k for k in ("accelerator", "cpu") if (model, k) not in by_kind]
        if missing:
            hint = f"gpuprims-profile {model} --device cpu --cores {len(pools[a.name].cores)}" if "cpu" in missing else \
                f"gpuprims-profile {model} --device accelerator"
            raise OverflowSetupError(f"app {a.name!r}: overflow: cpu needs {' and '.join(missing)} profile(s) of model "
                                 f"{model!r} (make one with: {hint})")
        workers = (accel_workers or {}).get(a.name, a.instances if isinstance(a.instances, int) else 1)
        handle.apps[a.name] = AppOverflow(a, pools[a.name], by_kind[(model, "accelerator")], by_kind[(model, "cpu")],
                                          accel_workers=workers)
    return handle


# ---- the running node ------------------------------------------------------------------------------

#: How often the node refreshes the ingest's cost models from measured execution times.
COST_UPDATE_S = 0.5
#: Counters of an instance kept per device when it goes (the status split).
SPLIT_COUNTERS = ("received", "ok", "deadline_missed", "errors")


def device_of(role: Role) -> str:
    """The device an instance of ``role`` serves on: ``cpu`` for the overflow instance, else ``gpu``."""
    return CPU if role == Role.OVERFLOW else GPU


def load_cpu_profiles(dirs: Iterable[str | None]) -> dict[str, Profile]:
    """CPU profiles (``device_kind: cpu``) in the given profile directories, by model name."""
    out: dict[str, Profile] = {}
    for d in dirs:
        if not d:
            continue
        for path in sorted(Path(d).glob("*.json")):
            try:
                prof = load_profile(path)
            except ProfileError as e:
                raise OverflowSetupError(f"{path}: {e}") from e
            if prof.kind == "cpu":
                out.setdefault(prof.model, prof)
    return out


@dataclass
class _Window:
    """The last heartbeat counters of one instance the cost update used."""

    busy_ms: float
    executed: int
    batches: int
    t: float


class NodeOverflow:
    """SIR+ request overflow on a running node (docs/cpu-coexecution.md).

    Made by :meth:`plan` before any instance starts (refuses a missing CPU profile or pools that do
    not fit the cores); the supervisor starts one CPU instance per pool (role ``overflow``, pinned to
    the pool's cores) and replaces it when it dies. The ingest routes each request natively to the
    queue with the earliest predicted finish, ``fixed_us + per_request_us * (queued + 1)``
    (``Ingest.set_cost``); :meth:`update`, called from the node's loop every ``COST_UPDATE_S``, sets
    those costs per queue from the profiles corrected by the execution times the instances report:

    - ``per_request_us``: a full batch's time divided by its size (how fast the queue drains);
    - ``fixed_us``: what a lone request costs beyond that, plus half a batch when the instance is
      busy (weighted by how busy it was), plus, on the CPU, transfer and ``alpha`` (SIR+'s margin).

    :meth:`split` is the per-device part of ``status`` (requests routed to and answered by each device).
    """

    def __init__(self, cfg: NodeConfig, pools: dict[str, OverflowPool], cpu_profiles: Mapping[str, Profile], *,
                 transfer_ms: float = 0.0, update_s: float = COST_UPDATE_S) -> None:
        self.cfg = cfg
        self.pools = pools
        self.cpu_profiles = dict(cpu_profiles)
        self.transfer_ms = transfer_ms
        self.update_s = update_s
        self.apps: dict[str, AppOverflow] = {}
        self.seeded_from_cpu: set[str] = set()  # apps whose accelerator model starts from the CPU profile
        self.failures: dict[str, int] = dict.fromkeys(pools, 0)  # CPU instances that died, per app
        self.retired: dict[str, dict[str, dict[str, int]]] = {a: {GPU: {}, CPU: {}} for a in pools}
        self.costs: dict[str, dict[str, tuple[float, float]]] = {}  # app -> instance -> (fixed_us, per_us)
        self._windows: dict[str, _Window] = {}
        self._busy: dict[str, tuple[float, float]] = {}  # instance -> (busy fraction, mean batch ms) last measured
        self._costed: set[int] = set()
        self._next_update = 0.0
        self._lock = threading.Lock()

    @classmethod
    def plan(cls, cfg: NodeConfig, *, cores: Sequence[int] | None = None) -> NodeOverflow | None:
        """The node's overflow, or None when no app has ``overflow: cpu``. Raises OverflowSetupError
        naming the app when its pool does not fit or no CPU profile of its model is in
        ``node.overflow_profiles`` (or ``node.profiles``), with the command that makes one."""
        if not any(a.overflow == "cpu" for a in cfg.apps):
            return None
        if cfg.node.scheduler != "spatial":
            raise OverflowSetupError(f"overflow: cpu needs node.scheduler spatial, not {cfg.node.scheduler!r} "
                                     "(the live scheduler decides where each batch runs)")
        pools = plan_pools(cfg, cores)
        profs = load_cpu_profiles([cfg.node.overflow_profiles, cfg.node.profiles])
        by_key = {model_key(m): p for m, p in profs.items()}
        for a in cfg.apps:
            if a.name not in pools:
                continue
            model = _entry_model(a)
            if model_key(model) not in by_key:
                where = cfg.node.overflow_profiles or cfg.node.profiles
                raise OverflowSetupError(
                    f"app {a.name!r}: overflow: cpu needs a CPU profile of model {model!r} "
                    f"({'none in ' + where if where else 'node.overflow_profiles is not set'}); make one with: "
                    f"gpuprims-profile {model} --device cpu --cores {len(pools[a.name].cores)} "
                    f"--input-shape {','.join(map(str, a.input_shape))} --out DIR/{model}.cpu.json "
                    "and set node.overflow_profiles: DIR")
        return cls(cfg, pools, {name: by_key[model_key(_entry_model(a))] for a in cfg.apps if (name := a.name) in pools})

    def share(self, app: str) -> CpuShare:
        """The cores and threads of the app's CPU instance."""
        pool = self.pools[app]
        return CpuShare(cores=list(pool.cores), threads=len(pool.cores), gpu_pct=100)

    def attach(self, app: AppConfig, accel_profile: Callable[[str], Profile | None],
               accel_workers: int) -> AppOverflow:
        """The app's decision point. Its accelerator model is the accelerator profile of its model
        (``accel_profile(model)``: ``node.profiles``) or, when there is none, seeded from the CPU
        profile until the measured times correct it (``update``)."""
        cpu = self.cpu_profiles[app.name]
        accel = accel_profile(_entry_model(app))
        if accel is None or accel.kind != "accelerator":
            accel = cpu.model_copy(update={"device_kind": "accelerator"})
            self.seeded_from_cpu.add(app.name)
        ov = AppOverflow(app, self.pools[app.name], accel, cpu, accel_workers=max(1, accel_workers))
        ov._router.transfer_ms = self.transfer_ms
        self.apps[app.name] = ov
        return ov

    # -- the loop's duty -------------------------------------------------------------------------------
    def update(self, instances: Iterable[InstanceState], ingest: Any, now: float, *, force: bool = False) -> bool:
        """Every ``update_s`` (or when ``force``): fold the instances' measured batch times into each
        app's models and give every routed queue of an overflowing app its cost. Returns True when it ran."""
        if not force and now < self._next_update:
            return False
        self._next_update = now + self.update_s
        self._set_costs(instances, ingest, now, measure=True)
        return True

    def reroute(self, instances: Iterable[InstanceState], ingest: Any) -> None:
        """A route changed (an instance joined or left): give every routed queue its cost now, from the
        models as they stand, so a new queue does not wait for the next update (the ingest routes an
        app least-loaded while one of its queues has no cost model)."""
        self._set_costs(instances, ingest, 0.0, measure=False)

    def _set_costs(self, instances: Iterable[InstanceState], ingest: Any, now: float, *, measure: bool) -> None:
        insts = list(instances)
        costed: set[int] = set()
        with self._lock:
            for name, ov in self.apps.items():
                # What the ingest routes to (Supervisor.route): actives, loading or not, and a ready CPU instance.
                mine = [st for st in insts if st.app == name and not st.ended
                        and (st.role == Role.ACTIVE or (st.role == Role.OVERFLOW and st.ready))]
                busy: dict[str, tuple[float, float]] = {}
                for st in mine:
                    busy[st.name] = self._observe(ov, st, now) if measure else self._busy.get(st.name, (0.0, 0.0))
                    self._busy[st.name] = busy[st.name]
                app_costs: dict[str, tuple[float, float]] = {}
                for st in mine:
                    fixed, per = self._cost(ov, device_of(st.role), *busy[st.name])
                    ingest.set_cost(st.spec.consumer, fixed, per)
                    costed.add(st.spec.consumer)
                    app_costs[st.name] = (round(fixed, 1), round(per, 1))
                self.costs[name] = app_costs
            for c in self._costed - costed:
                ingest.clear_cost(c)  # a queue that left an overflowing app's route
            self._costed = costed
            live = {st.name for st in insts}
            self._windows = {k: v for k, v in self._windows.items() if k in live}
            self._busy = {k: v for k, v in self._busy.items() if k in live}

    def _observe(self, ov: AppOverflow, st: InstanceState, now: float) -> tuple[float, float]:
        """Feed the instance's batches since the last update into its device's model; returns
        (fraction of the window it was busy, mean batch time in ms or 0 when it ran none)."""
        s = st.stats if st.stats is not None else InstanceStats()
        try:
            executed = sum(int(k) * int(v) for k, v in s.batch_sizes.items())
        except (TypeError, ValueError):
            return 0.0, 0.0  # a batch size that is not a number: no measurement this round
        win = _Window(s.busy_ms, executed, s.batches, now)
        prev = self._windows.get(st.name)
        self._windows[st.name] = win
        if prev is None:
            return 0.0, 0.0
        db, dn, dbusy, dt = win.batches - prev.batches, win.executed - prev.executed, win.busy_ms - prev.busy_ms, \
            win.t - prev.t
        if db <= 0 or dn <= 0 or dbusy <= 0:
            return 0.0, 0.0
        per_batch = dbusy / db
        ov.observe(device_of(st.role), per_batch, batch=max(1, round(dn / db)))
        rho = min(1.0, dbusy / (1000.0 * dt)) if dt > 0 else 0.0
        return rho, per_batch

    def _cost(self, ov: AppOverflow, device: str, rho: float, batch_ms: float) -> tuple[float, float]:
        b = max(1, self._max_batch(ov.app))
        one = ov.service_ms(device, 1)
        full = ov.service_ms(device, b)
        per_us = 1000.0 * full / b
        fixed_us = max(0.0, 1000.0 * one - per_us) + rho * 1000.0 * (batch_ms or one) / 2
        if device == CPU:
            fixed_us += 1000.0 * (self.transfer_ms + ov.pool.alpha_ms)
        return fixed_us, per_us

    def _max_batch(self, app: str) -> int:
        return next(a.max_batch for a in self.cfg.apps if a.name == app)

    # -- bookkeeping ------------------------------------------------------------------------------------
    def retire(self, st: InstanceState) -> None:
        """Bank a gone instance's counters under its device (the split never goes backwards)."""
        if st.app not in self.retired or st.role == Role.SHADOW:
            return
        _bank(self.retired[st.app][device_of(st.role)], st.stats)

    def lost(self, app: str) -> None:
        """The app's CPU instance died (counted in status/metrics)."""
        self.failures[app] = self.failures.get(app, 0) + 1

    def split(self, app: str, instances: Iterable[InstanceState]) -> dict[str, Any]:
        """The app's ``overflow`` entry of ``status``: per device, requests routed (received by its
        instances) and answered (ok, deadline_missed, errors), the pool, failures and current costs."""
        per: dict[str, dict[str, int]] = {d: dict(self.retired[app][d]) for d in (GPU, CPU)}
        for st in instances:
            if st.app != app or st.role == Role.SHADOW:
                continue
            _bank(per[device_of(st.role)], st.stats)
        out: dict[str, Any] = {"cores": list(self.pools[app].cores), "alpha_ms": self.pools[app].alpha_ms,
                               "cpu_instance_failures": self.failures.get(app, 0),
                               "accel_seeded_from_cpu_profile": app in self.seeded_from_cpu,
                               "costs_us": dict(self.costs.get(app, {}))}
        for d, label in ((GPU, "accelerator"), (CPU, "cpu")):
            c = per[d]
            out[label] = {"routed": c.get("received", 0), "ok": c.get("ok", 0),
                          "answered": c.get("ok", 0) + c.get("deadline_missed", 0) + c.get("errors", 0)}
        return out


def _bank(bank: dict[str, int], stats: InstanceStats | None) -> None:
    """Add an instance's split counters to ``bank``."""
    if stats is not None:
        for k in SPLIT_COUNTERS:
            bank[k] = bank.get(k, 0) + getattr(stats, k)


def model_key(model: str) -> str:
    """The name a model's profile is filed under (as ``orchestrator.node.placement.model_key``)."""
    try:
        return canonical_name(model)
    except ValueError:
        return model


def _entry_model(app: AppConfig) -> str:
    model = app.model if app.stages is None else app.stages[0].model
    assert model is not None
    return model
