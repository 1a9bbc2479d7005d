"""The node's typed vocabulary: the records its parts pass to each other instead of status dicts and
role strings (as vLLM's ``v1/metrics/stats.py`` and Ray Serve's ``ReplicaState``).

- :class:`Role`: what an instance is for (routed to, waiting as a shadow, draining, ...).
- :class:`InstanceStats`: an instance's heartbeat body; the `Heartbeat` message carries it.
- :class:`AppTotals`: an app's statistics (`orchestrator.control.stats.AppStatistics.totals`).
- :class:`InstanceView`, :class:`AppView`, :class:`NodeView`: one read of a running node
  (``Node.view()``); the monitor, the CPU overflow and the metrics read them by field.
- :class:`EngineSpec` and :class:`StageSpec`: the app's validated engine and a DAG stage, as they
  cross the process boundary in the instance's spec.

JSON appears only at the control edge: ``to_wire`` / ``from_wire`` for the heartbeat's encoding and
``to_dict`` for the status reply (what the CLI, Prometheus's renderer and the fleet agent read). Torch-
and numpy-free, so every room (the worker, the node, the CLI) imports it.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

__all__ = [
    "SERVING_ROLES",
    "AppTotals",
    "AppView",
    "EngineSpec",
    "InstanceStats",
    "InstanceView",
    "NodeView",
    "Role",
    "StageSpec",
]


class Role(StrEnum):
    """An instance's role (a ``str``, so it is its own JSON and its status text)."""

    ACTIVE = "active"  # routed to: it serves the app's traffic
    SHADOW = "shadow"  # CPU side up, model not loaded (or pre-warmed), waiting for a change of share
    OVERFLOW = "overflow"  # the app's CPU overflow instance (orchestrator/node/cpu_overflow.py)
    LOADING = "loading"  # a repository load's instance, not routed to until the whole load is ready
    FINISHING = "finishing"  # off the route after a switch, draining what it holds
    STOPPING = "stopping"  # on its way out


#: Roles whose instances serve the app's traffic (their recent latency makes the app's p50/p99).
SERVING_ROLES = frozenset({Role.ACTIVE, Role.OVERFLOW})


# -- the heartbeat ----------------------------------------------------------------------------------

def _kind_ok(hint: Any, value: object) -> bool:
    """Whether ``value`` (decoded JSON) fits the annotation ``hint`` (int, float, str, bool, a dict or
    list, or a union of those with None). Counts are non-negative; floats finite."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(_kind_ok(h, value) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    origin = typing.get_origin(hint) or hint
    if origin is bool:
        return isinstance(value, bool)
    if origin is int:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    if origin is float:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if origin is str:
        return isinstance(value, str)
    if origin in (dict, Mapping):
        return isinstance(value, dict)
    if origin in (list, tuple):
        return isinstance(value, list | tuple)
    raise TypeError(f"unsupported record field type {hint!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceStats:
    """What an instance's heartbeat says: cumulative counters since it started, its recent latency,
    its queue, and what it runs (``engine``, ``params``). ``hist``, ``stages``, ``batch_sizes`` and
    ``engine`` are JSON objects only rendered (status, Prometheus). Times in ns are CLOCK_MONOTONIC."""

    received: int = 0
    ok: int = 0
    deadline_missed: int = 0
    early_dropped: int = 0  # of deadline_missed: given up on under a backlog
    errors: int = 0
    within_slo: int = 0
    slo_attainment: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    model_p50_ms: float | None = None
    arrival_rps: float = 0.0  # the node replaces both rates by those of its last few heartbeats
    service_rps: float = 0.0
    queue_len: int = 0
    held: int = 0
    busy_ms: float = 0.0
    batches: int = 0
    batch_sizes: dict[str, int] = field(default_factory=dict)
    hist: dict[str, Any] = field(default_factory=dict)  # gpuprims.stats.RequestHistograms.to_wire()
    stages: dict[str, Any] = field(default_factory=dict)  # gpuprims.stats.StageClock.snapshot()
    first_request_ns: int = 0
    first_ok_ns: int = 0
    last_ok_ns: int = 0
    first_model_ms: float | None = None
    uptime_s: float = 0.0
    # What the instance is and runs (absent from a StatsReply's snapshot)
    gpu_pct: int | None = None
    initialized: bool = False
    finishing: bool = False
    params: str | None = None  # own | exported | imported | engine (Param-Share)
    engine: dict[str, Any] | None = None  # the runner's describe()
    mps_pct: str | None = None  # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE as the instance saw it
    device_bytes: int | None = None

    @property
    def answered(self) -> int:
        return self.ok + self.deadline_missed + self.errors

    def to_wire(self) -> dict[str, Any]:
        """The heartbeat's JSON object (and an instance's part of the status reply)."""
        return {f: getattr(self, f) for f in _STATS_FIELDS}

    @classmethod
    def from_wire(cls, data: object) -> InstanceStats:
        """Rebuild from `to_wire` output; ValueError names the first field that is unknown or of the
        wrong kind (a missing field takes its default)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"InstanceStats must be a JSON object, got {type(data).__name__}")
        unknown = set(data) - set(_STATS_FIELDS)
        if unknown:
            raise ValueError(f"InstanceStats has unknown fields {sorted(unknown)}")
        for name, value in data.items():
            if not _kind_ok(_STATS_FIELDS[name], value):
                raise ValueError(f"InstanceStats.{name} must be {_STATS_FIELDS[name]}, got {value!r:.80}")
        return cls(**data)


_STATS_FIELDS: dict[str, Any] = {f.name: typing.get_type_hints(InstanceStats)[f.name]
                                 for f in dataclasses.fields(InstanceStats)}


def _checked(what: str, hints: Mapping[str, Any], data: Mapping[str, Any],
             required: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The entries of ``data`` that ``hints`` names, each checked against its type (`_kind_ok`);
    ValueError names the first that is missing or of the wrong kind."""
    missing = required - set(data)
    if missing:
        raise ValueError(f"{what} lacks {sorted(missing)}")
    out: dict[str, Any] = {}
    for name, hint in hints.items():
        if name in data:
            if not _kind_ok(hint, data[name]):
                raise ValueError(f"{what}.{name} must be {hint}, got {data[name]!r:.80}")
            out[name] = data[name]
    return out


def _mapping(what: str, data: object) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise ValueError(f"{what} must be a JSON object, got {type(data).__name__}")
    return data


# -- an app's statistics ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class AppTotals:
    """An app's statistics (live plus gone instances): cumulative counters, rates and queue of what
    serves, p50/p99 of the recent window, SLO attainment, and the front door's counts (``oip``)."""

    received: int = 0
    ok: int = 0
    deadline_missed: int = 0
    errors: int = 0
    within_slo: int = 0
    busy_ms: float = 0.0
    p50_ms: float | None = None
    p99_ms: float | None = None
    arrival_rps: float = 0.0
    service_rps: float = 0.0
    queue_len: int = 0
    held: int = 0
    slo_attainment: float | None = None
    batch_sizes: dict[str, int] = field(default_factory=dict)
    hist: dict[str, Any] = field(default_factory=dict)
    oip: dict[str, Any] = field(default_factory=dict)

    @property
    def answered(self) -> int:
        return self.ok + self.deadline_missed + self.errors

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


# -- one read of a node -------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceView:
    """One instance as the node sees it. ``stats`` is its last heartbeat (None before the first);
    ``engine`` the heartbeat's, or before it what its (warm) Ready said."""

    name: str
    pid: int
    role: Role
    ready: bool
    gpu_pct: int
    gpu: int | str  # the GPU index on cuda, "cpu" on the CPU backend
    consumer: int
    cores: tuple[int, ...] | None = None
    warm: bool = False
    prewarm: str | None = None
    stats: InstanceStats | None = None
    engine: dict[str, Any] | None = None
    memory: Mapping[str, Any] | None = None  # orchestrator.control.memory.MemoryReading.to_dict()

    @property
    def serving(self) -> bool:
        return self.role in SERVING_ROLES

    @property
    def queue_len(self) -> int:
        return self.stats.queue_len if self.stats is not None else 0

    @property
    def busy_ms(self) -> float:
        return self.stats.busy_ms if self.stats is not None else 0.0

    @classmethod
    def from_dict(cls, data: object) -> InstanceView:
        """Rebuild from `to_dict` output (a status reply another process received); ValueError names
        what is malformed. The heartbeat's fields are its ``stats`` when it had sent one."""
        d = _mapping("an instance", data)
        v = _checked("an instance", _INSTANCE_FIELDS, d, frozenset(_INSTANCE_FIELDS) - _INSTANCE_OPTIONAL)
        role = v.pop("role")
        if role not in set(Role):
            raise ValueError(f"an instance's role must be one of {[str(r) for r in Role]}, got {role!r:.40}")
        if v.get("cores") is not None:
            v["cores"] = tuple(v["cores"])
        if "received" in d:  # its last heartbeat, flattened in
            v["stats"] = InstanceStats.from_wire({k: d[k] for k in _STATS_FIELDS if k in d})
        return cls(role=Role(role), **v)

    def to_dict(self) -> dict[str, Any]:
        """The instance's part of the status reply (the heartbeat's fields flattened in, as before)."""
        out: dict[str, Any] = {"name": self.name, "pid": self.pid, "role": str(self.role), "ready": self.ready,
                               "gpu_pct": self.gpu_pct, "gpu": self.gpu, "consumer": self.consumer,
                               "cores": None if self.cores is None else list(self.cores),
                               "warm": self.warm, "prewarm": self.prewarm}
        if self.stats is not None:
            out.update(self.stats.to_wire())
            if self.stats.gpu_pct is None:  # a snapshot that does not say: the node's own figure
                out["gpu_pct"] = self.gpu_pct
        out["engine"] = self.engine
        out["memory"] = None if self.memory is None else dict(self.memory)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class AppView:
    """One app: its config's figures, its share, its instances, its statistics and its counters of
    restarts. ``change``, ``memory``, ``overflow`` and ``model_file`` are rendered only."""

    name: str
    app_id: int
    model: str | None  # None for a DAG app (its stages name theirs)
    slo_ms: float
    gpu_pct: int
    gpu: int | str
    instances: tuple[InstanceView, ...] = ()
    totals: AppTotals = field(default_factory=AppTotals)
    restarts: int = 0
    failed_by_crash: int = 0
    requeued_by_crash: int = 0
    hangs: int = 0
    shadow_restarts: int = 0
    change: Mapping[str, Any] | None = None  # the running change's to_dict()
    memory: Mapping[str, Any] | None = None
    overflow: Mapping[str, Any] | None = None  # NodeOverflow.split()
    model_file: Mapping[str, Any] | None = None

    def with_role(self, role: Role) -> tuple[InstanceView, ...]:
        """The app's instances in ``role``."""
        return tuple(i for i in self.instances if i.role == role)

    @property
    def active(self) -> tuple[InstanceView, ...]:
        return self.with_role(Role.ACTIVE)

    @classmethod
    def from_dict(cls, name: str, data: object) -> AppView:
        """Rebuild app ``name`` from `to_dict` output; ValueError names what is malformed."""
        d = _mapping(f"app {name!r}", data)
        v = _checked(f"app {name!r}", _APP_FIELDS, d, frozenset({"app_id", "model", "slo_ms", "gpu_pct", "gpu"}))
        insts = d.get("instances", [])
        if not isinstance(insts, list):
            raise ValueError(f"app {name!r}: instances must be a list, got {type(insts).__name__}")
        totals = AppTotals(**_checked(f"app {name!r}", _TOTALS_FIELDS, d))
        return cls(name=name, instances=tuple(InstanceView.from_dict(i) for i in insts), totals=totals, **v)

    def to_dict(self) -> dict[str, Any]:
        """The app's part of the status reply (the totals flattened in, as before)."""
        out: dict[str, Any] = {
            "app_id": self.app_id, "model": self.model, "slo_ms": self.slo_ms, "gpu_pct": self.gpu_pct,
            "gpu": self.gpu, "instances": [i.to_dict() for i in self.instances], "restarts": self.restarts,
            "failed_by_crash": self.failed_by_crash, "requeued_by_crash": self.requeued_by_crash,
            "hangs": self.hangs, "shadow_restarts": self.shadow_restarts,
            "change": None if self.change is None else dict(self.change), **self.totals.to_dict(),
            "memory": None if self.memory is None else dict(self.memory),
            "overflow": None if self.overflow is None else dict(self.overflow),
        }
        if self.model_file is not None:
            out["model_file"] = dict(self.model_file)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeView:
    """One read of a running node (``Node.view()``): its apps and instances by field, and the rest of
    what ``status`` shows (``node``, ``ingest``, ``changes``, ...) as the JSON the parts give, which
    only the status reply renders. `to_dict` is the status reply's body."""

    apps: Mapping[str, AppView] = field(default_factory=dict)
    node: Mapping[str, Any] = field(default_factory=dict)
    ingest: Mapping[str, Any] = field(default_factory=dict)
    drops: Mapping[str, int] = field(default_factory=dict)
    control_rejected: Mapping[str, int] = field(default_factory=dict)
    decisions: tuple[Mapping[str, Any], ...] = ()
    changes: Mapping[str, Any] = field(default_factory=dict)
    scheduler: Mapping[str, Any] = field(default_factory=dict)
    param_share: tuple[Any, ...] = ()
    repository: Mapping[str, Any] | None = None

    def active(self, app: str) -> tuple[InstanceView, ...]:
        """The active instances of ``app`` (none for an unknown app)."""
        a = self.apps.get(app)
        return a.active if a is not None else ()

    @classmethod
    def from_dict(cls, data: object) -> NodeView:
        """Rebuild from a status reply's body (`to_dict` output, received from another process);
        ValueError names what is malformed."""
        d = _mapping("a status reply", data)
        v = _checked("a status reply", _NODE_FIELDS, d)
        apps = _mapping("a status reply's apps", d.get("apps", {}))
        for key in ("decisions", "param_share"):
            if key in v:
                v[key] = tuple(v[key])
        return cls(apps={str(n): AppView.from_dict(str(n), a) for n, a in apps.items()}, **v)

    def to_dict(self) -> dict[str, Any]:
        """The status reply's body (the CLI reads it back with `from_dict` for ``format_status``)."""
        return {
            "node": dict(self.node), "ingest": dict(self.ingest), "drops": dict(self.drops),
            "control_rejected": dict(self.control_rejected),
            "apps": {name: a.to_dict() for name, a in self.apps.items()},
            "decisions": [dict(d) for d in self.decisions],
            "changes": dict(self.changes), "scheduler": dict(self.scheduler),
            "param_share": list(self.param_share),
            "repository": None if self.repository is None else dict(self.repository),
        }


# What a status reply's entries hold besides the records inside them (from_dict checks each).
_INSTANCE_FIELDS: dict[str, Any] = {
    "name": str, "pid": int, "role": str, "ready": bool, "gpu_pct": int, "gpu": int | str, "consumer": int,
    "cores": list | None, "warm": bool, "prewarm": str | None, "engine": dict | None, "memory": dict | None}
_INSTANCE_OPTIONAL = frozenset({"cores", "warm", "prewarm", "engine", "memory"})
_APP_FIELDS: dict[str, Any] = {
    "app_id": int, "model": str | None, "slo_ms": float, "gpu_pct": int, "gpu": int | str, "restarts": int,
    "failed_by_crash": int, "requeued_by_crash": int, "hangs": int, "shadow_restarts": int,
    "change": dict | None, "memory": dict | None, "overflow": dict | None, "model_file": dict | None}
_TOTALS_FIELDS: dict[str, Any] = {f.name: typing.get_type_hints(AppTotals)[f.name] for f in dataclasses.fields(AppTotals)}
_NODE_FIELDS: dict[str, Any] = {
    "node": dict, "ingest": dict, "drops": dict, "control_rejected": dict, "decisions": list, "changes": dict,
    "scheduler": dict, "param_share": list, "repository": dict | None}


# -- what an instance is told -------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class EngineSpec:
    """An app's (or a stage's) validated engine: its kind (``eager``, ``onnxruntime``, ...) and
    options, as apps.yaml's ``engine:`` said and the node checked before starting an instance."""

    kind: str = "eager"
    options: Mapping[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "options": dict(self.options)}

    @classmethod
    def from_wire(cls, data: object) -> EngineSpec:
        if not isinstance(data, Mapping) or not isinstance(data.get("kind"), str) or not data["kind"]:
            raise ValueError(f"an engine spec needs a non-empty 'kind', got {data!r:.80}")
        options = data.get("options", {})
        if not isinstance(options, Mapping) or set(data) - {"kind", "options"}:
            raise ValueError(f"an engine spec is {{'kind', 'options'}}, got {data!r:.80}")
        return cls(data["kind"], dict(options))


@dataclass(frozen=True, slots=True)
class StageSpec:
    """A DAG app's stage as its instances run it: class i of its output continues at ``routes[i]``
    (classes past the list end there), on ``engine``."""

    name: str
    model: str
    routes: tuple[str, ...] = ()
    engine: EngineSpec = field(default_factory=EngineSpec)

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.model, "routes": list(self.routes),
                "engine": self.engine.to_wire()}

    @classmethod
    def from_wire(cls, data: object) -> StageSpec:
        if not isinstance(data, Mapping) or set(data) - {"name", "model", "routes", "engine"}:
            raise ValueError(f"a stage is {{'name', 'model', 'routes', 'engine'}}, got {data!r:.80}")
        name, model, routes = data.get("name"), data.get("model"), data.get("routes") or []
        if not isinstance(name, str) or not isinstance(model, str) or not isinstance(routes, list) \
                or not all(isinstance(r, str) for r in routes):
            raise ValueError(f"a stage needs a name, a model and routes of stage names, got {data!r:.80}")
        return cls(name, model, tuple(routes), EngineSpec.from_wire(data.get("engine") or {"kind": "eager"}))
