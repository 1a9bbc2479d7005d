"""The one statistics record per app (AppStatistics) and its three readers: status, Prometheus, OIP."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuprims import __version__
from gpuprims.stats import RequestHistograms
from orchestrator.control.records import InstanceStats, NodeView, Role
from orchestrator.control.stats import AppStatistics
from orchestrator.control.status_format import format_status
from orchestrator.node.metrics import MetricsServer, _Collector

pytestmark = pytest.mark.timeout(60)


def _hist_wire(request_s: list[float]) -> dict[str, Any]:
    h = RequestHistograms()
    h.request.observe(request_s)
    h.queue.observe([v / 2 for v in request_s])
    h.compute.observe([v / 2 for v in request_s])
    return h.to_wire()


def _beat(received: int, ok: int = 0, *, deadline_missed: int = 0, errors: int = 0, within_slo: int | None = None,
          p50_ms: float | None = None, p99_ms: float | None = None, queue_len: int = 0, busy_ms: float = 0.0,
          batch_sizes: dict[str, int] | None = None, request_s: list[float] | None = None) -> InstanceStats:
    """A heartbeat's stats as an instance sends them (orchestrator/worker/instance.py LatencyStats.snapshot)."""
    return InstanceStats(received=received, ok=ok, deadline_missed=deadline_missed, errors=errors,
                         within_slo=ok if within_slo is None else within_slo, p50_ms=p50_ms, p99_ms=p99_ms,
                         queue_len=queue_len, held=queue_len, busy_ms=busy_ms, batch_sizes=batch_sizes or {},
                         hist=_hist_wire(request_s or []))


def _node_status(apps: dict[str, tuple[AppStatistics, dict[str, Any], list[dict[str, Any]]]],
                 **extra: Any) -> dict[str, Any]:
    """`Node.status`'s shape from each app's record, its config fields and its instances' entries."""
    out: dict[str, Any] = {}
    for name, (agg, fields, insts) in apps.items():
        roles = {i["name"]: Role(i.get("role", "active")) for i in insts}
        out[name] = {**fields, **agg.totals(roles).to_dict(), "instances": insts}
    return {"node": {"backend": "cpu", "pid": 1, "run_dir": "/r", "ports": [9000], "uptime_s": 3.0},
            "apps": out, **extra}


def _view(status: dict[str, Any]) -> NodeView:
    """The node's `NodeView` of a status dict (`NodeView.from_dict`, as the control edge reads a status
    reply); an app's or instance's required field a test leaves out takes a plain default."""
    apps = {name: {"app_id": 0, "model": None, "slo_ms": 50.0, "gpu_pct": 0, "gpu": 0, **a,
                   "instances": [{"pid": 1, "ready": True, "gpu_pct": 0, "gpu": 0, "consumer": 0, **i}
                                 for i in a.get("instances", [])]}
            for name, a in status.get("apps", {}).items()}
    return NodeView.from_dict({**status, "apps": apps})


# ---- the record


def test_rates_are_over_the_recent_heartbeats() -> None:
    agg = AppStatistics()
    first = agg.beat("det-0", _beat(0), now_s=100.0)
    assert first == _beat(0)  # one heartbeat: no window yet, the instance's own rates
    rec = agg.beat("det-0", _beat(100, 60, deadline_missed=20, within_slo=50), now_s=102.0)
    assert rec.arrival_rps == pytest.approx(50) and rec.service_rps == pytest.approx(40)
    # The window starts at the newest heartbeat at least RATE_WINDOW_S old: the ones before stop counting.
    agg.beat("det-0", _beat(100, 80, deadline_missed=20), now_s=110.0)
    rec = agg.beat("det-0", _beat(110, 90, deadline_missed=20), now_s=111.0)
    assert rec.arrival_rps == pytest.approx((110 - 100) / 9) and rec.service_rps == pytest.approx((110 - 80) / 9)
    t = agg.totals({"det-0": Role.ACTIVE})
    assert t.received == 110 and t.ok == 90 and t.deadline_missed == 20
    assert t.slo_attainment == pytest.approx(90 / 110)


def test_totals_weigh_serving_instances_and_leave_out_shadows() -> None:
    agg = AppStatistics()
    agg.beat("a-0", _beat(10, 10, p50_ms=5.0, p99_ms=6.0, queue_len=1), now_s=1.0)
    agg.beat("a-1", _beat(30, 30, p50_ms=9.0, p99_ms=20.0, queue_len=2), now_s=1.0)
    agg.beat("a-s", _beat(0, 0, p50_ms=100.0, p99_ms=100.0, queue_len=7), now_s=1.0)
    t = agg.totals({"a-0": Role.ACTIVE, "a-1": Role.ACTIVE, "a-s": Role.SHADOW})
    assert t.p50_ms == pytest.approx((5 * 10 + 9 * 30) / 40) and t.p99_ms == 20.0
    assert t.queue_len == 3 and t.held == 3
    # An instance the node no longer has (a shadow that exited) is dropped, not banked.
    t = agg.totals({"a-0": Role.ACTIVE, "a-1": Role.ACTIVE})
    assert t.received == 40


def test_counters_never_go_backwards_when_an_instance_goes() -> None:
    agg = AppStatistics()
    agg.beat("a-0", _beat(10, 10, busy_ms=5.0, batch_sizes={"1": 4, "2": 3}, request_s=[0.001, 0.5]), now_s=1.0)
    agg.retire("a-0")
    agg.retire("a-0")  # twice, or an unknown name: nothing happens
    agg.retire("nope")
    agg.beat("a-s1", _beat(2, 2, busy_ms=1.0, batch_sizes={"1": 2}, request_s=[0.001]), now_s=2.0)
    t = agg.totals({"a-s1": Role.ACTIVE})
    assert t.received == 12 and t.ok == 12 and t.busy_ms == pytest.approx(6.0)
    assert t.batch_sizes == {"1": 6, "2": 3}
    assert RequestHistograms.from_wire(t.hist).request.count == 3


@pytest.mark.parametrize("bad", [{"received": "lots"}, {"ok": -3}, {"errors": None}, {"p50_ms": float("nan")},
                                 {"held": True}, {"hist": []}, {"nope": 1}, [1]])
def test_a_malformed_heartbeat_is_refused_whole(bad: Any) -> None:
    """A heartbeat body crosses a process boundary: from_wire refuses it (the channel counts it as
    ``malformed`` and drops it) rather than the statistics reading a wrong figure as zero."""
    with pytest.raises(ValueError, match="InstanceStats"):
        InstanceStats.from_wire(bad)


def test_malformed_batch_sizes_and_histograms_count_as_nothing() -> None:
    agg = AppStatistics()
    agg.beat("a-0", InstanceStats.from_wire({"batch_sizes": {"1": "x", "2": 1}, "hist": {"request": {"counts": [1]}}}),
             now_s=1.0)
    agg.retire("a-0")
    t = agg.totals({})
    assert t.received == 0 and t.ok == 0 and t.batch_sizes == {"2": 1} and t.p50_ms is None
    json.dumps(t.to_dict())


def test_one_record_feeds_status_prometheus_and_the_oip_statistics() -> None:
    """Triton's InferenceStatsAggregator: the statistics API and the metrics read the same figures."""
    agg = AppStatistics()
    agg.beat("det-0", _beat(5, 4, errors=1, batch_sizes={"2": 2}, request_s=[0.002, 0.004, 0.006, 0.1]), now_s=1.0)
    agg.record_inference(rows=2, duration_ns=3_000_000, ok=True, statuses={"OK": 2}, node_ns=2_500_000)
    agg.record_inference(rows=1, duration_ns=1_000_000, ok=False, statuses={"LOST": 1})
    oip = agg.model_statistics("det")
    assert oip["inference_count"] == 2 and oip["execution_count"] == 1 and oip["last_inference"] > 0
    assert oip["inference_stats"]["success"] == {"count": 1, "ns": 3_000_000}
    assert oip["inference_stats"]["fail"] == {"count": 1, "ns": 1_000_000}
    status = _node_status({"det": (agg, {"app_id": 1, "slo_ms": 50}, [{"name": "det-0", "role": "active"}])})
    assert status["apps"]["det"]["oip"]["statuses"] == {"OK": 2, "LOST": 1}
    with MetricsServer(0) as srv:
        srv.update(_view(status))
        fams = _families(_scrape(srv.url))
    # As Triton's (perf_analyzer needs it): queue and compute_* count one per successful inference,
    # compute_infer's ns is the node's round trip; the node's own durations are in Prometheus.
    st = oip["inference_stats"]
    assert {st[k]["count"] for k in ("queue", "compute_input", "compute_infer", "compute_output")} == {1}
    assert st["compute_infer"]["ns"] == 2_500_000 and st["queue"]["ns"] == 0
    for fam in ("gpuprims_queue_duration_seconds", "gpuprims_compute_duration_seconds"):
        samples = {s.name: s.value for s in fams[fam].samples if s.labels.get("app") == "det"}
        assert samples[fam + "_count"] == 4


# ---- status table


def test_format_status() -> None:
    agg = AppStatistics()
    agg.beat("detect-0", _beat(0), now_s=1.0)
    agg.beat("detect-0", _beat(10, 9, deadline_missed=1, p50_ms=12.0, p99_ms=13.0, queue_len=3), now_s=2.0)
    status = _node_status({
        "detect": (agg, {"app_id": 1, "slo_ms": 50, "gpu_pct": 50},
                   [{"name": "detect-0", "role": "active", **agg.totals({"detect-0": Role.ACTIVE}).to_dict()}]),
        "idle": (AppStatistics(), {"app_id": 2, "slo_ms": 80}, [])}, drops={"bad_magic": 4})
    text = format_status(_view(json.loads(json.dumps(status))))
    lines = text.splitlines()
    assert lines[0].startswith("node: uptime=3.0s") and "backend=cpu" in lines[0] and "ports=9000" in lines[0]
    header = lines[1]
    for col in ("APP / INSTANCE", "GPU%", "ARR/s", "SRV/s", "QUEUE", "P50 ms", "P99 ms", "SLO att.", "ERRORS"):
        assert col in header
    app_line = next(ln for ln in lines if ln.startswith("detect (id 1)"))
    assert "50 ms" in app_line and "90.0%" in app_line and "deadline_missed=1" in app_line
    assert "10.0" in app_line and "12.00" in app_line
    inst = next(ln for ln in lines if ln.startswith("  detect-0"))
    assert "active" in inst
    idle = next(ln for ln in lines if ln.startswith("idle (id 2)"))
    assert " - " in idle
    assert lines[-1] == "ingest drops: bad_magic=4 (total 4)"


def test_format_status_tolerates_sparse_input() -> None:
    assert format_status(NodeView()) == "node: -\nno apps\ningest drops: -"
    text = format_status(_view({"apps": {"x": {"instances": [{"name": "x-0", "role": "active"}]}},
                                "control_rejected": {"bad_token": 1}}))
    assert "x (id 0)" in text and "  x-0" in text and "control messages rejected: bad_token=1" in text
    inst = next(ln for ln in text.splitlines() if ln.startswith("  x-0"))
    assert inst.split()[1:] == ["active", "gpu", "0", "0", *["-"] * 10]  # no heartbeat yet: its figures are '-'


def test_format_status_garbage_values() -> None:
    """Garbage never reaches the table: the status reply is refused where it becomes a view, naming
    what is malformed (the CLI prints that on one line: tests/orchestrator/cli/test_cli_control.py)."""
    app = {"app_id": 1, "model": None, "slo_ms": 50, "gpu_pct": 0, "gpu": 0}
    for garbage, what in (({"apps": {"x": {**app, "gpu_pct": "lots"}}}, "app 'x'.gpu_pct"),
                          ({"apps": {"x": {**app, "p50_ms": float("nan")}}}, "app 'x'.p50_ms"),
                          ({"apps": {"x": {**app, "errors": "x"}}}, "app 'x'.errors"),
                          ({"apps": {"x": {**app, "instances": [{}]}}}, "an instance lacks"),
                          ({"apps": {"x": {**app, "instances": [3]}}}, "an instance must be a JSON object"),
                          ({"apps": {"y": 3}}, "app 'y' must be a JSON object"),
                          ({"node": []}, "a status reply.node"), ({"drops": 5}, "a status reply.drops")):
        with pytest.raises(ValueError, match=re.escape(what)):
            NodeView.from_dict(garbage)


# ---- Prometheus over HTTP


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _detect() -> dict[str, Any]:
    agg = AppStatistics()
    agg.beat("detect-0", _beat(10, 8, deadline_missed=1, errors=1, within_slo=7, batch_sizes={"1": 4, "2": 3},
                               request_s=[0.001, 0.004, 0.5]), now_s=1.0)
    inst = {"name": "detect-0", "pid": 5, "role": "active", "ready": True, "gpu_pct": 40}
    return _node_status({"detect": (agg, {"app_id": 1, "model": "resnet18", "slo_ms": 50, "gpu_pct": 40,
                                          "restarts": 1, "failed_by_crash": 2, "requeued_by_crash": 1},
                                    [inst])},
                        ingest={"packets_received": 10, "packets_accepted": 8, "drop_bad_magic": 3,
                                "drop_duplicate": 0, "requests_completed": 10, "requests_timed_out": 0,
                                "free_slots": 100},
                        control_rejected={"bad_token": 2})


def test_metrics_endpoint() -> None:
    with MetricsServer(0) as srv:
        assert srv.port > 0 and srv.url == f"http://127.0.0.1:{srv.port}/metrics"
        assert "gpuprims_request_arrivals_total{" not in _scrape(srv.url)
        srv.update(_view(_detect()))
        body = _scrape(srv.url)
    lab = 'app="detect"'
    for line in (
        f"gpuprims_request_arrivals_total{{{lab}}} 10.0",
        f"gpuprims_request_success_total{{{lab}}} 8.0",
        f"gpuprims_request_within_slo_total{{{lab}}} 7.0",
        f'gpuprims_request_failure_total{{{lab},reason="deadline_missed"}} 1.0',
        f'gpuprims_request_failure_total{{{lab},reason="error"}} 1.0',
        f'gpuprims_request_failure_total{{{lab},reason="instance_failed"}} 2.0',
        f"gpuprims_request_requeued_total{{{lab}}} 1.0",
        f"gpuprims_instance_restarts_total{{{lab}}} 1.0",
        f"gpuprims_app_gpu_share_ratio{{{lab}}} 0.4",
        f"gpuprims_app_slo_seconds{{{lab}}} 0.05",
        f'gpuprims_batch_size_bucket{{{lab},le="1.0"}} 4.0',
        f'gpuprims_batch_size_bucket{{{lab},le="2.0"}} 7.0',
        f"gpuprims_batch_exec_total{{{lab}}} 7.0",
        f"gpuprims_inference_count_total{{{lab}}} 10.0",
        f'gpuprims_request_duration_seconds_bucket{{{lab},le="0.005"}} 2.0',
        f'gpuprims_request_duration_seconds_bucket{{{lab},le="+Inf"}} 3.0',
        f"gpuprims_compute_duration_seconds_count{{{lab}}} 3.0",
        f'gpuprims_app_instances{{{lab},role="active"}} 1.0',
        'gpuprims_ingest_dropped_total{reason="bad_magic"} 3.0',
        'gpuprims_ingest_dropped_total{reason="duplicate"} 0.0',
        'gpuprims_ingest_requests_total{outcome="completed"} 10.0',
        "gpuprims_ingest_packets_received_total 10.0",
        'gpuprims_control_rejected_total{reason="bad_token"} 2.0',
        'backend="cpu"',
        "process_cpu_seconds_total ",
    ):
        assert line in body, line
    assert 'instance="' not in body
    # Our metrics never land in the process-global registry.
    assert REGISTRY.get_sample_value("gpuprims_request_arrivals_total", {"app": "detect"}) is None
    with pytest.raises(ValueError, match="NodeView"):
        srv.update([])  # type: ignore[arg-type]


def test_update_refuses_a_status_dict() -> None:
    """Metrics read the node's records by field: a status reply's dict (the control edge's JSON) is
    refused with an error that says what to pass, and what was served before stays served."""
    srv = MetricsServer(0)  # never started: its registry renders what it was given
    srv.update(_view(_detect()))
    for bad in (_detect(), _view(_detect()).to_dict(), None):
        with pytest.raises(ValueError, match=r"takes a NodeView \(Node.view\(\)\), got (dict|NoneType)"):
            srv.update(bad)  # type: ignore[arg-type]
    assert 'gpuprims_request_arrivals_total{app="detect"} 10.0' in generate_latest(srv.registry).decode()


def test_metrics_server_stops_and_refuses() -> None:
    srv = MetricsServer(0)
    port = srv.start()
    with pytest.raises(RuntimeError, match="already started"):
        srv.start()
    assert "gpuprims_build_info{" in _scrape(srv.url)
    srv.close()
    srv.close()
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        _scrape(f"http://127.0.0.1:{port}/metrics")
    with pytest.raises(ValueError, match="port"):
        MetricsServer(70000)
    with pytest.raises(ValueError, match="port"):
        MetricsServer(True)  # type: ignore[arg-type]


def test_metrics_port_in_use() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(OSError, match="metrics_port"):
            MetricsServer(port).start()


@pytest.mark.slow
def test_app_series_never_go_backwards_across_a_switch() -> None:
    """An instance replaced by Overlapped-Execution is banked in its app's record."""
    agg = AppStatistics()
    old = _beat(10, 8, deadline_missed=1, errors=1, within_slo=7, batch_sizes={"1": 4, "2": 3},
                request_s=[0.001, 0.004, 0.5])
    fields = {"app_id": 1, "slo_ms": 50, "gpu_pct": 50}

    def scrape(status: dict[str, Any]) -> dict[tuple[str, str], float]:
        with MetricsServer(0) as srv:
            srv.update(_view(status))
            fams = _families(_scrape(srv.url))
        return {(s.name, s.labels.get("le", "")): s.value for f in fams.values() if f.name.startswith("gpuprims_")
                and f.type in ("counter", "histogram") for s in f.samples if s.labels.get("app") == "detect"}

    agg.beat("detect-0", old, now_s=1.0)
    before = scrape(_node_status({"detect": (agg, fields, [{"name": "detect-0", "role": "active"}])}))
    agg.retire("detect-0")
    agg.beat("detect-s1", _beat(1, 1, batch_sizes={"1": 1}, request_s=[0.001]), now_s=2.0)
    after = scrape(_node_status({"detect": (agg, fields, [{"name": "detect-s1", "role": "active"}])}))
    assert set(after) == set(before)
    went_back = {k: (before[k], after[k]) for k in before if after[k] < before[k]}
    assert not went_back, went_back
    assert after[("gpuprims_request_duration_seconds_count", "")] == before[
        ("gpuprims_request_duration_seconds_count", "")] + 1


def _families(body: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(body)}


def test_scrape_follows_prometheus_conventions() -> None:
    with MetricsServer(0) as srv:
        srv.update(_view(_detect()))
        fams = _families(_scrape(srv.url))
    ours = {n: f for n, f in fams.items() if n.startswith("gpuprims_")}
    assert {"gpuprims_request_duration_seconds", "gpuprims_queue_duration_seconds",
            "gpuprims_compute_duration_seconds", "gpuprims_build_info"} <= set(ours)
    assert any(n.startswith("process_") for n in fams)
    for name, f in ours.items():
        assert not re.search(r"_(ms|us|pct|rps)(_|$)", name), name  # base units only
        for s in f.samples:
            assert "instance" not in s.labels, s
            if f.type == "counter":
                assert s.name in (name + "_total", name + "_created"), s.name
        if f.type == "histogram":
            kinds = {s.name[len(name):] for s in f.samples}
            assert kinds == {"_bucket", "_sum", "_count"}, kinds
        if name.endswith("_ratio"):
            assert all(0 <= s.value <= 1 for s in f.samples), f.samples
    info = ours["gpuprims_build_info"].samples[0]
    assert info.value == 1 and info.labels["version"] == __version__


@pytest.mark.tools
def test_promtool_accepts_the_scrape(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus; scripts/install-tools.sh installs it)")
    with MetricsServer(0) as srv:
        srv.update(_view(_detect()))
        body = _scrape(srv.url)
    r = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr


def test_health_endpoints() -> None:
    with MetricsServer(0) as srv:
        urls = srv.urls
        assert set(urls) == {"metrics", "health_live", "health_ready"}
        assert _scrape(urls["health_live"]) == "live\n"
        with pytest.raises(urllib.error.HTTPError) as e:
            _scrape(urls["health_ready"])
        assert e.value.code == 503  # no app has a READY instance yet
        srv.update(_view(_detect()))
        assert _scrape(urls["health_ready"]) == "ready\n"
        for path in ("/", "/metrics/x", "/favicon.ico"):
            with pytest.raises(urllib.error.HTTPError) as e:
                _scrape(srv.base_url + path)
            assert e.value.code == 404
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(srv.url, data=b"x", method="POST"), timeout=10)
        assert e.value.code == 405
        with urllib.request.urlopen(urllib.request.Request(srv.url, headers={
                "Accept": "application/openmetrics-text; version=1.0.0"}), timeout=10) as r:
            assert r.headers["Content-Type"].startswith("application/openmetrics-text")
            assert r.read().decode().endswith("# EOF\n")
        up = _detect()
        down = {**up, "apps": {"detect": {**up["apps"]["detect"], "instances": []}}}
        srv.update(_view(down))
        with pytest.raises(urllib.error.HTTPError) as e:
            _scrape(urls["health_ready"])
        assert e.value.code == 503


def test_format_status_shows_the_recent_changes_and_the_monitors_decisions() -> None:
    st = {"apps": {}, "changes": {"recent": [
        {"id": 4, "app": "a", "from_pct": 50, "to_pct": 75, "method": "overlap", "origin": "monitor",
         "reason": "overloaded: SLO attainment 90.0% < 99%", "phase": "done",
         "switched": [{"downtime_ms": 0.125}]},
        {"id": 5, "app": "a", "from_pct": 75, "to_pct": 50, "method": "overlap", "origin": "set-gpu",
         "reason": None, "phase": "draining", "switched": [{"downtime_ms": None}]}]},
        "decisions": [{"app": "a", "verdict": "underused", "reason": "busy 10% of the time < 30%, no queue",
                       "result": "not made: at 25% it would be busy 80% of the time (> max_util_after 70%)"}]}
    text = format_status(_view(st))
    assert ("change 4: a 50% -> 75% overlap by monitor (overloaded: SLO attainment 90.0% < 99%): done, "
            "switch downtime 0.125 ms") in text
    assert "change 5: a 75% -> 50% overlap by set-gpu: draining, switch downtime ?" in text
    assert "monitor: a underused (busy 10% of the time < 30%, no queue): not made: at 25% it would be busy" in text


def _engine_status() -> dict[str, Any]:
    ort = {"kind": "onnxruntime", "provider": "cpu", "fingerprint": "f00d", "cache_hit": False, "build_ms": 1234.0,
           "load_ms": 12.0, "param_share": False}
    hit = {**ort, "cache_hit": True, "build_ms": 0.0}
    fell = {"kind": "eager", "fallback": "ExportError: no ONNX symbolic", "param_share": True}
    return {"apps": {"a": {"instances": [{"name": "a-0", "role": "active", "engine": ort},
                                         {"name": "a-s1", "role": "shadow", "engine": hit}]},
                     "d": {"instances": [{"name": "d-0", "role": "active",
                                          "engine": {"stages": {"r": fell, "x": {"kind": "eager"}}}}]}}}


def test_engine_build_time_and_cache_hit_are_metrics() -> None:
    fams = {f.name: f for f in _Collector(lambda: _view(_engine_status())).collect()}
    got = {(s.name, s.labels["instance"], s.labels["stage"], s.labels["kind"]): s.value
           for name in ("gpuprims_engine_build_seconds", "gpuprims_engine_cache_hit") for s in fams[name].samples}
    assert got[("gpuprims_engine_build_seconds", "a-0", "main", "onnxruntime")] == pytest.approx(1.234)
    assert got[("gpuprims_engine_cache_hit", "a-0", "main", "onnxruntime")] == 0.0
    assert got[("gpuprims_engine_cache_hit", "a-s1", "main", "onnxruntime")] == 1.0
    assert got[("gpuprims_engine_build_seconds", "a-s1", "main", "onnxruntime")] == 0.0
    assert got[("gpuprims_engine_cache_hit", "d-0", "r", "eager")] == 0.0


def test_status_shows_engines_other_than_eager_and_fallbacks() -> None:
    text = format_status(_view(_engine_status()))
    lines = [x for x in text.splitlines() if x.startswith("engine ")]
    assert lines == [
        "engine a-0: onnxruntime  provider=cpu  built in 1234 ms, load 12 ms, f00d  Param-Share n/a (own weights)",
        "engine a-s1: onnxruntime  provider=cpu  cache hit, load 12 ms, f00d  Param-Share n/a (own weights)",
        "engine d-0 stage r: eager  FALLBACK to eager (ExportError: no ONNX symbolic)",
    ]


def test_devices_and_expired_held_answers_in_status_and_metrics() -> None:
    """Per-GPU shares (status DEVICE column, gpuprims_app_device_share_ratio) and the held answers (the
    ingest's gauge, and answers_expired among the drops) read from the status the node builds."""
    status = {"apps": {"a": {"app_id": 1, "gpu": 1, "gpu_pct": 60,
                             "instances": [{"name": "a-0", "role": "active", "gpu": 1, "gpu_pct": 30},
                                           {"name": "a-1", "role": "active", "gpu": 1, "gpu_pct": 30},
                                           {"name": "a-s", "role": "shadow", "gpu": 1, "gpu_pct": 30}]}},
              "ingest": {"held_answers": 2, "drop_late": 1}, "drops": {"late": 1, "answers_expired": 3}}
    fams = {f.name: f for f in _Collector(lambda: _view(status)).collect()}
    share = {(s.labels["app"], s.labels["gpu"]): s.value for s in fams["gpuprims_app_device_share_ratio"].samples}
    assert share == {("a", "1"): pytest.approx(0.6)}
    assert [s.value for s in fams["gpuprims_ingest_held_answers"].samples] == [2.0]
    drops = {s.labels["reason"]: s.value for s in fams["gpuprims_ingest_dropped"].samples}
    assert drops == {"late": 1.0, "answers_expired": 3.0}
    text = format_status(_view(status))
    assert "DEVICE" in text and re.search(r"a-0\s+active\s+gpu 1\s+30", text), text
    assert "ingest drops:" in text and "answers_expired=3" in text, text


def _memory_status() -> dict[str, Any]:
    mib = 1 << 20
    return {"node": {"memory": {"processes": [{"kind": "node", "pid": 10, "pss_bytes": 90 * mib},
                                              {"kind": "fork_server", "pid": 11, "pss_bytes": 150 * mib},
                                              {"kind": "param_holder", "pid": 12, "pss_bytes": None}],
                                "instances": {"pss_bytes": 300 * mib, "device_bytes": 64 * mib},
                                "total": {"pss_bytes": 540 * mib, "device_bytes": 64 * mib}, "unreadable": 1}},
            "apps": {"a": {"memory": {"pss_bytes": 300 * mib, "device_bytes": 64 * mib},
                           "instances": [{"name": "a-0", "role": "active",
                                          "memory": {"pss_bytes": 200 * mib, "device_bytes": 64 * mib}},
                                         {"name": "a-s1", "role": "shadow",
                                          "memory": {"pss_bytes": 100 * mib, "device_bytes": None}},
                                         {"name": "a-k2", "role": "active",
                                          "memory": {"pss_bytes": "garbage", "device_bytes": float("nan")}}]}}}


def test_memory_in_status_and_metrics() -> None:
    fams = {f.name: f for f in _Collector(lambda: _view(_memory_status())).collect()}
    mib = 1 << 20
    inst = {(s.labels["instance"], s.labels["kind"]): s.value for s in fams["gpuprims_instance_memory_bytes"].samples}
    assert inst == {("a-0", "pss"): 200 * mib, ("a-0", "device"): 64 * mib, ("a-s1", "pss"): 100 * mib}
    app = {(s.labels["app"], s.labels["kind"]): s.value for s in fams["gpuprims_app_memory_bytes"].samples}
    assert app == {("a", "pss"): 300 * mib, ("a", "device"): 64 * mib}
    procs = {(s.labels["process"], s.labels["pid"]): s.value for s in fams["gpuprims_node_process_memory_bytes"].samples}
    assert procs == {("node", "10"): 90 * mib, ("fork_server", "11"): 150 * mib}  # the unread holder: no sample
    assert {s.labels["kind"]: s.value for s in fams["gpuprims_node_memory_bytes"].samples} == \
        {"pss": 540 * mib, "device": 64 * mib}
    text = format_status(_view(_memory_status()))
    lines = text.splitlines()
    assert "PSS MB" in lines[1] and "DEV MB" in lines[1]
    assert " 300 " in next(ln for ln in lines if ln.startswith("a (id 0)"))
    shadow = next(ln for ln in lines if ln.startswith("  a-s1"))
    assert " 100 " in shadow and " - " in shadow
    mem = next(ln for ln in lines if ln.startswith("memory (PSS MB):"))
    assert "node 90 (pid 10)" in mem and "fork server 150 (pid 11)" in mem and "param holder - (pid 12)" in mem
    assert "instances 300" in mem and "total 540, device 64" in mem and "1 unreadable" in mem
