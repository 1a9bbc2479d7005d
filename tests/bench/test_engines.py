"""bench/engines' own logic: one child's figures, and the summary (percentiles, rates, ratios) built from
children's results. The measurement itself is the lead's to run (python -m bench.engines)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import engines as bench_engines
from tests.gpuprims.engines.tinynet import SPEC


def test_child_builds_times_and_reports(tmp_path: Path) -> None:
    spec = {"engine": "eager", "model": SPEC, "shape": [3, 16, 16], "max_batch": 2, "cache": str(tmp_path),
            "runs": 3, "warmup": 1, "threads": 1}
    # child() pins its process to its threads' cores, as the bench's child process: put this one's back
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        out = bench_engines.child(spec)
        assert len(out["batch1"]) == 3 and len(out["batch2"]) == 3 and all(s > 0 for s in out["batch1"])
        assert out["rss_mb"] > 0 and out["prepare_ms"] >= 0 and out["describe"]["kind"] == "eager"
        quiet = bench_engines.child({**spec, "time": False})
        assert "batch1" not in quiet
    finally:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)


def test_measure_builds_the_summary(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(bench_engines.CASES, "tiny", (SPEC, (3, 16, 16), 4))
    seen: list[dict[str, Any]] = []
    per_sample_ms = {"eager": 4.0, "onnxruntime": 1.0}

    def fake_child(spec: dict[str, Any]) -> dict[str, Any]:
        seen.append(spec)
        if spec["engine"] == "broken":
            return {"error": "exit 1: ExportError: model 'x' does not export to ONNX: reason"}
        out: dict[str, Any] = {"prepare_ms": 10.0 if spec.get("time", True) else 500.0,
                               "cache_hit": spec.get("time", True), "rss_mb": 100.0, "describe": {}}
        if spec.get("time", True):
            for b in (1, 4):
                out[f"batch{b}"] = [per_sample_ms[spec["engine"]] * b / spec["threads"]] * 5
        return out

    monkeypatch.setattr(bench_engines, "_run_child", fake_child)
    summary, samples = bench_engines.measure(["tiny"], ["eager", "onnxruntime", "broken"], [1, 2], runs=5,
                                             warmup=1, progress=False)
    assert summary["tiny_eager_build_cold_ms"] == 500.0 and summary["tiny_eager_t1_build_cached_ms"] == 10.0
    assert summary["tiny_onnxruntime_t1_cache_hit"] is True and summary["tiny_onnxruntime_t2_rss_mb"] == 100.0
    assert summary["tiny_eager_t1_b4_p50_ms"] == 16.0 and summary["tiny_eager_t1_b4_rate_rps"] == 250.0
    assert summary["tiny_onnxruntime_t2_b1_p50_ms"] == 0.5
    assert summary["tiny_onnxruntime_t1_b1_speedup"] == 4.0 and summary["tiny_onnxruntime_t2_b4_rate_ratio"] == 4.0
    assert summary["tiny_broken_error"].startswith("exit 1: ExportError")
    assert "tiny_broken_t1_b1_p50_ms" not in summary and len(samples["tiny_eager_t1_b1_ms"]) == 5
    # one cold child per engine, then one per thread count on the cache it filled
    assert [(s["engine"], s.get("time", True), s["threads"]) for s in seen] == [
        ("eager", False, 1), ("eager", True, 1), ("eager", True, 2),
        ("onnxruntime", False, 1), ("onnxruntime", True, 1), ("onnxruntime", True, 2), ("broken", False, 1)]
    assert len({s["cache"] for s in seen if s["engine"] == "eager"}) == 1


def test_an_unknown_case_is_refused_before_anything_is_measured(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        bench_engines.main(["--cases", "mobilenet_v2_64,resnet9000", "--engines", "eager"])
    assert e.value.code == 2 and "unknown case(s) resnet9000" in capsys.readouterr().err
