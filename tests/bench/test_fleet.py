"""bench/fleet: its arguments are checked before a cluster starts, and the client's view is counted right."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

pytest.importorskip("ray", reason="the fleet extra is not installed (pip install -e '.[fleet]')")

from bench.fleet import client_view, drive, main


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
