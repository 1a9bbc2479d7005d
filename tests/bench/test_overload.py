"""bench/overload: how answers are classed and summarised (the run itself is a heavy smoke test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.overload import classify, summarise

ROOT = Path(__file__).resolve().parents[2]


def test_each_transports_statuses_are_classed() -> None:
    assert [classify("udp", c) for c in ("ok", "OVERLOADED", "DEADLINE_MISSED", "lost", "INTERNAL")] == \
        ["ok", "refused", "late", "lost", "error_INTERNAL"]
    assert [classify("http", c) for c in ("error_503", "error_429", "error_504", "error_400")] == \
        ["refused", "refused", "late", "error_400"]
    assert [classify("grpc", c) for c in ("error_StatusCode.UNAVAILABLE", "error_StatusCode.DEADLINE_EXCEEDED")] == \
        ["refused", "late"]


def test_goodput_counts_ok_answers_within_the_slo_and_refusals_apart() -> None:
    run = {"latency_ms": [10.0, 20.0, 300.0, 1.0, 2.0, 250.0, 5000.0], "span_s": 2.0, "driver_cpu_s": 0.0,
           "status": ["ok", "ok", "ok", "refused", "refused", "late", "lost"], "lag_ms": [0.0] * 7}
    s = summarise(run, slo_ms=200.0)
    assert s["sent"] == 7 and s["goodput_rps"] == 1.0 and s["throughput_rps"] == 1.5
    assert s["refused"] == 2 and s["refusal_p99_ms"] is not None and s["refusal_p99_ms"] <= 2.0
    assert s["late"] == 1 and s["lost"] == 1 and s["other"] == {} and s["slo_attainment"] == round(2 / 7, 4)
    assert s["admitted_p50_ms"] == 20.0


@pytest.mark.heavy  # a real node, five driver processes, about a minute on a quiet machine
def test_a_quick_run_writes_the_result(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "bench.overload", "--quick", "--loads", "1", "3", "--out", str(tmp_path)],
                   cwd=ROOT, check=True, timeout=600, capture_output=True)
    doc = json.loads((tmp_path / "overload.json").read_text())
    assert doc["experiment"] == "overload" and "load_avg_after" in doc["machine"]
    for path in ("udp", "http", "grpc"):
        assert f"{path}.3x.goodput_rps" in doc["summary"]
    assert (tmp_path / "overload.samples.json").exists()
