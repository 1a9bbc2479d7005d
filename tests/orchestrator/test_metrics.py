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

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from gpuprims import __version__
from gpuprims.stats import RequestHistograms
from orchestrator.metrics import (
    InstanceCounters,
    LatencyHistogram,
    MetricsServer,
    NodeMetrics,
    normalize_status,
    retire_into,
    status_name,
)
from orchestrator.status_format import format_status

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


# ---- latency histogram


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.01, 5000, allow_nan=False), min_size=1, max_size=300))
def test_quantiles_within_bucket_error(values: list[float]) -> None:
    h = LatencyHistogram()
    h.record_many(values)
    for q in (0.5, 0.99, 1.0):
        exact = float(np.quantile(values, q, method="inverted_cdf"))
        got = h.quantile(q)
        assert got is not None
        assert exact * (1 - 1e-9) <= got <= exact * LatencyHistogram.RATIO * (1 + 1e-9)
    assert h.count == len(values) and h.max_ms == max(values)


def test_histogram_basics() -> None:
    h = LatencyHistogram()
    assert h.quantile(0.5) is None and h.mean_ms is None
    h.record(0.0)
    h.record(2.0, n=3)
    assert h.count == 4 and h.mean_ms == pytest.approx(1.5)
    assert h.quantile(0.25) == pytest.approx(LatencyHistogram.MIN_MS)
    h.record(1e12)
    assert h.max_ms == 1e12 and max(h.buckets) == LatencyHistogram.MAX_BUCKET


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_histogram_refuses_bad_values(bad: float) -> None:
    with pytest.raises(ValueError, match="latency_ms"):
        LatencyHistogram().record(bad)


def test_histogram_refuses_bad_n_and_q() -> None:
    h = LatencyHistogram()
    with pytest.raises(ValueError, match="n must"):
        h.record(1.0, n=0)
    with pytest.raises(ValueError, match="q must"):
        h.quantile(0)
    with pytest.raises(ValueError, match="q must"):
        h.quantile(1.5)


def test_merge_since_and_round_trip() -> None:
    a, b = LatencyHistogram(), LatencyHistogram()
    a.record_many([1, 2, 3])
    b.record_many([10, 20])
    early = a.copy()
    a.record_many([50, 60])
    w = a.since(early)
    assert w.count == 2 and w.quantile(0.5) == pytest.approx(50, rel=0.021)
    a.merge(b)
    assert a.count == 7 and a.max_ms == 60
    assert LatencyHistogram.from_dict(json.loads(json.dumps(a.to_dict()))) == a
    # A restarted source (not a superset of the earlier one) gives its whole histogram.
    assert b.since(a) == b


@pytest.mark.parametrize(("d", "fragment"), [
    ([], "mapping"),
    ({"b": []}, "bucket -> count"),
    ({"b": {"x": 1}}, "not an integer"),
    ({"b": {"-1": 1}}, "out of range"),
    ({"b": {"5": -1}}, "out of range"),
    ({"b": {"5": 1.5}}, "out of range"),
    ({"b": {"5": 2}, "n": 3}, "disagrees"),
    ({"b": {}, "sum_ms": -1}, "sum_ms"),
    ({"b": {}, "max_ms": "x"}, "max_ms"),
])
def test_histogram_from_dict_refuses(d: object, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        LatencyHistogram.from_dict(d)  # type: ignore[arg-type]


# ---- instance counters


def test_status_names() -> None:
    assert status_name(1) == "deadline_missed" and status_name("OVERLOADED") == "overloaded"
    for bad in (99, "nope", True, 1.0):
        with pytest.raises(ValueError):
            status_name(bad)  # type: ignore[arg-type]


def test_counters_record_and_round_trip() -> None:
    c = InstanceCounters(gpu_pct=40, queue_len=2, held=3)
    c.record_arrivals(10)
    c.record_batch([5.0, 15.0, 25.0], slo_ms=20)
    c.record_error(1, n=2)
    c.record_error("instance_failed")
    assert (c.arrived, c.served, c.slo_met, c.answered) == (10, 3, 2, 6)
    assert dict(c.errors) == {"deadline_missed": 2, "instance_failed": 1} and dict(c.batches) == {3: 1}
    back = InstanceCounters.from_dict(json.loads(json.dumps(c.to_dict())))
    assert back == c


def test_counters_refuse_bad_records() -> None:
    c = InstanceCounters()
    with pytest.raises(ValueError, match="n must"):
        c.record_arrivals(-1)
    with pytest.raises(ValueError, match="slo_ms"):
        c.record_batch([1.0], slo_ms=0)
    with pytest.raises(ValueError, match="at least one"):
        c.record_batch([], slo_ms=5)
    with pytest.raises(ValueError, match="non-OK"):
        c.record_error("ok")
    with pytest.raises(ValueError, match="unknown status"):
        c.record_error(42)
    with pytest.raises(ValueError, match="n must"):
        c.record_error(1, n=0)


@pytest.mark.parametrize(("d", "fragment"), [
    ("x", "mapping"),
    ({"bogus": 1}, "unknown fields"),
    ({"arrived": -1}, "arrived"),
    ({"served": "3"}, "served"),
    ({"queue_len": True}, "queue_len"),
    ({"served": 1, "slo_met": 2}, "slo_met 2 > served 1"),
    ({"errors": [1]}, "errors must map"),
    ({"errors": {"deadline_missed": -2}}, "errors"),
    ({"errors": {"made_up": 1}}, "unknown status"),
    ({"batches": {"0": 1}}, "out of range"),
    ({"batches": {"x": 1}}, "not an integer"),
    ({"batches": 3}, "batch size -> count"),
    ({"latency": {"b": {"x": 1}}}, "not an integer"),
])
def test_counters_from_dict_refuses(d: object, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        InstanceCounters.from_dict(d)  # type: ignore[arg-type]


# ---- node model


def _sampled(arrived: int, lat: list[float], slo_ms: float = 50, errors: int = 0, gpu_pct: int = 50,
             queue_len: int = 0) -> dict:
    c = InstanceCounters(gpu_pct=gpu_pct, queue_len=queue_len, held=queue_len)
    c.record_arrivals(arrived)
    if lat:
        c.record_batch(lat, slo_ms)
    if errors:
        c.record_error("deadline_missed", errors)
    return c.to_dict()


def test_rates_and_windows() -> None:
    clock = Clock()
    m = NodeMetrics(clock=clock)
    m.set_app("det", app_id=1, slo_ms=50)
    m.update_instance("det", "det-0", _sampled(0, []), pid=7)
    a = m.status()["apps"][0]
    assert a["instances"][0]["arrival_rps"] is None and a["slo_attainment"] is None
    clock.t += 2
    m.update_instance("det", "det-0", _sampled(100, [10.0] * 60 + [90.0] * 20, errors=20, queue_len=4))
    a = m.status()["apps"][0]
    i = a["instances"][0]
    assert i["arrival_rps"] == pytest.approx(50) and i["service_rps"] == pytest.approx(40)
    assert i["slo_attainment"] == pytest.approx(60 / 100) and i["pid"] == 7
    assert i["p50_ms"] == pytest.approx(10, rel=0.021) and i["p99_ms"] == pytest.approx(90, rel=0.021)
    assert a["queue_len"] == 4 and a["errors"] == {"deadline_missed": 20} and a["slo_ms"] == 50
    # The next window sees only what happened after the previous sample.
    clock.t += 1
    c = InstanceCounters.from_dict(_sampled(100, [10.0] * 60 + [90.0] * 20, errors=20))
    c.record_arrivals(10)
    c.record_batch([1.0] * 10, 50)
    m.update_instance("det", "det-0", c)
    i = m.status()["apps"][0]["instances"][0]
    assert i["arrival_rps"] == pytest.approx(10) and i["slo_attainment"] == 1.0
    assert i["p99_ms"] == pytest.approx(1.0, rel=0.021)


def test_app_aggregates_and_roles() -> None:
    clock = Clock()
    m = NodeMetrics(clock=clock)
    for inst in ("a-0", "a-1"):
        m.update_instance("a", inst, _sampled(0, []))
    m.update_instance("a", "a-s", _sampled(0, [], gpu_pct=70), role="shadow")
    clock.t += 1
    m.update_instance("a", "a-0", _sampled(10, [5.0] * 10))
    m.update_instance("a", "a-1", _sampled(20, [100.0] * 20))
    a = m.status()["apps"][0]
    assert a["arrival_rps"] == pytest.approx(30) and a["service_rps"] == pytest.approx(30)
    assert a["gpu_pct"] == 100  # the shadow's share is not counted
    assert a["slo_attainment"] == pytest.approx(10 / 30)
    m.set_role("a", "a-s", "active")
    assert [i["role"] for i in m.status()["apps"][0]["instances"]] == ["active", "active", "active"]


def test_app_counters_never_go_backwards() -> None:
    clock = Clock()
    m = NodeMetrics(clock=clock)
    m.update_instance("a", "a-0", _sampled(10, [1.0] * 10))
    clock.t += 1
    # Restarted under the same name: its counters start again.
    m.update_instance("a", "a-0", _sampled(2, [1.0] * 2))
    a = m.status()["apps"][0]
    assert a["arrived"] == 12 and a["served"] == 12
    assert a["instances"][0]["arrival_rps"] == pytest.approx(2)
    m.remove_instance("a", "a-0")
    a = m.status()["apps"][0]
    assert a["instances"] == [] and a["arrived"] == 12
    m.remove_instance("a", "a-0")
    m.remove_instance("nope", "x")


def test_bad_heartbeat_keeps_previous_sample() -> None:
    m = NodeMetrics()
    m.update_instance("a", "a-0", _sampled(5, [1.0]))
    with pytest.raises(ValueError):
        m.update_instance("a", "a-0", {"arrived": -5})
    assert m.status()["apps"][0]["arrived"] == 5


def test_drops_and_info() -> None:
    m = NodeMetrics()
    m.set_ingest_drops({"bad_magic": 2, "timeout": 1})
    m.set_control_rejected({"bad_token": 3})
    m.set_node_info(backend="cpu", scheduler="spatial")
    st_ = m.status()
    assert st_["ingest_drops"] == {"bad_magic": 2, "timeout": 1} and st_["control_rejected"] == {"bad_token": 3}
    assert st_["node"]["backend"] == "cpu" and st_["node"]["uptime_s"] >= 0
    json.dumps(st_)
    for bad in ({"x": -1}, {"x": 1.5}, {3: 1}):
        with pytest.raises(ValueError, match="reason -> integer"):
            m.set_ingest_drops(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="slo_ms"):
        m.set_app("a", slo_ms=0)


# ---- status table


def test_format_status() -> None:
    clock = Clock()
    m = NodeMetrics(clock=clock)
    m.set_app("detect", app_id=1, slo_ms=50)
    m.set_app("idle", app_id=2, slo_ms=80)
    m.update_instance("detect", "detect-0", _sampled(0, []))
    clock.t += 1
    m.update_instance("detect", "detect-0", _sampled(10, [12.0] * 9, errors=1, queue_len=3))
    m.set_ingest_drops({"bad_magic": 4})
    m.set_node_info(backend="cpu")
    text = format_status(json.loads(json.dumps(m.status())))
    lines = text.splitlines()
    assert lines[0].startswith("node: uptime=1.0s") and "backend=cpu" in lines[0]
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
    assert format_status({}) == "node: -\nno apps\ningest drops: -"
    text = format_status({"apps": [{"name": "x", "instances": [{"name": "x-0"}]}],
                          "control_rejected": {"bad_token": 1}})
    assert "x (id -)" in text and "  x-0" in text and "control messages rejected: bad_token=1" in text


# ---- Prometheus over HTTP


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def test_metrics_endpoint() -> None:
    clock = Clock()
    m = NodeMetrics(clock=clock)
    m.set_app("det", app_id=1, slo_ms=50)
    m.update_instance("det", "det-0", _sampled(0, []))
    clock.t += 1
    m.update_instance("det", "det-0", _sampled(10, [5.0] * 8 + [80.0], errors=1, gpu_pct=40))
    m.set_ingest_drops({"bad_magic": 3})
    m.set_control_rejected({"bad_token": 2})
    with MetricsServer(0, m) as srv:
        assert srv.port > 0 and srv.url == f"http://127.0.0.1:{srv.port}/metrics"
        body = _scrape(srv.url)
    lab = 'app="det"'
    for line in (
        f"gpuprims_request_arrivals_total{{{lab}}} 10.0",
        f"gpuprims_request_success_total{{{lab}}} 9.0",
        f"gpuprims_request_within_slo_total{{{lab}}} 8.0",
        f'gpuprims_request_failure_total{{{lab},reason="deadline_missed"}} 1.0',
        f'gpuprims_request_failure_total{{{lab},reason="instance_failed"}} 0.0',
        f"gpuprims_app_gpu_share_ratio{{{lab}}} 0.4",
        f"gpuprims_app_slo_seconds{{{lab}}} 0.05",
        f'gpuprims_batch_size_bucket{{{lab},le="8.0"}} 0.0',
        f'gpuprims_batch_size_bucket{{{lab},le="16.0"}} 1.0',
        f"gpuprims_batch_exec_total{{{lab}}} 1.0",
        'gpuprims_ingest_dropped_total{reason="bad_magic"} 3.0',
        'gpuprims_control_rejected_total{reason="bad_token"} 2.0',
        "process_cpu_seconds_total ",
    ):
        assert line in body, line
    assert 'instance="' not in body
    # Our metrics never land in the process-global registry.
    assert REGISTRY.get_sample_value("gpuprims_request_arrivals_total", {"app": "det"}) is None


def test_metrics_server_stops_and_refuses() -> None:
    m = NodeMetrics()
    srv = MetricsServer(0, m)
    port = srv.start()
    with pytest.raises(RuntimeError, match="already started"):
        srv.start()
    assert "gpuprims_build_info{" in _scrape(srv.url)
    srv.close()
    srv.close()
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        _scrape(f"http://127.0.0.1:{port}/metrics")
    with pytest.raises(ValueError, match="port"):
        MetricsServer(70000, m)
    with pytest.raises(ValueError, match="port"):
        MetricsServer(True)  # type: ignore[arg-type]


def test_metrics_port_in_use() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(OSError, match="metrics_port"):
            MetricsServer(port, NodeMetrics()).start()


# ---- the node's own summary shape (apps keyed by name, received/ok/within_slo counters)

def _hist_wire(request_s: list[float]) -> dict[str, Any]:
    h = RequestHistograms()
    h.request.observe(request_s)
    h.queue.observe([v / 2 for v in request_s])
    h.compute.observe([v / 2 for v in request_s])
    return h.to_wire()


NODE_SUMMARY: dict[str, Any] = {
    "node": {"backend": "cpu", "pid": 1, "run_dir": "/r", "ports": [9000], "uptime_s": 3.0},
    "ingest": {"packets_received": 10, "packets_accepted": 8, "drop_bad_magic": 2, "drop_duplicate": 0,
               "requests_completed": 10, "requests_timed_out": 0, "free_slots": 100},
    "drops": {"bad_magic": 2},
    "apps": {
        "detect": {
            "app_id": 1, "model": "resnet18", "slo_ms": 50, "gpu_pct": 50, "restarts": 1, "failed_by_crash": 2,
            "requeued_by_crash": 1,
            "received": 10, "ok": 8, "deadline_missed": 1, "errors": 1, "within_slo": 7, "slo_attainment": 0.7,
            "instances": [{"name": "detect-0", "pid": 5, "role": "active", "ready": True, "gpu_pct": 50,
                           "received": 10, "ok": 8, "deadline_missed": 1, "errors": 1, "within_slo": 7,
                           "slo_attainment": 0.7, "p50_ms": 4.0, "p99_ms": 9.5, "arrival_rps": 3.3,
                           "service_rps": 3.3, "queue_len": 0, "held": 0, "batch_sizes": {"1": 4, "2": 3},
                           "hist": _hist_wire([0.001, 0.004, 0.5])}],
        },
    },
}


def test_normalize_node_summary() -> None:
    st_ = normalize_status(NODE_SUMMARY)
    a = st_["apps"][0]
    assert a["name"] == "detect" and a["arrived"] == 10 and a["served"] == 8 and a["slo_met"] == 7
    assert a["errors"] == {"deadline_missed": 1, "error": 1}
    assert a["instances"][0]["errors"] == {"deadline_missed": 1, "error": 1}
    assert st_["ingest_drops"] == {"bad_magic": 2}
    assert a["arrival_rps"] == pytest.approx(3.3) and a["queue_len"] == 0  # summed from the instances
    # The canonical shape passes through unchanged in substance.
    m = NodeMetrics()
    m.update_instance("a", "a-0", _sampled(3, [1.0]))
    canon = m.status()
    assert normalize_status(canon)["apps"][0]["arrived"] == 3


def test_format_node_summary() -> None:
    text = format_status(NODE_SUMMARY)
    assert "detect (id 1)" in text and "  detect-0" in text and "70.0%" in text
    assert "deadline_missed=1 error=1" in text and "ingest drops: bad_magic=2 (total 2)" in text
    assert "backend=cpu" in text and "ports=9000" in text


def test_format_status_garbage_values() -> None:
    text = format_status({"apps": {"x": {"gpu_pct": "lots", "p50_ms": float("nan"), "instances": {"x-0": {}}},
                                   "y": 3}})
    assert "x (id -)" in text and "  x-0" in text


def test_metrics_server_from_snapshots() -> None:
    with MetricsServer(0) as srv:
        assert "gpuprims_request_arrivals_total{" not in _scrape(srv.url)
        srv.update(NODE_SUMMARY)
        body = _scrape(srv.url)
    lab = 'app="detect"'
    for line in (f"gpuprims_request_arrivals_total{{{lab}}} 10.0",
                 f'gpuprims_request_failure_total{{{lab},reason="error"}} 1.0',
                 f'gpuprims_request_failure_total{{{lab},reason="instance_failed"}} 2.0',
                 f"gpuprims_request_requeued_total{{{lab}}} 1.0",
                 f'gpuprims_batch_size_bucket{{{lab},le="2.0"}} 7.0',
                 f"gpuprims_inference_count_total{{{lab}}} 10.0",
                 f'gpuprims_request_duration_seconds_bucket{{{lab},le="0.005"}} 2.0',
                 f'gpuprims_request_duration_seconds_bucket{{{lab},le="+Inf"}} 3.0',
                 f'gpuprims_compute_duration_seconds_count{{{lab}}} 3.0',
                 f'gpuprims_app_instances{{{lab},role="active"}} 1.0',
                 'gpuprims_ingest_dropped_total{reason="bad_magic"} 2.0',
                 'gpuprims_ingest_dropped_total{reason="duplicate"} 0.0',
                 'gpuprims_ingest_requests_total{outcome="completed"} 10.0',
                 "gpuprims_ingest_packets_received_total 10.0",
                 'backend="cpu"'):
        assert line in body, line
    with pytest.raises(ValueError, match="mapping"):
        srv.update([])  # type: ignore[arg-type]
    srv.stop()


def _families(body: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(body)}


def test_scrape_follows_prometheus_conventions() -> None:
    with MetricsServer(0) as srv:
        srv.update(NODE_SUMMARY)
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
        srv.update(NODE_SUMMARY)
        body = _scrape(srv.url)
    r = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr


def test_app_series_never_go_backwards_across_a_switch() -> None:
    """An instance replaced by Overlapped-Execution leaves its counts in the app's retired dict."""
    old = NODE_SUMMARY["apps"]["detect"]["instances"][0]
    app = {k: v for k, v in NODE_SUMMARY["apps"]["detect"].items() if k != "instances"}

    def scrape(status: dict[str, Any]) -> dict[tuple[str, str], float]:
        with MetricsServer(0) as srv:
            srv.update(status)
            fams = _families(_scrape(srv.url))
        return {(s.name, s.labels.get("le", "")): s.value for f in fams.values() if f.name.startswith("gpuprims_")
                and f.type in ("counter", "histogram") for s in f.samples if s.labels.get("app") == "detect"}

    before = scrape({"apps": {"detect": {**app, "instances": [old]}}})
    retired: dict[str, Any] = {}
    retire_into(retired, old)
    assert retired["received"] == 10 and retired["retired_batch_sizes"] == {"1": 4, "2": 3}
    new = {"name": "detect-s1", "role": "active", "ready": True, "received": 1, "ok": 1, "batch_sizes": {"1": 1},
           "hist": _hist_wire([0.001])}
    # The node adds the retired counters into the app's totals and spreads the dict into the app entry.
    totals = {k: retired.get(k, 0) + new.get(k, 0) for k in ("received", "ok", "deadline_missed", "errors",
                                                               "within_slo")}
    after = scrape({"apps": {"detect": {**app, **retired, **totals, "instances": [new]}}})
    assert set(after) == set(before)
    went_back = {k: (before[k], after[k]) for k in before if after[k] < before[k]}
    assert not went_back, went_back
    assert after[("gpuprims_request_duration_seconds_count", "")] == before[
        ("gpuprims_request_duration_seconds_count", "")] + 1


def test_health_endpoints() -> None:
    with MetricsServer(0) as srv:
        urls = srv.urls
        assert set(urls) == {"metrics", "health_live", "health_ready"}
        assert _scrape(urls["health_live"]) == "live\n"
        with pytest.raises(urllib.error.HTTPError) as e:
            _scrape(urls["health_ready"])
        assert e.value.code == 503  # no app has a READY instance yet
        srv.update(NODE_SUMMARY)
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
        down = {**NODE_SUMMARY, "apps": {"detect": {**NODE_SUMMARY["apps"]["detect"], "instances": []}}}
        srv.update(down)
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
    text = format_status(st)
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
    from orchestrator.metrics import _Collector

    fams = {f.name: f for f in _Collector(_engine_status).collect()}
    got = {(s.name, s.labels["instance"], s.labels["stage"], s.labels["kind"]): s.value
           for name in ("gpuprims_engine_build_seconds", "gpuprims_engine_cache_hit") for s in fams[name].samples}
    assert got[("gpuprims_engine_build_seconds", "a-0", "main", "onnxruntime")] == pytest.approx(1.234)
    assert got[("gpuprims_engine_cache_hit", "a-0", "main", "onnxruntime")] == 0.0
    assert got[("gpuprims_engine_cache_hit", "a-s1", "main", "onnxruntime")] == 1.0
    assert got[("gpuprims_engine_build_seconds", "a-s1", "main", "onnxruntime")] == 0.0
    assert got[("gpuprims_engine_cache_hit", "d-0", "r", "eager")] == 0.0


def test_status_shows_engines_other_than_eager_and_fallbacks() -> None:
    text = format_status(_engine_status())
    lines = [x for x in text.splitlines() if x.startswith("engine ")]
    assert lines == [
        "engine a-0: onnxruntime  provider=cpu  built in 1234 ms, load 12 ms, f00d  Param-Share n/a (own weights)",
        "engine a-s1: onnxruntime  provider=cpu  cache hit, load 12 ms, f00d  Param-Share n/a (own weights)",
        "engine d-0 stage r: eager  FALLBACK to eager (ExportError: no ONNX symbolic)",
    ]
