"""bench/fleet: its arguments are checked before a cluster starts, and the client's view is counted right."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="the fleet extra is not installed (pip install -e '.[fleet]')")

from bench.fleet import client_view, main


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
