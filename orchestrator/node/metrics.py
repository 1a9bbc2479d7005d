"""One statistics record per app, and what reads it: the node's view (``status``), Prometheus, OIP statistics.

Every update of an app's statistics goes through its `AppStatistics` (one per app, like Triton's
``InferenceStatsAggregator`` per model): the instances' heartbeats (`AppStatistics.beat`), the banking
of an instance that has gone (`AppStatistics.retire`) and the front door's inferences
(`AppStatistics.record_inference`). Three readers take the same record:

- `Node.view` puts `AppStatistics.totals` in each app's `AppView` (``totals``); the status reply is
  that view's JSON, which the CLI's ``status`` prints (`orchestrator.control.status_format`);
- `MetricsServer` renders the node's last `NodeView` as Prometheus metrics at scrape time, reading
  its records by field (roles as `Role` members), on a private `CollectorRegistry` (never the global
  one), and answers the health probes;
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
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from gpuprims import __version__
from gpuprims.stats import DurationHistogram
from orchestrator.control.records import AppView, InstanceView, NodeView, Role
from orchestrator.control.stats import merged_histograms
from orchestrator.control.values import as_count, as_number

__all__ = ["FAILURE_REASONS", "MetricsServer"]






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
                    sizes[size] = sizes.get(size, 0) + as_count(n)
    return sizes




def _buckets(h: DurationHistogram) -> list[tuple[str, float]]:
    return [("+Inf" if math.isinf(b) else repr(float(b)), float(n)) for b, n in h.cumulative()]


class _Collector(Collector):
    """Renders the node's `NodeView` (from ``source``) at scrape time on a private registry.

    ``source`` gives `Node.view`: its apps by name, each with its instances and its `AppTotals`, read by
    field. Everything counted is a ``_total`` counter in base units; every series is per app (label
    ``app``, never ``instance``, which Prometheus reserves for the scrape target) and is the app's total
    over its live and gone instances, so it never goes backwards. See docs/metrics.md.
    """

    def __init__(self, source: Callable[[], NodeView]) -> None:
        self._source = source

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        view = self._source()
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
        for name, a in view.apps.items():
            app, t = str(name), a.totals
            for key, n in (("arrived", t.received), ("served", t.ok), ("slo_met", t.within_slo),
                           ("requeued", a.requeued_by_crash), ("restarts", a.restarts)):
                c[key].add_metric([app], float(as_count(n)))
            reasons = {"deadline_missed": as_count(t.deadline_missed), "error": as_count(t.errors),
                       "instance_failed": as_count(a.failed_by_crash)}
            for r in FAILURE_REASONS:
                failure.add_metric([app, r], float(reasons[r]))
            sizes = _batch_counts(t.batch_sizes)
            c["batches"].add_metric([app], float(sum(sizes.values())))
            c["inferences"].add_metric([app], float(sum(sz * n for sz, n in sizes.items())))
            cum = [(repr(float(b)), float(sum(n for sz, n in sizes.items() if sz <= b))) for b in _BATCH_BOUNDS]
            batch.add_metric([app], [*cum, ("+Inf", float(sum(sizes.values())))],
                             float(sum(sz * n for sz, n in sizes.items())))
            h = merged_histograms(t.hist)
            for key, fam in hist.items():
                dh = getattr(h, key)
                fam.add_metric([app], _buckets(dh), dh.sum_s)
            active = a.active
            serving = [_share_pct(i) for i in active]
            pct = sum(v for v in serving if v is not None) if any(v is not None for v in serving) \
                else as_number(a.gpu_pct)
            if pct is not None:
                g["gpu_share"].add_metric([app], pct / 100)
            slo = as_number(a.slo_ms)
            if slo is not None:
                g["slo"].add_metric([app], slo / 1000)
            g["queue_len"].add_metric([app], float(as_count(t.queue_len)))
            g["held"].add_metric([app], float(as_count(t.held)))
            adm = _as_mapping(_as_mapping(t.oip).get("admission"))
            for level, n in _as_mapping(adm.get("admitted")).items():
                admitted.add_metric([app, str(level)], float(as_count(n)))
            for level, by in _as_mapping(adm.get("refused")).items():
                for reason, n in _as_mapping(by).items():
                    refused.add_metric([app, str(level), str(reason)], float(as_count(n)))
            per_dev: dict[str, float] = {}
            for i in active:
                per_dev[str(i.gpu)] = per_dev.get(str(i.gpu), 0.0) + (_share_pct(i) or 0.0)
            for dev, v in sorted(per_dev.items()):
                device.add_metric([app, dev], v / 100)
            for role in sorted(Role, key=str):
                n = len(a.with_role(role))
                if n:
                    roles.add_metric([app, str(role)], float(n))
            split = a.overflow
            if isinstance(split, Mapping):
                for dev in ("accelerator", "cpu"):
                    d = _as_mapping(split.get(dev))
                    ovf["routed"].add_metric([app, dev], float(as_count(d.get("routed"))))
                    ovf["answered"].add_metric([app, dev], float(as_count(d.get("answered"))))
                ovf["failures"].add_metric([app], float(as_count(split.get("cpu_instance_failures"))))
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
        yield from _engine_families(view.apps)
        yield from _memory_families(view)
        yield from self._node_families(view)

    @staticmethod
    def _node_families(view: NodeView) -> Iterator[Any]:
        ingest = _as_mapping(view.ingest)
        drops = CounterMetricFamily("gpuprims_ingest_dropped", "Datagrams the ingest dropped, by reason",
                                    labels=["reason"])
        reasons = {k[5:]: v for k, v in ingest.items() if k.startswith("drop_")}
        for r, n in _as_mapping(view.drops).items():  # also answers_expired: answers held for a full send buffer
            reasons.setdefault(str(r), n)
        for r, n in sorted(reasons.items()):
            drops.add_metric([r], float(as_count(n)))
        yield drops
        reqs = CounterMetricFamily("gpuprims_ingest_requests", "Requests the ingest handled, by outcome",
                                   labels=["outcome"])
        for k, n in sorted(ingest.items()):
            if k.startswith("requests_"):
                reqs.add_metric([k[9:]], float(as_count(n)))
        yield reqs
        for key, (name, text) in _INGEST_TOTALS.items():
            if key in ingest:
                yield CounterMetricFamily(name, text, value=float(as_count(ingest[key])))
        for key, (name, text) in _INGEST_GAUGES.items():
            if key in ingest:
                yield GaugeMetricFamily(name, text, value=float(as_count(ingest[key])))
        rej = CounterMetricFamily("gpuprims_control_rejected", "Control messages dropped, by reason",
                                  labels=["reason"])
        for r, n in sorted(_as_mapping(view.control_rejected).items()):
            rej.add_metric([str(r)], float(as_count(n)))
        yield rej
        node = _as_mapping(view.node)
        uptime = as_number(node.get("uptime_s"))
        if uptime is not None and uptime > 0:
            yield GaugeMetricFamily("gpuprims_start_time_seconds", "When the node started serving, Unix time",
                                    value=round(time.time() - uptime, 3))
        info = GaugeMetricFamily("gpuprims_build_info", "The gpuprims build serving these metrics (always 1)",
                                 labels=["version", "python", "backend"])
        info.add_metric([__version__, platform.python_version(), str(node.get("backend") or "")], 1.0)
        yield info


def _share_pct(i: InstanceView) -> float | None:
    """The instance's share as status shows it: its last heartbeat's figure, else the node's."""
    if i.stats is not None and i.stats.gpu_pct is not None:
        return as_number(i.stats.gpu_pct)
    return as_number(i.gpu_pct)


#: Fixed batch-size bucket bounds, so histograms of all instances aggregate (max_batch <= 4096).
_BATCH_BOUNDS = tuple(2**k for k in range(13))


def _engine_families(apps: Mapping[str, AppView]) -> Iterator[Any]:
    """Per instance and stage: its engine's build time (0 on a cache hit) and whether it came from the
    engine cache (the instance's ``engine``, gpuprims.engines ``describe()``)."""
    labels = ["app", "instance", "stage", "kind"]
    build = GaugeMetricFamily("gpuprims_engine_build_seconds", "Time the instance's engine took to build (0 when "
                              "it came from the engine cache)", labels=labels)
    hit = GaugeMetricFamily("gpuprims_engine_cache_hit", "1 when the instance's engine came from the engine "
                            "cache, 0 when it was built at start", labels=labels)
    for name, a in apps.items():
        for i in a.instances:
            e = i.engine
            if not isinstance(e, Mapping) or not e:
                continue
            stages = e.get("stages")
            for stage, d in (stages.items() if isinstance(stages, Mapping) else [("main", e)]):
                if not isinstance(d, Mapping) or not d.get("kind"):
                    continue
                key = [str(name), i.name, str(stage), str(d["kind"])]
                build.add_metric(key, (as_number(d.get("build_ms")) or 0.0) / 1000)
                hit.add_metric(key, 1.0 if d.get("cache_hit") else 0.0)
    yield build
    yield hit


_MEMORY_KINDS = (("pss", "pss_bytes"), ("device", "device_bytes"))


def _memory_families(view: NodeView) -> Iterator[Any]:
    """Memory (orchestrator/control/memory.py): each instance's and app's PSS and device memory, each of the node's
    own processes' PSS (node, fork servers, Param-Share holders), and the whole tree's. A figure not known
    (not read yet, unreadable, no device memory on the CPU backend) has no sample."""
    inst = GaugeMetricFamily("gpuprims_instance_memory_bytes", "An instance process's memory: kind=pss its "
                             "proportional set size, kind=device the device memory it allocated",
                             labels=["app", "instance", "kind"])
    app_fam = GaugeMetricFamily("gpuprims_app_memory_bytes", "The app's instances' memory summed (actives, "
                                "shadow, draining, overflow), by kind (pss, device)", labels=["app", "kind"])
    for name, a in view.apps.items():
        for key, field_ in _MEMORY_KINDS:
            v = as_number(_as_mapping(a.memory).get(field_))
            if v is not None:
                app_fam.add_metric([str(name), key], v)
        for i in a.instances:
            for key, field_ in _MEMORY_KINDS:
                v = as_number(_as_mapping(i.memory).get(field_))
                if v is not None:
                    inst.add_metric([str(name), i.name, key], v)
    mem = _as_mapping(_as_mapping(view.node).get("memory"))
    procs = GaugeMetricFamily("gpuprims_node_process_memory_bytes", "PSS of the node's processes other than "
                              "instances: the node itself, its fork servers, its Param-Share holders",
                              labels=["process", "pid"])
    for p in mem.get("processes") or ():
        v = as_number(_as_mapping(p).get("pss_bytes"))
        if v is not None:
            procs.add_metric([str(p.get("kind", "?")), str(p.get("pid", "?"))], v)
    whole = GaugeMetricFamily("gpuprims_node_memory_bytes", "The whole node's memory (its processes and every "
                              "instance), by kind (pss, device)", labels=["kind"])
    for key, field_ in _MEMORY_KINDS:
        v = as_number(_as_mapping(mem.get("total")).get(field_))
        if v is not None:
            whole.add_metric([key], v)
    yield inst
    yield app_fam
    yield procs
    yield whole


def _as_mapping(v: Any) -> Mapping[str, Any]:
    return v if isinstance(v, Mapping) else {}


def _view_ready(view: NodeView) -> bool:
    """Ready: there are apps and every one has an active instance that said READY."""
    return bool(view.apps) and all(any(i.ready for i in a.active) for a in view.apps.values())


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

    It renders the last `NodeView` given to `update` (`Node.view`) at every scrape, on a private
    `CollectorRegistry` (with the ``process_*`` and ``python_info`` families), never the
    process-global one. ``ready`` decides ``/health/ready`` (default: every app has a READY active
    instance in the last view). ``port`` 0 picks a free port.
    """

    PATHS = ("/metrics", "/health/live", "/health/ready")

    def __init__(self, port: int, *, host: str = "127.0.0.1", ready: Callable[[], bool] | None = None) -> None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be 0..65535 (0 = any free port), got {port!r}")
        self._host = host
        self._port = port
        self._snapshot = NodeView()
        self._snapshot_lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self._current))
        _add_process_collectors(self.registry)
        self._ready = ready or (lambda: _view_ready(self._current()))
        self._metrics_app = make_wsgi_app(self.registry)
        self._httpd: Any = None
        self._finalizer: weakref.finalize | None = None

    def update(self, view: NodeView) -> None:
        """Replace the node's view served (`Node.view`). A status reply's dict is refused: the control
        edge reads one into a `NodeView` with `NodeView.from_dict` first."""
        if not isinstance(view, NodeView):
            raise ValueError(f"MetricsServer.update takes a NodeView (Node.view()), got {type(view).__name__}; "
                             "read a status reply with NodeView.from_dict first")
        with self._snapshot_lock:
            self._snapshot = view

    def _current(self) -> NodeView:
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
