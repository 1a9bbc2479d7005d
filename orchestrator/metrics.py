"""One statistics record per app, and what reads it: the ``status`` dict, Prometheus, OIP statistics.

Every update of an app's statistics goes through its `AppStatistics` (one per app, like Triton's
``InferenceStatsAggregator`` per model): the instances' heartbeats (`AppStatistics.beat`), the banking
of an instance that has gone (`AppStatistics.retire`) and the front door's inferences
(`AppStatistics.record_inference`). Three readers take the same record:

- `Node.status` puts `AppStatistics.totals` in each app's entry; the CLI's ``status`` prints it
  (`orchestrator.status_format`);
- `MetricsServer` renders that status dict as Prometheus metrics at scrape time, on a private
  `CollectorRegistry` (never the global one), and answers the health probes;
- the front door's statistics extension answers `AppStatistics.model_statistics` (Triton's counting:
  ``queue`` and ``compute_*`` one per successful inference, as perf_analyzer needs).

Counters are cumulative since an instance started, so a lost heartbeat loses nothing; an app's
counters add the banked counts of its gone instances to its live ones', so they never go backwards.
Durations are the instances' fixed-bucket histograms (`gpuprims.stats.RequestHistograms`), which add
up exactly across instances.
"""

from __future__ import annotations

import contextlib
import math
import platform
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from gpuprims import __version__
from gpuprims.stats import DurationHistogram, RequestHistograms, add_wire

__all__ = ["FAILURE_REASONS", "AppStatistics", "MetricsServer", "NodeLoad"]

#: Status rates are over about this many seconds of heartbeats (not since the instance started).
RATE_WINDOW_S = 5.0
#: Cumulative counters of an instance's heartbeat that its app adds up (and banks when it goes).
COUNTERS = ("received", "ok", "deadline_missed", "errors", "within_slo", "busy_ms")
#: Roles whose recent latency makes the app's p50/p99 (they serve the app's traffic).
SERVING_ROLES = ("active", "overflow")


def _as_count(v: Any) -> int:
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) and v > 0 else 0


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


@dataclass
class Duration:
    """A Triton ``StatisticDuration``: how many, and their total in ns."""

    count: int = 0
    ns: int = 0

    def add(self, ns: int) -> None:
        self.count += 1
        self.ns += max(0, int(ns))

    def as_dict(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class FrontDoorCounts:
    """What the front door counts of an app's inferences (one inference = N rows = N wire requests)."""

    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    node: Duration = field(default_factory=Duration)  # successful inferences' round trips through the node
    inference_count: int = 0  # rows answered OK
    execution_count: int = 0  # inferences answered OK
    last_inference_ms: int = 0  # Unix time of the last inference answered OK
    statuses: dict[str, int] = field(default_factory=dict)  # row answers by wire status name (LOST: none)
    admitted: dict[int, int] = field(default_factory=dict)  # inferences admitted, by priority level
    refused: dict[tuple[int, str], int] = field(default_factory=dict)  # refused, by (level, reason)

    def as_dict(self) -> dict[str, Any]:
        refused: dict[str, dict[str, int]] = {}
        for (level, reason), n in sorted(self.refused.items()):
            refused.setdefault(str(level), {})[reason] = n
        return {"success": self.success.as_dict(), "fail": self.fail.as_dict(), "node": self.node.as_dict(),
                "inference_count": self.inference_count, "execution_count": self.execution_count,
                "last_inference_ms": self.last_inference_ms, "statuses": dict(self.statuses),
                "admission": {"admitted": {str(k): n for k, n in sorted(self.admitted.items())}, "refused": refused}}


@dataclass(frozen=True)
class NodeLoad:
    """What an app's live instances said in their last heartbeats, summed: the front door's admission
    reads it (orchestrator/frontdoor/admission.py). Cumulative counters since each instance started."""

    held: int = 0  # requests queued or running at the instances
    batches: int = 0
    rows_run: int = 0  # requests run through the model (answered OK or with a model error)
    busy_ms: float = 0.0  # time spent running the model
    instances: int = 0  # live instances that heartbeat


@dataclass
class _Live:
    stats: dict[str, Any]
    history: list[tuple[float, float, float]]  # (t, received, answered) of recent heartbeats


class AppStatistics:
    """The one statistics record of an app; thread-safe (the front door counts from its own thread).

    It keeps the last heartbeat of each live instance (with rates over the last `RATE_WINDOW_S`), the
    banked counters, batch sizes and duration histograms of the instances that have gone, and the
    front door's counts. `totals` is the app's part of ``status`` (and so of Prometheus);
    `model_statistics` is the OIP statistics extension's answer for the app.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, _Live] = {}
        self._retired: dict[str, Any] = {}
        self._retired_sizes: dict[str, int] = {}
        self._retired_hist: dict[str, Any] = {}
        self._door = FrontDoorCounts()

    def beat(self, instance: str, stats: Mapping[str, Any], now_s: float) -> dict[str, Any]:
        """Record an instance's heartbeat ``stats`` received at ``now_s`` (monotonic seconds).

        Returns the record kept (a copy of ``stats`` whose ``arrival_rps`` / ``service_rps`` are over
        the last few seconds of heartbeats rather than since the instance started).
        """
        rec = dict(stats)
        answered = sum(float(_as_count(rec.get(k))) for k in ("ok", "deadline_missed", "errors"))
        with self._lock:
            live = self._live.get(instance)
            if live is None:
                live = self._live[instance] = _Live(rec, [])
            hist = live.history
            hist.append((now_s, float(_as_count(rec.get("received"))), answered))
            while len(hist) > 2 and now_s - hist[1][0] >= RATE_WINDOW_S:
                hist.pop(0)
            (t0, r0, s0), (t1, r1, s1) = hist[0], hist[-1]
            if t1 - t0 > 0.2:
                rec["arrival_rps"], rec["service_rps"] = (r1 - r0) / (t1 - t0), (s1 - s0) / (t1 - t0)
            live.stats = rec
        return rec

    def retire(self, instance: str) -> None:
        """Bank what a gone instance counted (its last heartbeat), so the app's counters, batch counts
        and duration histograms never go back when an instance is replaced (Overlapped-Execution, a
        crash restart). Unknown names and malformed histograms are ignored."""
        with self._lock:
            live = self._live.pop(instance, None)
            if live is None:
                return
            s = live.stats
            for k in COUNTERS:
                v = _num(s.get(k))
                if v is not None and v > 0:
                    self._retired[k] = self._retired.get(k, 0) + (v if k == "busy_ms" else int(v))
            _add_sizes(self._retired_sizes, s.get("batch_sizes"))
            with contextlib.suppress(ValueError):
                self._retired_hist = add_wire(self._retired_hist, s.get("hist"))

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the records of instances not in ``keep`` without banking them (shadows that exited:
        they served nothing)."""
        names = set(keep)
        with self._lock:
            for gone in [n for n in self._live if n not in names]:
                del self._live[gone]

    def record_inference(self, *, rows: int, duration_ns: int, ok: bool, statuses: Mapping[str, int],
                         node_ns: int | None = None) -> None:
        """One front-door inference of ``rows`` rows took ``duration_ns`` (``node_ns`` of it in the node:
        from its rows' submit to their answers, default the whole); ``statuses`` counts its rows'
        answers by wire status name (``LOST`` for a row that got none)."""
        with self._lock:
            d = self._door
            (d.success if ok else d.fail).add(duration_ns)
            if ok:
                d.node.add(duration_ns if node_ns is None else node_ns)
                d.inference_count += rows
                d.execution_count += 1
                d.last_inference_ms = int(time.time() * 1e3)
            for k, n in statuses.items():
                d.statuses[k] = d.statuses.get(k, 0) + int(n)

    def record_admission(self, level: int, reason: str | None) -> None:
        """One inference at the front door's admission: admitted at priority ``level`` (``reason``
        None), or refused for ``reason`` (``queue_full``, ``predicted_late``)."""
        with self._lock:
            d = self._door
            if reason is None:
                d.admitted[level] = d.admitted.get(level, 0) + 1
            else:
                d.refused[(level, reason)] = d.refused.get((level, reason), 0) + 1

    def node_load(self) -> NodeLoad:
        """The live instances' last heartbeats, summed (cheap: no histograms)."""
        with self._lock:
            lives = [lv.stats for lv in self._live.values()]
        return NodeLoad(held=sum(_as_count(s.get("held")) for s in lives),
                        batches=sum(_as_count(s.get("batches")) for s in lives),
                        rows_run=sum(_as_count(s.get("ok")) + _as_count(s.get("errors")) for s in lives),
                        busy_ms=sum(_num(s.get("busy_ms")) or 0.0 for s in lives), instances=len(lives))

    def _merged(self) -> tuple[dict[str, Any], dict[str, int], RequestHistograms]:
        totals: dict[str, Any] = dict.fromkeys(COUNTERS, 0)
        for k, v in self._retired.items():
            totals[k] += v
        sizes = dict(self._retired_sizes)
        hist = _hists(self._retired_hist)
        for live in self._live.values():
            s = live.stats
            for k in COUNTERS:
                v = _num(s.get(k))
                if v is not None and v > 0:
                    totals[k] += v if k == "busy_ms" else int(v)
            _add_sizes(sizes, s.get("batch_sizes"))
            with contextlib.suppress(ValueError):
                if s.get("hist"):
                    hist.merge(RequestHistograms.from_wire(s["hist"]))
        return totals, sizes, hist

    def totals(self, roles: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The app's statistics for ``status``: cumulative counters (live plus gone instances),
        ``batch_sizes`` and ``hist`` (the duration histograms Prometheus exports), rates, queue and
        held requests (of instances that serve), p50/p99 of the recent window, SLO attainment, and
        the front door's counts (``oip``).

        ``roles`` maps each instance the node has to its role; records of other instances are
        dropped first (`forget`). p50 is the serving instances' p50 weighted by what each served,
        p99 the worst serving instance's (an upper bound of the app's).
        """
        if roles is not None:
            self.forget(roles)
        roles = roles or {}
        with self._lock:
            totals, sizes, hist = self._merged()
            lives = [(n, lv.stats) for n, lv in self._live.items()]
            door = self._door.as_dict()
        serving = [(n, s) for n, s in lives if roles.get(n, "active") in SERVING_ROLES]
        live = [s for _, s in serving if _num(s.get("p50_ms")) is not None]
        weight = sum(max(1, _as_count(s.get("ok"))) for s in live)
        answered = totals["ok"] + totals["deadline_missed"] + totals["errors"]
        not_shadow = [s for n, s in lives if roles.get(n, "active") != "shadow"]
        totals.update({
            "p50_ms": sum(float(s["p50_ms"]) * max(1, _as_count(s.get("ok"))) for s in live) / weight
            if live else None,
            "p99_ms": max((float(s["p99_ms"]) for s in live if _num(s.get("p99_ms")) is not None), default=None),
            "arrival_rps": sum(_num(s.get("arrival_rps")) or 0.0 for _, s in lives),
            "service_rps": sum(_num(s.get("service_rps")) or 0.0 for _, s in lives),
            "queue_len": sum(_as_count(s.get("queue_len")) for s in not_shadow),
            "held": sum(_as_count(s.get("held")) for s in not_shadow),
            "slo_attainment": totals["within_slo"] / answered if answered else None,
            "batch_sizes": {str(k): n for k, n in sorted(sizes.items())},
            "hist": hist.to_wire(),
            "oip": door,
        })
        return totals

    def model_statistics(self, name: str) -> dict[str, Any]:
        """The Triton ``ModelStatistics`` of the app as model ``name``, version ``1``: success/fail,
        inference and execution counts and the last inference as the front door counted them.

        As Triton's, ``queue`` and the three ``compute_*`` entries count one per successful inference
        (perf_analyzer run without ``-x`` picks the model version whose ``queue`` count grew during its
        measurement, and refuses compute counts that differ). The front door sees an inference's time in
        the node as one span, reported as ``compute_infer``; ``queue``, ``compute_input`` and
        ``compute_output`` carry 0 ns. The node's own queue and compute durations (every request of the
        app, from any client) are in the same record's ``hist``: ``status`` and
        ``gpuprims_queue_duration_seconds`` / ``gpuprims_compute_duration_seconds``."""
        with self._lock:
            d = self._door
            door = (d.success.as_dict(), d.fail.as_dict(), d.node.as_dict(), d.inference_count,
                    d.execution_count, d.last_inference_ms)
        zero = Duration().as_dict()
        success, fail, node, inferences, executions, last_ms = door
        counted = {"count": success["count"], "ns": 0}
        return {
            "name": name, "version": "1", "last_inference": last_ms,
            "inference_count": inferences, "execution_count": executions,
            "inference_stats": {"success": success, "fail": fail,
                                "queue": counted, "compute_input": counted,
                                "compute_infer": node, "compute_output": counted,
                                "cache_hit": zero, "cache_miss": zero},
            "batch_stats": [],
        }


def _add_sizes(into: dict[str, int], raw: Any) -> None:
    if isinstance(raw, Mapping):
        for size, n in raw.items():
            if _is_count(n):
                into[str(size)] = into.get(str(size), 0) + int(n)


#: Why a request was answered with something other than a result; every app exports each at zero from
#: the start. ``error`` covers BAD_REQUEST/INTERNAL answers of an instance, ``instance_failed`` the
#: requests an instance held when it died (answered INSTANCE_FAILED by the ingest).
FAILURE_REASONS = ("deadline_missed", "error", "instance_failed")
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

    ``source`` gives `Node.status`'s dict: ``apps`` by name, each with its `AppStatistics.totals`.
    Everything counted is a ``_total`` counter in base units; every series is per app (label ``app``,
    never ``instance``, which Prometheus reserves for the scrape target) and is the app's total over
    its live and gone instances, so it never goes backwards. See docs/metrics.md.
    """

    def __init__(self, source: Callable[[], Mapping[str, Any]]) -> None:
        self._source = source

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        st = self._source()
        apps = st.get("apps")
        apps = apps if isinstance(apps, Mapping) else {}
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
        admitted = CounterMetricFamily("gpuprims_frontdoor_admitted", "Inferences the HTTP/gRPC front door admitted, "
                                       "by priority level (1 highest)", labels=["app", "level"])
        refused = CounterMetricFamily("gpuprims_frontdoor_refused", "Inferences the HTTP/gRPC front door refused at "
                                      "admission, by priority level and reason", labels=["app", "level", "reason"])
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
        for name, a in apps.items():
            if not isinstance(a, Mapping):
                continue
            app = str(name)
            insts = [i for i in a.get("instances") or () if isinstance(i, Mapping)]
            for key, field_ in (("arrived", "received"), ("served", "ok"), ("slo_met", "within_slo")):
                c[key].add_metric([app], float(_as_count(a.get(field_))))
            c["requeued"].add_metric([app], float(_as_count(a.get("requeued_by_crash"))))
            c["restarts"].add_metric([app], float(_as_count(a.get("restarts"))))
            reasons = {"deadline_missed": _as_count(a.get("deadline_missed")), "error": _as_count(a.get("errors")),
                       "instance_failed": _as_count(a.get("failed_by_crash"))}
            for r in FAILURE_REASONS:
                failure.add_metric([app, r], float(reasons[r]))
            sizes = _batch_counts(a.get("batch_sizes"))
            c["batches"].add_metric([app], float(sum(sizes.values())))
            c["inferences"].add_metric([app], float(sum(sz * n for sz, n in sizes.items())))
            cum = [(repr(float(b)), float(sum(n for sz, n in sizes.items() if sz <= b))) for b in _BATCH_BOUNDS]
            batch.add_metric([app], [*cum, ("+Inf", float(sum(sizes.values())))],
                             float(sum(sz * n for sz, n in sizes.items())))
            h = _hists(a.get("hist"))
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
            door = a.get("oip") if isinstance(a.get("oip"), Mapping) else {}
            adm = door.get("admission") if isinstance(door.get("admission"), Mapping) else {}
            for level, n in (adm.get("admitted") or {}).items():
                admitted.add_metric([app, str(level)], float(_as_count(n)))
            for level, by in (adm.get("refused") or {}).items():
                for reason, n in (by.items() if isinstance(by, Mapping) else ()):
                    refused.add_metric([app, str(level), str(reason)], float(_as_count(n)))
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
        yield admitted
        yield refused
        yield roles
        yield device
        yield from ovf.values()
        yield from _engine_families(apps)
        yield from _memory_families(st, apps)
        yield from self._node_families(st)

    @staticmethod
    def _node_families(st: Mapping[str, Any]) -> Iterator[Any]:
        ingest = st.get("ingest") if isinstance(st.get("ingest"), Mapping) else {}
        drops = CounterMetricFamily("gpuprims_ingest_dropped", "Datagrams the ingest dropped, by reason",
                                    labels=["reason"])
        reasons = {k[5:]: v for k, v in ingest.items() if k.startswith("drop_")}
        status_drops = st.get("drops")  # also answers_expired: answers held for a full send buffer, expired
        for r, n in (status_drops.items() if isinstance(status_drops, Mapping) else ()):
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
        rejected = st.get("control_rejected")
        for r, n in sorted(rejected.items() if isinstance(rejected, Mapping) else ()):
            rej.add_metric([str(r)], float(_as_count(n)))
        yield rej
        node = st.get("node") if isinstance(st.get("node"), Mapping) else {}
        uptime = _num(node.get("uptime_s"))
        if uptime is not None and uptime > 0:
            yield GaugeMetricFamily("gpuprims_start_time_seconds", "When the node started serving, Unix time",
                                    value=round(time.time() - uptime, 3))
        info = GaugeMetricFamily("gpuprims_build_info", "The gpuprims build serving these metrics (always 1)",
                                 labels=["version", "python", "backend"])
        info.add_metric([__version__, platform.python_version(), str(node.get("backend") or "")], 1.0)
        yield info


#: Fixed batch-size bucket bounds, so histograms of all instances aggregate (max_batch <= 4096).
_BATCH_BOUNDS = tuple(2**k for k in range(13))


def _engine_families(apps: Mapping[str, Any]) -> Iterator[Any]:
    """Per instance and stage: its engine's build time (0 on a cache hit) and whether it came from the
    engine cache (``engine`` in the instance's heartbeat, gpuprims.engines ``describe()``)."""
    labels = ["app", "instance", "stage", "kind"]
    build = GaugeMetricFamily("gpuprims_engine_build_seconds", "Time the instance's engine took to build (0 when "
                              "it came from the engine cache)", labels=labels)
    hit = GaugeMetricFamily("gpuprims_engine_cache_hit", "1 when the instance's engine came from the engine "
                            "cache, 0 when it was built at start", labels=labels)
    for name, a in apps.items():
        if not isinstance(a, Mapping):
            continue
        for i in a.get("instances") or ():
            e = i.get("engine") if isinstance(i, Mapping) else None
            if not isinstance(e, Mapping) or not e:
                continue
            stages = e.get("stages")
            for stage, d in (stages.items() if isinstance(stages, Mapping) else [("main", e)]):
                if not isinstance(d, Mapping) or not d.get("kind"):
                    continue
                key = [str(name), str(i.get("name", "?")), str(stage), str(d["kind"])]
                build.add_metric(key, (_num(d.get("build_ms")) or 0.0) / 1000)
                hit.add_metric(key, 1.0 if d.get("cache_hit") else 0.0)
    yield build
    yield hit


_MEMORY_KINDS = (("pss", "pss_bytes"), ("device", "device_bytes"))


def _memory_families(st: Mapping[str, Any], apps: Mapping[str, Any]) -> Iterator[Any]:
    """Memory (orchestrator/memory.py): each instance's and app's PSS and device memory, each of the node's
    own processes' PSS (node, fork servers, Param-Share holders), and the whole tree's. A figure not known
    (not read yet, unreadable, no device memory on the CPU backend) has no sample."""
    inst = GaugeMetricFamily("gpuprims_instance_memory_bytes", "An instance process's memory: kind=pss its "
                             "proportional set size, kind=device the device memory it allocated",
                             labels=["app", "instance", "kind"])
    app_fam = GaugeMetricFamily("gpuprims_app_memory_bytes", "The app's instances' memory summed (actives, "
                                "shadow, draining, overflow), by kind (pss, device)", labels=["app", "kind"])
    for name, a in apps.items():
        if not isinstance(a, Mapping):
            continue
        for key, field_ in _MEMORY_KINDS:
            v = _num(_as_mapping(a.get("memory")).get(field_))
            if v is not None:
                app_fam.add_metric([str(name), key], v)
        for i in a.get("instances") or ():
            if not isinstance(i, Mapping):
                continue
            for key, field_ in _MEMORY_KINDS:
                v = _num(_as_mapping(i.get("memory")).get(field_))
                if v is not None:
                    inst.add_metric([str(name), str(i.get("name", "?")), key], v)
    mem = _as_mapping(_as_mapping(st.get("node")).get("memory"))
    procs = GaugeMetricFamily("gpuprims_node_process_memory_bytes", "PSS of the node's processes other than "
                              "instances: the node itself, its fork servers, its Param-Share holders",
                              labels=["process", "pid"])
    for p in mem.get("processes") or ():
        v = _num(_as_mapping(p).get("pss_bytes"))
        if v is not None:
            procs.add_metric([str(p.get("kind", "?")), str(p.get("pid", "?"))], v)
    whole = GaugeMetricFamily("gpuprims_node_memory_bytes", "The whole node's memory (its processes and every "
                              "instance), by kind (pss, device)", labels=["kind"])
    for key, field_ in _MEMORY_KINDS:
        v = _num(_as_mapping(mem.get("total")).get(field_))
        if v is not None:
            whole.add_metric([key], v)
    yield inst
    yield app_fam
    yield procs
    yield whole


def _as_mapping(v: Any) -> Mapping[str, Any]:
    return v if isinstance(v, Mapping) else {}


def _status_ready(status: Mapping[str, Any]) -> bool:
    """Ready: there are apps and every one has an active instance that said READY."""
    apps = status.get("apps")
    if not isinstance(apps, Mapping) or not apps:
        return False
    for a in apps.values():
        insts = a.get("instances") if isinstance(a, Mapping) else None
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

    It renders the last status dict given to `update` (`Node.status`'s shape) at every scrape, on a
    private `CollectorRegistry` (with the ``process_*`` and ``python_info`` families), never the
    process-global one. ``ready`` decides ``/health/ready`` (default: every app has a READY active
    instance in the last status). ``port`` 0 picks a free port.
    """

    PATHS = ("/metrics", "/health/live", "/health/ready")

    def __init__(self, port: int, *, host: str = "127.0.0.1", ready: Callable[[], bool] | None = None) -> None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be 0..65535 (0 = any free port), got {port!r}")
        self._host = host
        self._port = port
        self._snapshot: Mapping[str, Any] = {}
        self._snapshot_lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self._current))
        _add_process_collectors(self.registry)
        self._ready = ready or (lambda: _status_ready(self._current()))
        self._metrics_app = make_wsgi_app(self.registry)
        self._httpd: Any = None
        self._finalizer: weakref.finalize | None = None

    def update(self, status: Mapping[str, Any]) -> None:
        """Replace the status served (`Node.status`'s shape)."""
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
