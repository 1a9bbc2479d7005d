"""bench/sched_live's own bookkeeping: the per-stage breakdown of the node's run log."""

from __future__ import annotations

from bench.sched_live import run_log_breakdown
from orchestrator.node.dispatch import RunRecord


def test_run_log_breakdown_per_stage() -> None:
    recs = [RunRecord("a/main", 2, 10.0, 12.0, 1.0, 5.0),  # 13 > 15? no: in time
            RunRecord("a/main", 1, 10.0, 30.0, 2.0, 5.0),  # 32 > 15: late head
            RunRecord("a/main", 4, 20.0, 10.0, 3.0, 0.0),
            RunRecord("b/x", 1, 5.0, 5.0, 0.5, 100.0)]
    out = run_log_breakdown(recs)
    assert set(out) == {"a/main", "b/x"}
    a = out["a/main"]
    assert a["runs"] == 3 and a["requests"] == 7 and a["late_heads"] == 1
    assert a["measured_over_predicted_p50"] == 1.2 and a["model_ms_p50"] == 12.0
    assert a["overhead_ms_p50"] == 2.0 and a["slack_ms_p50"] == 5.0
    assert out["b/x"]["late_heads"] == 0 and out["b/x"]["measured_over_predicted_p50"] == 1.0
    assert run_log_breakdown([]) == {}
