"""bench/opara's own bookkeeping: the flat summary rows, the paper's figures beside ours."""

from __future__ import annotations

from bench.opara import CPU_MODES, GPU_MODES, latency_rows, planning_rows, timing_summary


def test_timing_summary() -> None:
    assert timing_summary([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0}
    assert timing_summary([]) == {"median": None, "min": None}


def test_planning_rows_put_the_papers_figures_beside_ours() -> None:
    plan = {"num_streams": 28, "num_events": 36, "num_waits": 54, "ops": 199}
    rows = planning_rows("googlenet", [0.5, 0.3, 0.4], [0.2, 0.1, 0.3], plan)
    assert rows["googlenet_planning_ms"] == 0.4 and rows["googlenet_planning_min_ms"] == 0.3
    assert rows["googlenet_allocation_ms"] == 0.2 and rows["googlenet_allocation_min_ms"] == 0.1
    assert rows["googlenet_paper_planning_ms"] == 0.27 and rows["googlenet_paper_streams"] == 28
    assert (rows["googlenet_streams"], rows["googlenet_events"], rows["googlenet_waits"]) == (28, 36, 54)
    assert planning_rows("inception_v3", [1.0], [1.0], plan)["inception_v3_paper_planning_ms"] == 0.5


def test_latency_rows_speedups_equality_and_null_gpu_rows() -> None:
    samples = {"eager": [10.0, 12.0, 11.0], "streams": [20.0, 22.0, 21.0], "streams_capped": [5.5]}
    equal = {"streams": True, "streams_capped": False}
    rows = latency_rows("googlenet", 8, samples, equal)
    assert rows["googlenet_b8_eager_ms"] == 11.0
    assert rows["googlenet_b8_streams_speedup"] == 11.0 / 21.0
    assert rows["googlenet_b8_streams_capped_speedup"] == 2.0
    assert rows["googlenet_b8_streams_equal_eager"] is True
    assert rows["googlenet_b8_streams_capped_equal_eager"] is False
    # onnxruntime not installed: its modes are null, not missing
    assert rows["googlenet_b8_ort_parallel_ms"] is None and rows["googlenet_b8_ort_parallel_speedup"] is None
    for mode in GPU_MODES:
        assert rows[f"googlenet_b8_{mode}_ms"] is None
    assert {k for k in rows if k.endswith("_ms")} == {f"googlenet_b8_{m}_ms" for m in (*CPU_MODES, *GPU_MODES)}
