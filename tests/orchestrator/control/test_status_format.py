"""orchestrator.control.status_format: the fork servers as readable rows (what each holds), not a raw dict."""

from __future__ import annotations

from orchestrator.control.status_format import format_status


def test_fork_servers_are_rows_saying_what_each_holds() -> None:
    status = {"node": {"backend": "cpu", "pid": 10, "fork_servers": [
        {"pid": 11, "ready": True, "import_ms": 2812.4, "children": 2, "preload": ["orchestrator.worker.instance",
         "orchestrator.worker.zoo_runner"], "holds": ["torch", "numpy", "apps.zoo"]},
        {"pid": 12, "ready": True, "import_ms": 412.0, "children": 1, "holds": ["numpy", "onnxruntime"]},
        {"pid": 13, "ready": False, "import_ms": None, "children": 0, "holds": []},
        "garbage", {"pid": "x", "holds": "torch"}]}}
    text = format_status(status)
    head = text.splitlines()[0]
    assert "fork_servers" not in head and "backend=cpu" in head
    assert "fork server 11: ready, holds torch, numpy, apps.zoo, import 2812 ms, 2 instance(s)" in text
    assert "fork server 12: ready, holds numpy, onnxruntime (no torch), import 412 ms, 1 instance(s)" in text
    assert "fork server 13: importing, holds no library, import - ms, 0 instance(s)" in text
    assert "fork server -: importing, holds no library" in text  # a malformed row prints, never raises
    assert text.count("fork server") == 4


def test_no_fork_servers_no_rows() -> None:
    assert "fork server" not in format_status({"node": {"fork_servers": []}})
    assert "fork server" not in format_status({"node": {"fork_servers": "nonsense"}})


def test_the_loop_duties_are_one_line_with_their_runs_and_times() -> None:
    status = {"node": {"backend": "cpu", "duties": {
        "messages": {"runs": 320, "failures": 0, "total_ms": 4.1, "mean_us": 12.8, "max_us": 450.2},
        "reap": {"runs": 100, "failures": 2, "total_ms": 0.8, "mean_us": 8.0, "max_us": 30.0},
        "bad": "nonsense", "odd": {"runs": "x"}}}}
    text = format_status(status)
    assert "duties" not in text.splitlines()[0]  # a mapping: its own line, not the node's head
    assert "loop duties (runs, mean/max us): messages 320x 13/450, reap 100x 8/30 (2 failed), odd -x -/-" in text
    assert "loop duties" not in format_status({"node": {"duties": {}}})
    assert "loop duties" not in format_status({"node": {"duties": "nonsense"}})
