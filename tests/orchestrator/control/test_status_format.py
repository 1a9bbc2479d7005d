"""orchestrator.control.status_format: the table reads a `NodeView` (apps, instances and their
statistics by field); the fork servers as readable rows (what each holds), not a raw dict."""

from __future__ import annotations

import json

from orchestrator.control.records import AppTotals, AppView, InstanceStats, InstanceView, NodeView, Role
from orchestrator.control.status_format import format_status


def test_fork_servers_are_rows_saying_what_each_holds() -> None:
    status = {"node": {"backend": "cpu", "pid": 10, "fork_servers": [
        {"pid": 11, "ready": True, "import_ms": 2812.4, "children": 2, "preload": ["orchestrator.worker.instance",
         "orchestrator.worker.zoo_runner"], "holds": ["torch", "numpy", "apps.zoo"]},
        {"pid": 12, "ready": True, "import_ms": 412.0, "children": 1, "holds": ["numpy", "onnxruntime"]},
        {"pid": 13, "ready": False, "import_ms": None, "children": 0, "holds": []},
        "garbage", {"pid": "x", "holds": "torch"}]}}
    text = format_status(NodeView.from_dict(status))
    head = text.splitlines()[0]
    assert "fork_servers" not in head and "backend=cpu" in head
    assert "fork server 11: ready, holds torch, numpy, apps.zoo, import 2812 ms, 2 instance(s)" in text
    assert "fork server 12: ready, holds numpy, onnxruntime (no torch), import 412 ms, 1 instance(s)" in text
    assert "fork server 13: importing, holds no library, import - ms, 0 instance(s)" in text
    assert "fork server -: importing, holds no library" in text  # a malformed row prints, never raises
    assert text.count("fork server") == 4


def test_no_fork_servers_no_rows() -> None:
    assert "fork server" not in format_status(NodeView(node={"fork_servers": []}))
    assert "fork server" not in format_status(NodeView(node={"fork_servers": "nonsense"}))


def test_the_loop_duties_are_one_line_with_their_runs_and_times() -> None:
    status = {"node": {"backend": "cpu", "duties": {
        "messages": {"runs": 320, "failures": 0, "total_ms": 4.1, "mean_us": 12.8, "max_us": 450.2},
        "reap": {"runs": 100, "failures": 2, "total_ms": 0.8, "mean_us": 8.0, "max_us": 30.0},
        "bad": "nonsense", "odd": {"runs": "x"}}}}
    text = format_status(NodeView.from_dict(status))
    assert "duties" not in text.splitlines()[0]  # a mapping: its own line, not the node's head
    assert "loop duties (runs, mean/max us): messages 320x 13/450, reap 100x 8/30 (2 failed), odd -x -/-" in text
    assert "loop duties" not in format_status(NodeView(node={"duties": {}}))
    assert "loop duties" not in format_status(NodeView(node={"duties": "nonsense"}))


def _view() -> NodeView:
    beat = InstanceStats(received=10, ok=8, deadline_missed=1, errors=1, slo_attainment=0.8, p50_ms=12.0,
                         p99_ms=13.5, arrival_rps=5.0, service_rps=4.5, queue_len=3, held=1, gpu_pct=40)
    serving = InstanceView(name="det-0", pid=5, role=Role.ACTIVE, ready=True, gpu_pct=50, gpu=0, consumer=1,
                           stats=beat, memory={"pss_bytes": 200 << 20, "device_bytes": 64 << 20})
    shadow = InstanceView(name="det-s1", pid=6, role=Role.SHADOW, ready=False, gpu_pct=25, gpu=0, consumer=2)
    totals = AppTotals(received=10, ok=8, deadline_missed=1, errors=1, p50_ms=12.0, p99_ms=13.5, arrival_rps=5.0,
                       service_rps=4.5, queue_len=3, held=1, slo_attainment=0.8)
    det = AppView(name="det", app_id=1, model="resnet18", slo_ms=50.0, gpu_pct=50, gpu=0, instances=(serving, shadow),
                  totals=totals, memory={"pss_bytes": 300 << 20, "device_bytes": 64 << 20})
    idle = AppView(name="idle", app_id=2, model=None, slo_ms=80.5, gpu_pct=0, gpu="cpu")
    return NodeView(apps={"det": det, "idle": idle}, node={"backend": "cuda", "pid": 1, "uptime_s": 3.0},
                    drops={"late": 2}, control_rejected={"bad_token": 1})


#: What the table said for `_view` before it read records (a status dict): the text is unchanged.
TABLE = """\
node: uptime=3.0s  backend=cuda  pid=1
APP / INSTANCE  ROLE    DEVICE  GPU%  ARR/s  SRV/s  QUEUE  HELD  P50 ms  P99 ms      SLO  SLO att.  PSS MB  DEV MB  ERRORS
det (id 1)      app     gpu 0     50    5.0    4.5      3     1   12.00   13.50    50 ms     80.0%     300      64  deadline_missed=1 error=1
  det-0         active  gpu 0     40    5.0    4.5      3     1   12.00   13.50              80.0%     200      64  deadline_missed=1 error=1
  det-s1        shadow  gpu 0     25      -      -      -     -       -       -                  -       -       -  -
idle (id 2)     app     cpu        0    0.0    0.0      0     0       -       -  80.5 ms         -       -       -  -
ingest drops: late=2 (total 2)
control messages rejected: bad_token=1"""


def test_the_table_reads_apps_and_instances_by_field() -> None:
    """Roles print as their names, an instance's share is its heartbeat's (else the node's), an instance
    with no heartbeat yet shows '-'; a status reply (the view's JSON, as the CLI receives it) prints the
    same table as the node's own view."""
    view = _view()
    assert format_status(view) == TABLE
    assert format_status(NodeView.from_dict(json.loads(json.dumps(view.to_dict())))) == TABLE
