"""orchestrator.node.loop: the node's duties, each counted and timed; a failing duty is counted, never raised."""

from __future__ import annotations

import logging

import pytest

from orchestrator.node.loop import Duties


def test_a_pass_runs_each_duty_in_order_with_the_pass_time_and_counts_it() -> None:
    errors: dict[str, int] = {}
    duties = Duties(errors)
    seen: list[tuple[str, float]] = []
    duties.add("reap", lambda now: seen.append(("reap", now)), "supervision")
    duties.add("changes", lambda now: seen.append(("changes", now)))
    duties.add("messages", lambda item: seen.append(("messages", item)), "message", each_pass=False)
    duties.run(5.0)
    duties.run(6.0)
    assert seen == [("reap", 5.0), ("changes", 5.0), ("reap", 6.0), ("changes", 6.0)]
    duties.call("messages", 7)
    assert seen[-1] == ("messages", 7)
    st = duties.status()
    assert list(st) == ["reap", "changes", "messages"]
    assert st["reap"]["runs"] == 2 and st["messages"]["runs"] == 1 and st["reap"]["failures"] == 0
    assert all(d["total_ms"] >= 0 and d["max_us"] >= d["mean_us"] >= 0 for d in st.values())
    assert errors == {}


def test_a_failing_duty_is_counted_under_its_key_logged_and_the_pass_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    errors: dict[str, int] = {}
    duties = Duties(errors)
    ran: list[str] = []

    def boom(now: float) -> None:
        raise RuntimeError("broken")

    duties.add("hangs", boom, "supervision")
    duties.add("memory", lambda now: ran.append("memory"))
    with caplog.at_level(logging.ERROR, logger="gpuprims.node"):
        duties.run(1.0)
        duties.run(2.0)
    assert ran == ["memory", "memory"]
    assert errors == {"supervision": 2}
    assert duties["hangs"].failures == 2 and duties["hangs"].runs == 2
    assert "hangs failed (counted in status errors.supervision)" in caplog.text


def test_a_duty_with_an_interval_runs_at_once_then_when_due() -> None:
    duties = Duties({})
    at: list[float] = []
    duties.add("monitor", at.append, interval_s=0.5)
    for now in (10.0, 10.2, 10.49, 10.5, 10.7, 11.1):
        duties.run(now)
    assert at == [10.0, 10.5, 11.1]


def test_bad_duties_are_refused() -> None:
    duties = Duties({})
    duties.add("reap", lambda now: None)
    with pytest.raises(ValueError, match="'reap' is already in the loop"):
        duties.add("reap", lambda now: None)
    with pytest.raises(ValueError, match="interval_s must be positive, got 0"):
        duties.add("monitor", lambda now: None, interval_s=0)
