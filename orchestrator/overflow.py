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

from gpuprims.coexec.graph import CPU, GPU
from gpuprims.coexec.overflow import OverflowRouter, RouteDecision
from gpuprims.cpushare import available_cores
from gpuprims.profile.format import Profile
from orchestrator.config import AppConfig, NodeConfig


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
