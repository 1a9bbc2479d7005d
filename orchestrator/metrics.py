"""Counters, gauges and latency histograms of a node; Prometheus export; the ``status`` table.

Three layers:

- `InstanceCounters` is what an app instance keeps and ships in every ``Heartbeat.stats``
  (`to_dict` / `from_dict`, plain JSON). Counters are cumulative since the instance started, so a lost
  heartbeat loses nothing; gauges (queue length, requests held, GPU%) are the values at sampling time.
- `NodeMetrics` is the orchestrator's model: it keeps the last two samples of every instance and
  derives rates and windowed latency percentiles / SLO attainment from their difference, aggregates
  per app (keeping the totals of instances that have gone, so app counters never go backwards), holds
  the ingest's drop counters by reason, and renders `status()` (a JSON-able dict) and Prometheus
  metrics on its own `CollectorRegistry` (never the global one).
- `MetricsServer` serves that registry over HTTP on loopback; `orchestrator.status_format.format_status` (the CLI's) turns a status dict into
  the table ``gpuprims-orchestrator status`` prints.

Latencies are kept in a `LatencyHistogram`: fixed logarithmic buckets (about 2 % relative width), so
percentiles have bounded error, histograms merge exactly across instances, and a window is the
difference of two cumulative histograms.
"""

from __future__ import annotations

import collections
import contextlib
import math
import platform
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from gpuprims import __version__
from gpuprims.stats import DurationHistogram, RequestHistograms, add_wire
from gpuprims.wire import Status

__all__ = [
    "InstanceCounters",
    "LatencyHistogram",
    "MetricsServer",
    "NodeMetrics",
    "normalize_status",
    "retire_into",
    "status_name",
]


def status_name(status: int | str) -> str:
    """The lower-case name of a response status (``deadline_missed``); accepts the code or a name."""
    if isinstance(status, str):
        key = status.strip().upper()
        if key not in Status.__members__:
            raise ValueError(f"unknown status {status!r}; known: {', '.join(s.name.lower() for s in Status)}")
        return key.lower()
    if isinstance(status, bool) or not isinstance(status, int):
        raise ValueError(f"status must be a wire.Status code or name, got {status!r}")
    try:
        return Status(status).name.lower()
    except ValueError:
        raise ValueError(f"unknown status code {status}") from None


class LatencyHistogram:
    """Log-bucketed latency histogram in milliseconds.

    Bucket ``i`` (``i >= 1``) holds values in ``(MIN_MS * RATIO**(i-1), MIN_MS * RATIO**i]``; bucket 0
    holds everything up to ``MIN_MS``. Quantiles report a bucket's upper bound (never more than the
    largest value seen), so they over-state by at most ``RATIO - 1``.
    """

    MIN_MS = 0.001
    RATIO = 1.02
    MAX_BUCKET = 1100  # 0.001 ms * 1.02**1100 is about 2.9e6 s; larger values land here

    __slots__ = ("buckets", "count", "max_ms", "sum_ms")

    def __init__(self) -> None:
        self.buckets: dict[int, int] = {}
        self.count = 0
        self.sum_ms = 0.0
        self.max_ms = 0.0

    @classmethod
    def bucket_of(cls, latency_ms: float) -> int:
        """The bucket index of a value."""
        if latency_ms <= cls.MIN_MS:
            return 0
        i = math.ceil(math.log(latency_ms / cls.MIN_MS) / math.log(cls.RATIO) - 1e-9)
        return min(max(i, 0), cls.MAX_BUCKET)

    @classmethod
    def upper_ms(cls, bucket: int) -> float:
        """Upper bound of a bucket in ms."""
        return cls.MIN_MS * cls.RATIO**bucket

    def record(self, latency_ms: float, n: int = 1) -> None:
        """Add ``n`` observations of ``latency_ms``; negative or non-finite values raise ValueError."""
        if not math.isfinite(latency_ms) or latency_ms < 0:
            raise ValueError(f"latency_ms must be a finite value >= 0, got {latency_ms!r}")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        b = self.bucket_of(latency_ms)
        self.buckets[b] = self.buckets.get(b, 0) + n
        self.count += n
        self.sum_ms += latency_ms * n
        self.max_ms = max(self.max_ms, latency_ms)

    def record_many(self, latencies_ms: Iterable[float]) -> None:
        """Add each value of ``latencies_ms``."""
        for v in latencies_ms:
            self.record(float(v))

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0 < q <= 1) in ms, or None when empty."""
        if not 0 < q <= 1:
            raise ValueError(f"q must be in (0, 1], got {q}")
        if self.count == 0:
            return None
        rank = math.ceil(q * self.count)
        seen = 0
        for b in sorted(self.buckets):
            seen += self.buckets[b]
            if seen >= rank:
                return min(self.upper_ms(b), self.max_ms) if self.max_ms > 0 else self.upper_ms(b)
        return self.max_ms

    @property
    def mean_ms(self) -> float | None:
        """Mean in ms, or None when empty."""
        return self.sum_ms / self.count if self.count else None

    def copy(self) -> LatencyHistogram:
        """An independent copy."""
        h = LatencyHistogram()
        h.buckets = dict(self.buckets)
        h.count, h.sum_ms, h.max_ms = self.count, self.sum_ms, self.max_ms
        return h

    def merge(self, other: LatencyHistogram) -> None:
        """Add ``other``'s observations to this one."""
        for b, n in other.buckets.items():
            self.buckets[b] = self.buckets.get(b, 0) + n
        self.count += other.count
        self.sum_ms += other.sum_ms
        self.max_ms = max(self.max_ms, other.max_ms)

    def since(self, earlier: LatencyHistogram) -> LatencyHistogram:
        """The observations added after ``earlier`` (a previous copy of this cumulative histogram).

        If ``earlier`` is not a prefix of this one (the source restarted), the whole histogram is the
        window. ``max_ms`` of a window is the upper bound of its highest bucket.
        """
        if earlier.count > self.count or any(self.buckets.get(b, 0) < n for b, n in earlier.buckets.items()):
            return self.copy()
        h = LatencyHistogram()
        for b, n in self.buckets.items():
            d = n - earlier.buckets.get(b, 0)
            if d:
                h.buckets[b] = d
        h.count = self.count - earlier.count
        h.sum_ms = max(0.0, self.sum_ms - earlier.sum_ms)
        if h.buckets:
            top = max(h.buckets)
            h.max_ms = min(self.upper_ms(top), self.max_ms)
        return h

    def to_dict(self) -> dict[str, Any]:
        """Sparse JSON form: ``{"b": {bucket: count}, "n": count, "sum_ms": ..., "max_ms": ...}``."""
        return {"b": {str(b): n for b, n in self.buckets.items()}, "n": self.count,
                "sum_ms": self.sum_ms, "max_ms": self.max_ms}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LatencyHistogram:
        """Rebuild from `to_dict` output; ValueError says what is wrong."""
        if not isinstance(d, Mapping):
            raise ValueError(f"latency histogram must be a mapping, got {type(d).__name__}")
        h = cls()
        raw = d.get("b", {})
        if not isinstance(raw, Mapping):
            raise ValueError("latency histogram 'b' must map bucket -> count")
        for k, n in raw.items():
            try:
                b = int(k)
            except (TypeError, ValueError):
                raise ValueError(f"latency histogram bucket {k!r} is not an integer") from None
            if not 0 <= b <= cls.MAX_BUCKET or not _is_count(n):
                raise ValueError(f"latency histogram bucket {k!r}: {n!r} is out of range")
            if n:
                h.buckets[b] = int(n)
        h.count = sum(h.buckets.values())
        if "n" in d and d["n"] != h.count:
            raise ValueError(f"latency histogram count {d['n']!r} disagrees with its buckets ({h.count})")
        h.sum_ms = _nonneg_float(d.get("sum_ms", 0.0), "latency sum_ms")
        h.max_ms = _nonneg_float(d.get("max_ms", 0.0), "latency max_ms")
        return h

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LatencyHistogram):
            return NotImplemented
        return (self.buckets, self.count, self.max_ms) == (other.buckets, other.count, other.max_ms) and \
            math.isclose(self.sum_ms, other.sum_ms, rel_tol=1e-9, abs_tol=1e-9)

    def __repr__(self) -> str:
        return f"LatencyHistogram(count={self.count}, p50_ms={self.quantile(0.5) if self.count else None})"


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _nonneg_float(v: object, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {v!r}")
    return float(v)


@dataclass
class InstanceCounters:
    """What one app instance counts; shipped as ``Heartbeat.stats`` via `to_dict`.

    ``arrived``, ``served``, ``slo_met``, ``errors`` (by status name), ``batches`` (batch size ->
    count) and ``latency`` (of OK responses, ms) are cumulative; ``queue_len``, ``held`` (requests the
    instance holds: queued plus in the running batch) and ``gpu_pct`` are gauges.
    """

    arrived: int = 0
    served: int = 0
    slo_met: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    batches: collections.Counter[int] = field(default_factory=collections.Counter)
    latency: LatencyHistogram = field(default_factory=LatencyHistogram)
    queue_len: int = 0
    held: int = 0
    gpu_pct: int = 0

    def record_arrivals(self, n: int = 1) -> None:
        """``n`` requests reached this instance."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self.arrived += n

    def record_batch(self, latencies_ms: Sequence[float], slo_ms: float) -> None:
        """One batch answered OK; ``latencies_ms`` has one end-to-end latency per request."""
        if slo_ms <= 0:
            raise ValueError(f"slo_ms must be > 0, got {slo_ms}")
        if not latencies_ms:
            raise ValueError("a batch has at least one request")
        self.batches[len(latencies_ms)] += 1
        for v in latencies_ms:
            self.latency.record(float(v))
            if v <= slo_ms:
                self.slo_met += 1
        self.served += len(latencies_ms)

    def record_error(self, status: int | str, n: int = 1) -> None:
        """``n`` requests were answered with a non-OK ``status`` (wire.Status code or name)."""
        name = status_name(status)
        if name == "ok":
            raise ValueError("record_error takes a non-OK status; OK responses go through record_batch")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.errors[name] += n

    @property
    def answered(self) -> int:
        """Requests answered at all (OK or error)."""
        return self.served + sum(self.errors.values())

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form for ``Heartbeat.stats``."""
        return {
            "arrived": self.arrived, "served": self.served, "slo_met": self.slo_met,
            "errors": dict(self.errors), "batches": {str(k): v for k, v in self.batches.items()},
            "latency": self.latency.to_dict(),
            "queue_len": self.queue_len, "held": self.held, "gpu_pct": self.gpu_pct,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> InstanceCounters:
        """Rebuild from `to_dict` output, checking every field; ValueError names the bad one."""
        if not isinstance(d, Mapping):
            raise ValueError(f"instance stats must be a mapping, got {type(d).__name__}")
        known = {"arrived", "served", "slo_met", "errors", "batches", "latency", "queue_len", "held", "gpu_pct"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"instance stats have unknown fields {sorted(unknown)}")
        c = cls()
        for name in ("arrived", "served", "slo_met", "queue_len", "held", "gpu_pct"):
            v = d.get(name, 0)
            if not _is_count(v):
                raise ValueError(f"instance stats {name} must be an integer >= 0, got {v!r}")
            setattr(c, name, int(v))
        if c.slo_met > c.served:
            raise ValueError(f"instance stats slo_met {c.slo_met} > served {c.served}")
        errors = d.get("errors", {})
        if not isinstance(errors, Mapping):
            raise ValueError("instance stats errors must map status -> count")
        for k, n in errors.items():
            if not _is_count(n):
                raise ValueError(f"instance stats errors[{k!r}] must be an integer >= 0, got {n!r}")
            c.errors[status_name(k)] += int(n)
        batches = d.get("batches", {})
        if not isinstance(batches, Mapping):
            raise ValueError("instance stats batches must map batch size -> count")
        for k, n in batches.items():
            try:
                size = int(k)
            except (TypeError, ValueError):
                raise ValueError(f"instance stats batch size {k!r} is not an integer") from None
            if size < 1 or not _is_count(n):
                raise ValueError(f"instance stats batches[{k!r}] = {n!r} is out of range")
            c.batches[size] += int(n)
        c.latency = LatencyHistogram.from_dict(d.get("latency", {}))
        return c


# ---- the orchestrator's model


@dataclass
class _Sample:
    t_s: float
    c: InstanceCounters


@dataclass
class _Instance:
    app: str
    name: str
    role: str
    pid: int | None
    last: _Sample
    prev: _Sample | None = None

    def window(self) -> dict[str, Any]:
        """Rates and windowed quantiles between the last two samples."""
        cur = self.last.c
        if self.prev is None:
            return {"arrival_rps": None, "service_rps": None, "window": cur.latency.copy(),
                    "w_met": cur.slo_met, "w_answered": cur.answered}
        old = self.prev.c
        dt = self.last.t_s - self.prev.t_s
        restarted = cur.arrived < old.arrived or cur.served < old.served or cur.answered < old.answered
        base = InstanceCounters() if restarted else old
        rate = (lambda a, b: (a - b) / dt) if dt > 0 else (lambda a, b: None)
        return {"arrival_rps": rate(cur.arrived, base.arrived), "service_rps": rate(cur.served, base.served),
                "window": cur.latency.since(base.latency), "w_met": cur.slo_met - base.slo_met,
                "w_answered": cur.answered - base.answered}


@dataclass
class _App:
    name: str
    app_id: int | None = None
    slo_ms: float | None = None
    instances: dict[str, _Instance] = field(default_factory=dict)
    # Totals of instances that have gone, so app-level counters never go backwards.
    retired: InstanceCounters = field(default_factory=InstanceCounters)


def _add_cumulative(into: InstanceCounters, c: InstanceCounters) -> None:
    into.arrived += c.arrived
    into.served += c.served
    into.slo_met += c.slo_met
    into.errors.update(c.errors)
    into.batches.update(c.batches)
    into.latency.merge(c.latency)


def _ratio(num: int, den: int) -> float | None:
    return num / den if den > 0 else None


class NodeMetrics:
    """The orchestrator's view of every app and instance; thread-safe (scrapes come from a thread).

    ``clock`` returns seconds (monotonic); tests pass their own.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._apps: dict[str, _App] = {}
        self._ingest_drops: dict[str, int] = {}
        self._control_rejected: dict[str, int] = {}
        self._node_info: dict[str, Any] = {}
        self._started_s = clock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self.status))
        _add_process_collectors(self.registry)

    def set_app(self, app: str, *, app_id: int | None = None, slo_ms: float | None = None) -> None:
        """Declare an app (so it is listed before its first heartbeat) with its id and SLO."""
        if slo_ms is not None and slo_ms <= 0:
            raise ValueError(f"slo_ms must be > 0, got {slo_ms}")
        with self._lock:
            a = self._apps.setdefault(app, _App(app))
            a.app_id = app_id if app_id is not None else a.app_id
            a.slo_ms = slo_ms if slo_ms is not None else a.slo_ms

    def update_instance(self, app: str, instance: str, stats: InstanceCounters | Mapping[str, Any], *,
                        role: str = "active", pid: int | None = None, now_s: float | None = None) -> None:
        """Record one sample of an instance's counters (a Heartbeat's stats dict or InstanceCounters).

        Raises ValueError if the stats dict is malformed; the previous sample is kept then.
        """
        c = stats if isinstance(stats, InstanceCounters) else InstanceCounters.from_dict(stats)
        t = self._clock() if now_s is None else now_s
        with self._lock:
            a = self._apps.setdefault(app, _App(app))
            inst = a.instances.get(instance)
            if inst is None:
                a.instances[instance] = _Instance(app, instance, role, pid, _Sample(t, c))
                return
            if c.arrived < inst.last.c.arrived or c.answered < inst.last.c.answered:
                # Same name, new process: bank what the old one counted.
                _add_cumulative(a.retired, inst.last.c)
            inst.prev, inst.last = inst.last, _Sample(t, c)
            inst.role = role
            inst.pid = pid if pid is not None else inst.pid

    def set_role(self, app: str, instance: str, role: str) -> None:
        """Mark an instance ``active``, ``shadow``, ``draining``... (shown in status)."""
        with self._lock:
            self._apps[app].instances[instance].role = role

    def remove_instance(self, app: str, instance: str) -> None:
        """Forget an instance (exited, replaced); its totals stay in the app's counters."""
        with self._lock:
            a = self._apps.get(app)
            inst = a.instances.pop(instance, None) if a else None
            if a is not None and inst is not None:
                _add_cumulative(a.retired, inst.last.c)

    def set_ingest_drops(self, drops: Mapping[str, int]) -> None:
        """Replace the ingest's cumulative drop counters, by reason (``bad_magic``, ``timeout``...)."""
        self._control_rejected_or_drops(drops, "ingest")

    def set_control_rejected(self, rejected: Mapping[str, int]) -> None:
        """Replace the control plane's rejected-message counters, by reason (`ControlServer.rejected`)."""
        self._control_rejected_or_drops(rejected, "control")

    def _control_rejected_or_drops(self, counts: Mapping[str, int], which: str) -> None:
        clean: dict[str, int] = {}
        for k, v in counts.items():
            if not isinstance(k, str) or not _is_count(v):
                raise ValueError(f"{which} counters must map reason -> integer >= 0, got {k!r}: {v!r}")
            clean[k] = int(v)
        with self._lock:
            if which == "ingest":
                self._ingest_drops = clean
            else:
                self._control_rejected = clean

    def set_node_info(self, **info: Any) -> None:
        """Free-form node facts shown in status (backend, scheduler, run_dir...); JSON values only."""
        with self._lock:
            self._node_info.update(info)

    def status(self) -> dict[str, Any]:
        """The JSON-able status of the node, as `orchestrator.status_format.format_status` and ``StatusReply`` take it."""
        with self._lock:
            apps = [self._app_status(a) for a in sorted(self._apps.values(),
                                                        key=lambda a: (a.app_id or 0, a.name))]
            node = dict(self._node_info)
            node["uptime_s"] = round(self._clock() - self._started_s, 3)
            return {"node": node, "apps": apps, "ingest_drops": dict(self._ingest_drops),
                    "control_rejected": dict(self._control_rejected)}

    def _app_status(self, a: _App) -> dict[str, Any]:
        insts = []
        total = InstanceCounters()
        _add_cumulative(total, a.retired)
        window = LatencyHistogram()
        w_met = w_answered = 0
        arr: list[float] = []
        srv: list[float] = []
        queue_len = held = gpu_pct = 0
        for inst in sorted(a.instances.values(), key=lambda i: i.name):
            c = inst.last.c
            w = inst.window()
            _add_cumulative(total, c)
            window.merge(w["window"])
            w_met += w["w_met"]
            w_answered += w["w_answered"]
            if w["arrival_rps"] is not None:
                arr.append(w["arrival_rps"])
            if w["service_rps"] is not None:
                srv.append(w["service_rps"])
            queue_len += c.queue_len
            held += c.held
            if inst.role != "shadow":
                gpu_pct += c.gpu_pct
            insts.append({
                "name": inst.name, "role": inst.role, "pid": inst.pid, "gpu_pct": c.gpu_pct,
                "arrival_rps": w["arrival_rps"], "service_rps": w["service_rps"],
                "queue_len": c.queue_len, "held": c.held,
                "p50_ms": w["window"].quantile(0.5) if w["window"].count else None,
                "p99_ms": w["window"].quantile(0.99) if w["window"].count else None,
                "slo_attainment": _ratio(w["w_met"], w["w_answered"]),
                "arrived": c.arrived, "served": c.served, "slo_met": c.slo_met, "errors": dict(c.errors),
                "batch_sizes": {str(k): v for k, v in sorted(c.batches.items())},
            })
        return {
            "name": a.name, "app_id": a.app_id, "slo_ms": a.slo_ms, "gpu_pct": gpu_pct,
            "arrival_rps": sum(arr) if arr else None, "service_rps": sum(srv) if srv else None,
            "queue_len": queue_len, "held": held,
            "p50_ms": window.quantile(0.5) if window.count else None,
            "p99_ms": window.quantile(0.99) if window.count else None,
            "slo_attainment": _ratio(w_met, w_answered),
            "slo_attainment_total": _ratio(total.slo_met, total.answered),
            "arrived": total.arrived, "served": total.served, "slo_met": total.slo_met,
            "errors": dict(total.errors),
            "batch_sizes": {str(k): v for k, v in sorted(total.batches.items())},
            "retired_batch_sizes": {str(k): v for k, v in sorted(a.retired.batches.items())},
            "instances": insts,
        }


def _as_count(v: Any) -> int:
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) and v > 0 else 0


def _normalize_entry(d: Mapping[str, Any], name: str | None) -> dict[str, Any]:
    out = dict(d)
    if name is not None:
        out.setdefault("name", name)
    for canon, alias in (("arrived", "received"), ("served", "ok"), ("slo_met", "within_slo")):
        if canon not in out and alias in out:
            out[canon] = out[alias]
    errors = out.get("errors")
    if not isinstance(errors, Mapping):
        # The node's own summary counts errors as plain numbers next to deadline misses.
        built = {"deadline_missed": _as_count(out.get("deadline_missed")), "error": _as_count(errors)}
        out["errors"] = {k: v for k, v in built.items() if v}
    insts = out.get("instances")
    if isinstance(insts, Mapping):
        insts = [_normalize_entry(v, k) for k, v in insts.items() if isinstance(v, Mapping)]
    elif isinstance(insts, list):
        insts = [_normalize_entry(v, None) for v in insts if isinstance(v, Mapping)]
    else:
        insts = []
    out["instances"] = insts
    return out


def normalize_status(status: Mapping[str, Any]) -> dict[str, Any]:
    """A status dict in the shape `NodeMetrics.status` returns.

    Also accepts the node's own summary: ``apps`` keyed by name instead of a list, counters named
    ``received`` / ``ok`` / ``within_slo``, errors as plain numbers, and drops under ``drops``.
    Missing values stay missing (the CLI's `format_status` prints ``-``; Prometheus skips them).
    """
    apps = status.get("apps") or []
    if isinstance(apps, Mapping):
        apps = [_normalize_entry(v, str(k)) for k, v in apps.items() if isinstance(v, Mapping)]
    else:
        apps = [_normalize_entry(v, None) for v in apps if isinstance(v, Mapping)]
    for a in apps:
        # Sums an app summary may leave out are the sums over its instances (shadows serve nothing).
        for key in ("arrival_rps", "service_rps", "queue_len", "held"):
            if _num(a.get(key)) is None:
                vals = [_num(i.get(key)) for i in a["instances"] if i.get("role") != "shadow"]
                known = [v for v in vals if v is not None]
                if known:
                    a[key] = int(sum(known)) if key in ("queue_len", "held") else sum(known)
    drops = status.get("ingest_drops")
    if drops is None:
        drops = status.get("drops")
    return {"node": dict(status.get("node") or {}), "apps": apps, "ingest_drops": dict(drops or {}),
            "control_rejected": dict(status.get("control_rejected") or {})}


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


#: Why a request was answered with something other than a result; every app exports each at zero from
#: the start. ``error`` covers BAD_REQUEST/INTERNAL answers of an instance, ``instance_failed`` the
#: requests an instance held when it died (answered INSTANCE_FAILED by the ingest).
FAILURE_REASONS = ("deadline_missed", "error", "instance_failed")
#: Counters of an instance that its app keeps when the instance goes (`retire_into`).
RETIRED_COUNTERS = ("received", "ok", "deadline_missed", "errors", "within_slo", "busy_ms")
_INGEST_TOTALS = {
    "packets_received": ("gpuprims_ingest_packets_received", "Datagrams the ingest received"),
    "bytes_received": ("gpuprims_ingest_received_bytes", "Bytes of datagrams the ingest received"),
    "packets_accepted": ("gpuprims_ingest_packets_accepted", "Datagrams the ingest accepted into the pool"),
    "responses_sent": ("gpuprims_ingest_responses_sent", "Response datagrams the ingest sent (it sends every answer)"),
    "requests_answered": ("gpuprims_ingest_requests_answered", "Requests answered by an instance, sent by the ingest"),
    "bad_answers": ("gpuprims_ingest_refused_answers",
                    "Answers refused: the request had been taken back from the instance, or the entry was corrupt"),
    "response_send_errors": ("gpuprims_ingest_response_send_errors", "Answers that could not be sent"),
    "kernel_drops": ("gpuprims_ingest_kernel_dropped_packets", "Datagrams the kernel dropped before the ingest"),
}
_INGEST_GAUGES = {
    "free_slots": ("gpuprims_ingest_free_slots", "Free packet slots in the pool"),
    "free_records": ("gpuprims_ingest_free_records", "Free request records in the pool"),
    "held_answers": ("gpuprims_ingest_held_answers", "Answer datagrams waiting for a full send buffer"),
}


def retire_into(retired: dict[str, Any], stats: Mapping[str, Any]) -> None:
    """Bank what a gone instance counted (its last heartbeat's ``stats``) in its app's ``retired`` dict.

    The node keeps one such dict per app (``AppState.retired``) and adds it to the live instances'
    counts, so an app's counters, batch counts and duration histograms never go backwards when an
    instance is replaced (Overlapped-Execution, crash restart). Malformed histograms are skipped.
    """
    for k in RETIRED_COUNTERS:
        v = stats.get(k)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0:
            retired[k] = retired.get(k, 0) + (int(v) if k != "busy_ms" else float(v))
    bs = retired.setdefault("retired_batch_sizes", {})
    raw = stats.get("batch_sizes")
    if isinstance(raw, Mapping):
        for size, n in raw.items():
            if _is_count(n):
                bs[str(size)] = bs.get(str(size), 0) + int(n)
    with contextlib.suppress(ValueError):
        retired["retired_hist"] = add_wire(retired.get("retired_hist"), stats.get("hist"))


def _batch_counts(*sources: Any) -> dict[int, int]:
    sizes: dict[int, int] = {}
    for raw in sources:
        if not isinstance(raw, Mapping):
            continue
        for k, n in raw.items():
            with contextlib.suppress(TypeError, ValueError):
                size = int(k)
                if size >= 1:
                    sizes[size] = sizes.get(size, 0) + _as_count(n)
    return sizes


def _hists(*sources: Any) -> RequestHistograms:
    h = RequestHistograms()
    for raw in sources:
        if raw:
            with contextlib.suppress(ValueError):
                h.merge(RequestHistograms.from_wire(raw))
    return h


def _buckets(h: DurationHistogram) -> list[tuple[str, float]]:
    return [("+Inf" if math.isinf(b) else repr(float(b)), float(n)) for b, n in h.cumulative()]


class _Collector(Collector):
    """Renders a status dict (from ``source``) at scrape time on a private registry.

    Everything counted is a ``_total`` counter in base units; every series is per app (label ``app``,
    never ``instance``, which Prometheus reserves for the scrape target) and adds the app's retired
    counts (`retire_into`) to its live instances', so it never goes backwards. See docs/metrics.md.
    """

    def __init__(self, source: Callable[[], Mapping[str, Any]]) -> None:
        self._source = source

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        raw = self._source()
        st = normalize_status(raw)
        a_ = ["app"]
        c = {
            "arrived": CounterMetricFamily("gpuprims_request_arrivals", "Requests routed to the app", labels=a_),
            "served": CounterMetricFamily("gpuprims_request_success", "Requests answered with a result "
                                          "(Triton nv_inference_request_success)", labels=a_),
            "slo_met": CounterMetricFamily("gpuprims_request_within_slo", "Requests answered with a result within "
                                           "their deadline", labels=a_),
            "requeued": CounterMetricFamily("gpuprims_request_requeued", "Requests a dead instance held that went "
                                            "to another instance", labels=a_),
            "inferences": CounterMetricFamily("gpuprims_inference_count", "Requests run through the model, summed "
                                              "over batches (Triton nv_inference_count)", labels=a_),
            "batches": CounterMetricFamily("gpuprims_batch_exec", "Batches run (Triton nv_inference_exec_count)",
                                           labels=a_),
            "restarts": CounterMetricFamily("gpuprims_instance_restarts", "Instances restarted after they died",
                                            labels=a_),
        }
        failure = CounterMetricFamily("gpuprims_request_failure", "Requests answered without a result, by reason "
                                      "(Triton nv_inference_request_failure)", labels=["app", "reason"])
        hist = {
            "request": HistogramMetricFamily("gpuprims_request_duration_seconds", "First datagram received to "
                                             "answer sent, answered requests", labels=a_),
            "queue": HistogramMetricFamily("gpuprims_queue_duration_seconds", "First datagram received to the start "
                                           "of its batch's compute (Triton queue duration)", labels=a_),
            "compute": HistogramMetricFamily("gpuprims_compute_duration_seconds", "Compute time of the batch each "
                                             "request ran in (Triton compute_infer duration)", labels=a_),
        }
        batch = HistogramMetricFamily("gpuprims_batch_size", "Requests per batch run", labels=a_)
        g = {
            "gpu_share": GaugeMetricFamily("gpuprims_app_gpu_share_ratio", "The app's GPU share (CPU backend: share "
                                           "of the cores), 0-1, summed over its serving instances", labels=a_),
            "slo": GaugeMetricFamily("gpuprims_app_slo_seconds", "The app's latency SLO", labels=a_),
            "queue_len": GaugeMetricFamily("gpuprims_app_queued_requests", "Requests waiting at the app's "
                                           "instances", labels=a_),
            "held": GaugeMetricFamily("gpuprims_app_held_requests", "Requests the app's instances hold (queued "
                                      "plus running)", labels=a_),
        }
        roles = GaugeMetricFamily("gpuprims_app_instances", "Instance processes of the app by role",
                                  labels=["app", "role"])
        device = GaugeMetricFamily("gpuprims_app_device_share_ratio", "The app's share (0-1, summed over its "
                                   "serving instances) on each device it runs on (gpu: index, or cpu)",
                                   labels=["app", "gpu"])
        ad = ["app", "device"]
        ovf = {  # CPU overflow (issue 18): only apps with `overflow: cpu`
            "routed": CounterMetricFamily("gpuprims_overflow_routed", "Requests of an app with CPU overflow routed to "
                                          "each device (received by its instances there)", labels=ad),
            "answered": CounterMetricFamily("gpuprims_overflow_answered", "Requests of an app with CPU overflow "
                                            "answered by each device (any status)", labels=ad),
            "failures": CounterMetricFamily("gpuprims_overflow_cpu_instance_failures", "CPU overflow instances of "
                                            "the app that died (the accelerator path kept serving)", labels=a_),
        }
        for a in st["apps"]:
            app = str(a.get("name", "?"))
            insts = a["instances"]
            for key in ("arrived", "served", "slo_met"):
                c[key].add_metric([app], float(_as_count(a.get(key))))
            c["requeued"].add_metric([app], float(_as_count(a.get("requeued_by_crash"))))
            c["restarts"].add_metric([app], float(_as_count(a.get("restarts"))))
            reasons = dict.fromkeys(FAILURE_REASONS, 0)
            for s, n in a["errors"].items():
                reasons[str(s)] = reasons.get(str(s), 0) + _as_count(n)
            reasons["instance_failed"] += _as_count(a.get("failed_by_crash"))
            for r, n in sorted(reasons.items()):
                failure.add_metric([app, r], float(n))
            sizes = _batch_counts(a.get("retired_batch_sizes"), *(i.get("batch_sizes") for i in insts))
            c["batches"].add_metric([app], float(sum(sizes.values())))
            c["inferences"].add_metric([app], float(sum(sz * n for sz, n in sizes.items())))
            cum = [(repr(float(b)), float(sum(n for sz, n in sizes.items() if sz <= b))) for b in _BATCH_BOUNDS]
            batch.add_metric([app], [*cum, ("+Inf", float(sum(sizes.values())))],
                             float(sum(sz * n for sz, n in sizes.items())))
            h = _hists(a.get("retired_hist"), *(i.get("hist") for i in insts))
            for key, fam in hist.items():
                dh = getattr(h, key)
                fam.add_metric([app], _buckets(dh), dh.sum_s)
            serving = [_num(i.get("gpu_pct")) for i in insts if i.get("role", "active") == "active"]
            pct = sum(v for v in serving if v is not None) if any(v is not None for v in serving) \
                else _num(a.get("gpu_pct"))
            if pct is not None:
                g["gpu_share"].add_metric([app], pct / 100)
            slo = _num(a.get("slo_ms"))
            if slo is not None:
                g["slo"].add_metric([app], slo / 1000)
            for key in ("queue_len", "held"):
                g[key].add_metric([app], float(_as_count(a.get(key))))
            per_dev: dict[str, float] = {}
            for i in insts:
                if i.get("gpu") is not None and i.get("role", "active") == "active":
                    per_dev[str(i["gpu"])] = per_dev.get(str(i["gpu"]), 0.0) + (_num(i.get("gpu_pct")) or 0.0)
            for dev, v in sorted(per_dev.items()):
                device.add_metric([app, dev], v / 100)
            counts: dict[str, int] = {}
            for i in insts:
                role = str(i.get("role") or "active")
                counts[role] = counts.get(role, 0) + 1
            for role, n in sorted(counts.items()):
                roles.add_metric([app, role], float(n))
            split = a.get("overflow")
            if isinstance(split, Mapping):
                for dev in ("accelerator", "cpu"):
                    d = split.get(dev) if isinstance(split.get(dev), Mapping) else {}
                    ovf["routed"].add_metric([app, dev], float(_as_count(d.get("routed"))))
                    ovf["answered"].add_metric([app, dev], float(_as_count(d.get("answered"))))
                ovf["failures"].add_metric([app], float(_as_count(split.get("cpu_instance_failures"))))
        yield from c.values()
        yield failure
        yield from hist.values()
        yield batch
        yield from g.values()
        yield roles
        yield device
        yield from ovf.values()
        yield from _engine_families(st["apps"])
        yield from self._node_families(raw, st)

    @staticmethod
    def _node_families(raw: Mapping[str, Any], st: Mapping[str, Any]) -> Iterator[Any]:
        ingest = raw.get("ingest") if isinstance(raw.get("ingest"), Mapping) else {}
        drops = CounterMetricFamily("gpuprims_ingest_dropped", "Datagrams the ingest dropped, by reason",
                                    labels=["reason"])
        reasons = {k[5:]: v for k, v in ingest.items() if k.startswith("drop_")}
        for r, n in st["ingest_drops"].items():
            reasons.setdefault(str(r), n)
        for r, n in sorted(reasons.items()):
            drops.add_metric([r], float(_as_count(n)))
        yield drops
        reqs = CounterMetricFamily("gpuprims_ingest_requests", "Requests the ingest handled, by outcome",
                                   labels=["outcome"])
        for k, n in sorted(ingest.items()):
            if k.startswith("requests_"):
                reqs.add_metric([k[9:]], float(_as_count(n)))
        yield reqs
        for key, (name, text) in _INGEST_TOTALS.items():
            if key in ingest:
                yield CounterMetricFamily(name, text, value=float(_as_count(ingest[key])))
        for key, (name, text) in _INGEST_GAUGES.items():
            if key in ingest:
                yield GaugeMetricFamily(name, text, value=float(_as_count(ingest[key])))
        rej = CounterMetricFamily("gpuprims_control_rejected", "Control messages dropped, by reason",
                                  labels=["reason"])
        for r, n in sorted(st["control_rejected"].items()):
            rej.add_metric([str(r)], float(_as_count(n)))
        yield rej
        uptime = _num(st["node"].get("uptime_s"))
        if uptime is not None and uptime > 0:
            yield GaugeMetricFamily("gpuprims_start_time_seconds", "When the node started serving, Unix time",
                                    value=round(time.time() - uptime, 3))
        info = GaugeMetricFamily("gpuprims_build_info", "The gpuprims build serving these metrics (always 1)",
                                 labels=["version", "python", "backend"])
        info.add_metric([__version__, platform.python_version(), str(st["node"].get("backend") or "")], 1.0)
        yield info


#: Fixed batch-size bucket bounds, so histograms of all instances aggregate (max_batch <= 4096).
_BATCH_BOUNDS = tuple(2**k for k in range(13))


def _engine_families(apps: list[dict[str, Any]]) -> Iterator[Any]:
    """Per instance and stage: its engine's build time (0 on a cache hit) and whether it came from the
    engine cache (``engine`` in the instance's heartbeat, gpuprims.engines ``describe()``)."""
    labels = ["app", "instance", "stage", "kind"]
    build = GaugeMetricFamily("gpuprims_engine_build_seconds", "Time the instance's engine took to build (0 when "
                              "it came from the engine cache)", labels=labels)
    hit = GaugeMetricFamily("gpuprims_engine_cache_hit", "1 when the instance's engine came from the engine "
                            "cache, 0 when it was built at start", labels=labels)
    for a in apps:
        for i in a["instances"]:
            e = i.get("engine")
            if not isinstance(e, Mapping) or not e:
                continue
            stages = e.get("stages")
            for stage, d in (stages.items() if isinstance(stages, Mapping) else [("main", e)]):
                if not isinstance(d, Mapping) or not d.get("kind"):
                    continue
                key = [str(a.get("name", "?")), str(i.get("name", "?")), str(stage), str(d["kind"])]
                build.add_metric(key, (_num(d.get("build_ms")) or 0.0) / 1000)
                hit.add_metric(key, 1.0 if d.get("cache_hit") else 0.0)
    yield build
    yield hit


def _status_ready(status: Mapping[str, Any]) -> bool:
    """Ready: there are apps and every one has an active instance that said READY."""
    apps = status.get("apps")
    if isinstance(apps, Mapping):
        apps = list(apps.values())
    if not apps:
        return False
    for a in apps:
        insts = a.get("instances") if isinstance(a, Mapping) else None
        if isinstance(insts, Mapping):
            insts = list(insts.values())
        if not any(isinstance(i, Mapping) and i.get("role", "active") == "active" and i.get("ready", True)
                   for i in insts or ()):
            return False
    return True


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scrapes every few seconds: not worth a line
        pass


class MetricsServer:
    """Serves ``/metrics`` (Prometheus text or OpenMetrics, as the scraper asks), ``/health/live`` and
    ``/health/ready`` over HTTP on loopback until closed; any other path is 404.

    With ``metrics`` it renders that NodeMetrics at every scrape. Without, it renders the last status
    dict given to `update` (either shape `normalize_status` accepts). Either way on a private
    `CollectorRegistry` (with the ``process_*`` and ``python_info`` families), never the process-global
    one. ``ready`` decides ``/health/ready`` (default: every app has a READY active instance in the
    last status). ``port`` 0 picks a free port.
    """

    PATHS = ("/metrics", "/health/live", "/health/ready")

    def __init__(self, port: int, metrics: NodeMetrics | None = None, *, host: str = "127.0.0.1",
                 ready: Callable[[], bool] | None = None) -> None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be 0..65535 (0 = any free port), got {port!r}")
        self._host = host
        self._port = port
        self._snapshot: Mapping[str, Any] = {}
        self._snapshot_lock = threading.Lock()
        if metrics is not None:
            self.registry = metrics.registry
            self._ready = ready or (lambda: _status_ready(metrics.status()))
        else:
            self.registry = CollectorRegistry(auto_describe=False)
            self.registry.register(_Collector(self._current))
            _add_process_collectors(self.registry)
            self._ready = ready or (lambda: _status_ready(self._current()))
        self._metrics_app = make_wsgi_app(self.registry)
        self._httpd: Any = None
        self._finalizer: weakref.finalize | None = None

    def update(self, status: Mapping[str, Any]) -> None:
        """Replace the status served (only for a server made without a NodeMetrics)."""
        if not isinstance(status, Mapping):
            raise ValueError(f"status must be a mapping, got {type(status).__name__}")
        with self._snapshot_lock:
            self._snapshot = status

    def _current(self) -> Mapping[str, Any]:
        with self._snapshot_lock:
            return self._snapshot

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        if path not in self.PATHS:
            return _text(start_response, "404 Not Found", f"not found; this server has {', '.join(self.PATHS)}\n")
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            return _text(start_response, "405 Method Not Allowed", "GET or HEAD\n", [("Allow", "GET, HEAD")])
        if path == "/metrics":
            return self._metrics_app(environ, start_response)
        if path == "/health/live":
            return _text(start_response, "200 OK", "live\n")
        try:
            ok = bool(self._ready())
        except Exception:  # a failing probe means not ready, never a 500 with a traceback
            ok = False
        return _text(start_response, "200 OK" if ok else "503 Service Unavailable", "ready\n" if ok else "not ready\n")

    def start(self) -> int:
        """Start serving; return the bound port. Raises OSError (e.g. address in use) naming the port."""
        if self._httpd is not None:
            raise RuntimeError("the metrics server is already started")
        cls = _Server6 if ":" in self._host else _Server
        try:
            httpd = make_server(self._host, self._port, self._app, server_class=cls, handler_class=_QuietHandler)
        except OSError as e:
            raise OSError(e.errno, f"cannot serve metrics on {self._host}:{self._port} ({e.strerror}); "
                                   "choose another node.metrics_port or 0 to disable") from None
        thread = threading.Thread(target=httpd.serve_forever, name="gpuprims-metrics", daemon=True)
        thread.start()
        self._httpd = httpd
        self._finalizer = weakref.finalize(self, _stop_http, httpd, thread)
        return self.port

    @property
    def port(self) -> int:
        """The bound port (after start), else the requested one."""
        return int(self._httpd.server_address[1]) if self._httpd is not None else self._port

    @property
    def base_url(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}"

    @property
    def url(self) -> str:
        """The scrape URL."""
        return self.base_url + "/metrics"

    @property
    def urls(self) -> dict[str, str]:
        """Every URL served, by name: ``metrics``, ``health_live``, ``health_ready``."""
        return {p.strip("/").replace("/", "_"): self.base_url + p for p in self.PATHS}

    @property
    def paths(self) -> tuple[str, ...]:
        return self.PATHS

    def close(self) -> None:
        """Stop serving and release the port; idempotent."""
        if self._finalizer is not None:
            self._finalizer()
        self._httpd = None

    stop = close

    def __enter__(self) -> MetricsServer:
        if self._httpd is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _text(start_response: Callable[..., Any], status: str, body: str,
          headers: list[tuple[str, str]] | None = None) -> list[bytes]:
    data = body.encode()
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(data))),
                            *(headers or [])])
    return [data]


def _add_process_collectors(registry: CollectorRegistry) -> None:
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)


def _stop_http(httpd: Any, thread: threading.Thread) -> None:
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=5)


# ---- the status table
