"""bench/single_stream: the figures it derives, its cases, and a quick real-node run (--quick, heavy).
The measurement itself is the lead's to run (python -m bench.single_stream)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import single_stream as bench


def test_a_case_is_summarised_over_answered_requests_beside_the_engine_alone() -> None:
    s = bench.summarise_case([1.0, 2.0, 3.0, 5000.0], ["ok", "ok", "ok", "lost"], [0.5, 0.4, 0.6], wall_s=2.0,
                             query=1)
    assert s["requests"] == 4 and s["ok"] == 3 and s["lost"] == 1 and s["errors"] == {"lost": 1}
    assert s["p50_ms"] == 2.0 and s["engine_ms"] == 0.5 and s["added_p50_ms"] == 1.5
    assert s["p99_ms"] == pytest.approx(2.98) and s["added_p99_ms"] == pytest.approx(2.48)
    assert s["throughput_rps"] == 1.5  # three answered in 2 s
    multi = bench.summarise_case([4.0, 4.0, 1.0], ["ok", "ok", "DEADLINE_MISSED"], [3.0], wall_s=1.0, query=8)
    assert multi["throughput_rps"] == 16.0  # samples per second: two queries of 8 answered OK
    assert multi["p50_ms"] == 4.0 and multi["errors"] == {"DEADLINE_MISSED": 1} and multi["lost"] == 0
    none = bench.summarise_case([1.0], ["error_500"], [], wall_s=1.0, query=1)
    assert none["p50_ms"] is None and none["engine_ms"] is None and none["added_p50_ms"] is None
    with pytest.raises(ValueError, match="1 outcomes for 2 latencies"):
        bench.summarise_case([1.0, 2.0], ["ok"], [], wall_s=1.0, query=1)


def test_the_cases_and_the_engine_batch_beside_each() -> None:
    todo, skipped = bench.cases(["udp", "http"], [1, 8], max_batch=8)
    assert todo == [("udp", 1, 1), ("udp", 8, 1), ("http", 1, 1), ("http", 8, 1), ("udp", 1, 8), ("http", 1, 8)]
    assert skipped == []
    todo, skipped = bench.cases(["udp", "grpc"], [1], max_batch=4)
    assert ("grpc", 1, 8) not in todo and ("udp", 1, 8) in todo  # infer_many's 8 are 8 requests
    assert len(skipped) == 1 and "grpc.multistream8" in skipped[0] and "max_batch is 4" in skipped[0]
    assert [bench.case_key(*c) for c in todo] == ["udp.c1", "grpc.c1", "udp.multistream8"]
    assert bench.engine_batch(8, 1, 4) == 4 and bench.engine_batch(2, 1, 8) == 2 and bench.engine_batch(1, 8, 4) == 8


def test_the_app_is_the_examples_classify() -> None:
    app = bench.example_app(8, None)
    assert app["name"] == "classify" and app["engine"] == "onnxruntime" and app["max_batch"] == 8
    assert app["shadow"] is False and app["max_wait_ms"] > 0  # the example's wait
    assert bench.example_app(4, 0.0)["max_wait_ms"] == 0.0
    cfg = bench.node_config(app, "/tmp/x-cache")
    assert cfg.apps[0].max_batch == 8 and cfg.node.engine_cache == "/tmp/x-cache"


@pytest.mark.heavy  # a real node with its front door and an ONNX Runtime engine
def test_a_quick_run_answers_every_request_and_writes_the_result(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    path = bench.main(["--quick", "--cache", str(tmp_path / "cache"), "--out-dir", str(tmp_path),
                       "--name", "single_stream-test"])
    assert path == tmp_path / "single_stream-test.json"
    doc = json.loads(path.read_text())
    s = doc["summary"]
    assert doc["experiment"] == "single_stream" and "load_avg_before" in doc["machine"]
    for key in ("udp.c1", "udp.c2", "http.c1", "http.c2", "grpc.c1", "grpc.c2", "udp.multistream8",
                "http.multistream8", "grpc.multistream8"):
        # Every request answered (a busy machine may answer some DEADLINE_MISSED: counted, not lost).
        assert s[f"{key}.requests"] == 20 and s[f"{key}.lost"] == 0, (key, s[f"{key}.errors"])
        assert s[f"{key}.ok"] > 0 and s[f"{key}.p50_ms"] > 0 and s[f"{key}.engine_ms"] > 0, key
        assert s[f"{key}.added_p50_ms"] == pytest.approx(s[f"{key}.p50_ms"] - s[f"{key}.engine_ms"], abs=2e-3)
        assert sum(int(b) * n for b, n in s[f"{key}.batch_sizes"].items()) >= 20, key  # the instance served them
    assert s["instance_engine"] == "onnxruntime" and s["skipped"] == []
    samples = json.loads((tmp_path / "single_stream-test.samples.json").read_text())
    assert len(samples["latency_ms"]["udp.c1"]) == 20 and samples["engine_ms"]["udp.multistream8"]
