"""bench/fleet: its arguments are checked before a cluster starts, and the client's view is counted right."""

from __future__ import annotations

import http.server
import json
import threading
import time

import numpy as np
import pytest

pytest.importorskip("ray", reason="the fleet extra is not installed (pip install -e '.[fleet]')")

from bench.fleet import client_view, drive, fleet_config, http_infer, main, oip_body
from orchestrator.fleet.config import parse_fleet_config


def test_an_unknown_fault_is_refused_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--faults", "kill,melt"])
    assert "unknown fault(s) ['melt']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--rayserve", "head"])  # Ray Serve rows: machine faults only
    assert "unknown fault(s) ['head']" in capsys.readouterr().err


def test_the_client_view_counts_every_request_once_by_its_outcome() -> None:
    rows = [{"sent": 0.0, "done": 0.01, "status": "OK", "latency_ms": 10.0},
            {"sent": 1.0, "done": 1.6, "status": "OK", "latency_ms": 600.0},
            {"sent": 1.1, "done": 1.2, "status": "HTTP_500", "latency_ms": 100.0},
            {"sent": 1.2, "done": 11.2, "status": "UNANSWERED"}]
    v = client_view(rows, t_start=0.0, t_fault=0.5, t_end=2.0)
    assert (v["sent"], v["ok"], v["errors"], v["unanswered"]) == (4, 2, 1, 1)
    assert v["time_to_first_ok_s"] == pytest.approx(1.1) and v["p50_ms_before"] == pytest.approx(10.0)


@pytest.mark.slow
def test_traffic_goes_on_while_the_fault_is_made_and_a_failed_fault_is_raised() -> None:
    sent: list[float] = []
    lock = threading.Lock()
    window: list[float] = []

    def send() -> None:
        with lock:
            sent.append(time.monotonic())

    def slow_fault() -> None:  # like the share fault: waits for the change before its kill
        window.append(time.monotonic())
        time.sleep(0.5)
        window.append(time.monotonic())

    rng = np.random.default_rng(0)
    drive(send, slow_fault, rate_rps=200.0, before_s=0.1, after_s=1.0, rng=rng)
    assert len(window) == 2  # joined before drive returned
    assert any(window[0] < t < window[1] for t in sent)  # requests went out while the fault was made

    def broken() -> None:
        raise RuntimeError("no such node")

    with pytest.raises(RuntimeError, match="the fault could not be made: no such node"):
        drive(send, broken, rate_rps=50.0, before_s=0.05, after_s=0.2, rng=rng)


def test_three_apps_fit_with_their_standbys_on_two_machines_and_the_arguments_are_checked(
        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = parse_fleet_config(fleet_config(3), source="test")
    assert [a["name"] for a in cfg.apps] == ["cls", "cls2", "cls3"]
    assert len({a["seed"] for a in cfg.apps}) == 3 and 2 * sum(a["gpu_pct"] for a in cfg.apps) <= 200
    assert fleet_config(1)["apps"][0]["gpu_pct"] == 50
    for argv in (["--apps", "4"], ["--http-share", "1.5"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "need 1 <= --apps <= 3" in capsys.readouterr().err


def test_an_http_request_is_an_answer_an_error_status_or_unanswered() -> None:
    class Door(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            doc = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ok = doc["inputs"][0]["shape"] == [1, 3, 2, 2] and len(doc["inputs"][0]["data"]) == 12
            self.send_response(200 if ok and self.path.startswith("/ok") else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Door)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        body = oip_body(np.zeros((3, 2, 2), np.float32))
        assert http_infer(f"{base}/ok", body) == "OK"
        assert http_infer(f"{base}/busy", body) == "HTTP_503"
    finally:
        server.shutdown()
        server.server_close()
    assert http_infer(base + "/ok", body, timeout_s=2.0) == "UNANSWERED"  # nothing listens there now
