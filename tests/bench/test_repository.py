"""bench/repository: the requests it sends, a trial's figures, the summary, the argument checks and the model
choice, then a quick run through real nodes on the example repository (--quick, heavy). The measurement
itself is the lead's to run (python -m bench.repository)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench import engines_node
from bench import repository as bench
from gpuprims.modelrepo import parse_config
from gpuprims.tensors import DataType, ModelSignature, TensorSpec

from ..modelfiles import DETECTOR_CONFIG, MULTI_CONFIG, repository

MULTI = parse_config(MULTI_CONFIG.format(name="multi"), "multi/config.pbtxt").signature
DETECTOR = parse_config(DETECTOR_CONFIG.format(name="detector"), "detector/config.pbtxt").signature


def test_a_request_has_every_input_of_its_datatype_with_the_dynamic_dims_at_the_width() -> None:
    r = bench.request(MULTI, 5, seed=1)
    assert list(r) == ["image in", "scale.k", "flag"]
    assert r["image in"].shape == (3, 5) and r["image in"].dtype == np.float32
    assert r["scale.k"].shape == (1,) and r["scale.k"].dtype == np.int64 and 0 <= r["scale.k"][0] < bench.INT_HIGH
    assert r["flag"].dtype == np.bool_
    again = bench.request(MULTI, 5, seed=1)
    assert all(np.array_equal(r[k], again[k]) for k in r)  # seeded
    assert bench.request(DETECTOR, 7, seed=0)["scores"].shape == (7,)
    with pytest.raises(ValueError, match="width must be >= 1"):
        bench.request(MULTI, 0, seed=0)
    text = ModelSignature((TensorSpec("text", DataType.BYTES, (1,)),), (TensorSpec("y", DataType.FP32, (1,)),), 4)
    with pytest.raises(ValueError, match="input 'text' is BYTES"):
        bench.request(text, 4, seed=0)


def test_dynamic_models_batch_and_have_a_dynamic_input() -> None:
    assert bench.dynamic_model(MULTI)
    assert not bench.dynamic_model(DETECTOR)  # dynamic, but never batched: nothing to mix
    fixed = ModelSignature((TensorSpec("x", DataType.FP32, (6,)),), (TensorSpec("y", DataType.FP32, (3,)),), 4)
    assert not bench.dynamic_model(fixed)


def test_requests_interleave_the_widths_and_the_engine_batch_stacks_them() -> None:
    bodies, of = bench.requests_for(MULTI, [2, 4, 8], count=3)
    assert of == [2, 4, 8] * 3 and [b["image in"].shape[1] for b in bodies] == of
    full = bench.engine_batch(MULTI, bodies[:1])  # cycled up to max_batch_size
    assert full["image in"].shape == (8, 3, 2) and full["flag"].shape == (8, 1)
    assert bench.engine_batch(MULTI, bodies[:1], 1)["scale.k"].shape == (1, 1)
    with pytest.raises(ValueError, match=r"a batch of 9 rows: the model takes 1\.\.8"):
        bench.engine_batch(MULTI, bodies[:1], 9)
    det, _ = bench.requests_for(DETECTOR, [16], count=2)
    assert bench.engine_batch(DETECTOR, det)["scores"].shape == (16,)  # no batch dimension
    with pytest.raises(ValueError, match="no requests"):
        bench.engine_batch(MULTI, [])
    with pytest.raises(ValueError, match="at least one width"):
        bench.requests_for(MULTI, [])
    assert bench.batch_key(4) == "b4" and bench.batch_key(4, 32) == "b4@w32"


def test_a_schedule_is_open_loop_at_the_rate() -> None:
    t = bench.schedule(100.0, 1.0, 0.5, "constant", seed=0)
    assert len(t) == 150 and t[0] == 0.0 and np.allclose(np.diff(t), 0.01) and t[-1] < 1.5
    p = bench.schedule(100.0, 10.0, 0.0, "poisson", seed=3)
    assert np.array_equal(p, bench.schedule(100.0, 10.0, 0.0, "poisson", seed=3))
    assert 800 < len(p) < 1200 and p[-1] < 10.0
    with pytest.raises(ValueError, match="process must be constant or poisson"):
        bench.schedule(10.0, 1.0, 0.0, "bursty", seed=0)
    with pytest.raises(ValueError, match="bad trial: rate 0"):
        bench.schedule(0, 1.0, 0.0, "constant", seed=0)


def _records(status: list[str], latency: list[float], warm: int = 2, *, rate: float = 10.0, lag_s: float = 0.0,
             stray: int = 0) -> dict[str, Any]:
    n = len(status)
    sched = [i / rate for i in range(n)]
    return {"warmup": [i < warm for i in range(n)], "status": status, "latency_ms": latency, "sched_s": sched,
            "send_s": [s + lag_s for s in sched], "lag_us": [lag_s * 1e6] * n, "stray": stray}


def test_a_trial_counts_the_measured_requests_and_every_one_answered_once() -> None:
    rec = _records(["OK", "OK", "OK", "OK", "OK", "DEADLINE_MISSED", "OK", "OK", "OK", "OK", "OK", "LOST"],
                   [1.0, 1.0, 2.0, 3.0, 250.0, 1.0, 4.0, 5.0, 6.0, 7.0, 8.0, float("nan")])
    st = bench.trial_stats(rec, slo_ms=200.0, target_rps=10.0, duration_s=1.0)
    assert st["sent"] == 10 and st["sent_all"] == 12 and st["once"] == 11 and st["lost"] == 1
    assert st["ok"] == 8 and st["slo_attainment"] == 0.7  # 250 ms is OK but late, DEADLINE_MISSED and LOST miss
    assert st["statuses"] == {"OK": 8, "DEADLINE_MISSED": 1, "LOST": 1} and st["duplicates"] == 0
    assert st["p50_ms"] == pytest.approx(5.5) and st["offered_rps"] == 10.0 and not st["generator_limited"]
    assert not engines_node.judge(st)
    clean = bench.trial_stats(_records(["OK"] * 12, [1.0] * 12), slo_ms=200.0, target_rps=10.0, duration_s=1.0)
    assert clean["slo_attainment"] == 1.0 and engines_node.judge(clean)
    twice = bench.trial_stats(_records(["OK"] * 12, [1.0] * 12, stray=1), slo_ms=200.0, target_rps=10.0,
                              duration_s=1.0)
    assert twice["duplicates"] == 1 and not engines_node.judge(twice)


def test_a_trial_whose_sends_went_late_is_generator_limited() -> None:
    # every send 50 ms behind its schedule: a quarter of the 200 ms SLO (more than engines_node's tenth)
    late = bench.trial_stats(_records(["OK"] * 12, [1.0] * 12, lag_s=0.05), slo_ms=200.0, target_rps=10.0,
                             duration_s=1.0)
    assert late["send_lag_p99_us"] == 50000.0 and late["generator_limited"]
    # sends stretched over twice the window: the achieved rate is half the target
    slow = _records(["OK"] * 12, [1.0] * 12)
    slow["send_s"] = [2 * s for s in slow["sched_s"]]
    st = bench.trial_stats(slow, slo_ms=1e6, target_rps=10.0, duration_s=1.0)
    assert st["offered_rps"] == pytest.approx(10 / 2.1, abs=0.01) and st["generator_limited"]
    bad = _records(["OK"] * 3, [1.0] * 2)
    with pytest.raises(ValueError, match="latency_ms has 2 entries for 3 requests"):
        bench.trial_stats(bad, slo_ms=1.0, target_rps=1.0, duration_s=1.0)


def test_engine_rates_come_from_the_median_run() -> None:
    assert bench.engine_rate([1.0, 2.0, 100.0], 4) == 2000.0  # 4 requests in 2 ms
    assert bench.engine_rate([], 4) is None and bench.engine_rate([0.0], 1) is None
    assert bench.mixed_rate([100.0, 300.0]) == 150.0  # half the requests at each rate
    assert bench.mixed_rate([100.0, None]) is None and bench.mixed_rate([]) is None


def _trial(rate: float, passed: bool, *, limited: bool = False, lost: int = 0) -> dict[str, Any]:
    return {"rate_rps": rate, "offered_rps": rate * 0.99, "passed": passed, "generator_limited": limited,
            "lost": lost, "duplicates": 0, "p50_ms": 3.0, "p99_ms": 9.0}


def test_the_summary_sets_each_model_beside_its_engine_alone() -> None:
    single = {"best": _trial(400.0, True), "history": [_trial(200.0, True), _trial(400.0, True), _trial(800.0, False)]}
    mixed = {"best": _trial(200.0, True), "history": [_trial(200.0, True), _trial(400.0, False, limited=True, lost=2)]}
    rows = {
        "ocr": {"engine": {"batch": 4, "mixed_widths": [32, 64, 128],
                           "times_ms": {"b1": [1.0, 1.0], "b4": [10.0, 9.0, 11.0], "b4@w32": [5.0], "b4@w64": [10.0],
                                        "b4@w128": [20.0]}},
                "single": single, "mixed": mixed,
                "start_cold": {"wall_s": 5.0, "engine": {"build_ms": 100.0, "load_ms": 1.0, "cache_hit": False}},
                "start_cached": {"wall_s": 3.0, "engine": {"build_ms": 0.0, "load_ms": 9.0, "cache_hit": True}}},
        "scripted": {"engine": {"batch": 8, "times_ms": {"b1": [0.5], "b8": [1.0]}}, "error": "the node refuses it"},
    }
    s = bench.summarise(rows)
    assert s["ocr.engine_rate_rps"] == 400.0 and s["ocr.engine_batch_ms"] == 10.0 and s["ocr.engine_b1_ms"] == 1.0
    assert s["ocr.node_rate_rps"] == 396.0 and s["ocr.node_over_engine_ratio"] == 0.99 and s["ocr.meets_goal"]
    assert s["ocr.node_p50_ms"] == 3.0 and s["ocr.node_p99_ms"] == 9.0 and not s["ocr.generator_limited"]
    assert s["ocr.trials"] == 5 and s["ocr.lost"] == 2 and s["ocr.duplicates"] == 0
    assert s["ocr.mixed_shape_rate_rps"] == 198.0 and s["ocr.single_shape_rate_rps"] == 396.0
    assert s["ocr.mixed_over_single_ratio"] == 0.5 and s["ocr.mixed_generator_limited"]
    # the engine on an equal mix of widths 32, 64, 128 at 800, 400 and 200 req/s
    assert s["ocr.engine_mixed_rate_rps"] == pytest.approx(342.86) and s["ocr.mixed_widths"] == [32, 64, 128]
    assert s["ocr.start_cold_s"] == 5.0 and s["ocr.start_cached_s"] == 3.0
    assert s["ocr.start_cold_engine_cache_hit"] is False and s["ocr.start_cached_engine_cache_hit"] is True
    assert s["ocr.start_cold_engine_build_ms"] == 100.0 and s["ocr.start_cached_engine_load_ms"] == 9.0
    assert s["scripted.engine_rate_rps"] == 8000.0 and s["scripted.error"] == "the node refuses it"
    assert "scripted.node_rate_rps" not in s and "scripted.start_cold_s" not in s
    assert s["models_measured"] == ["ocr"] and s["models_meeting_goal"] == ["ocr"]
    assert s["goal_node_over_engine_ratio"] == bench.GOAL_RATIO
    none_held = bench.summarise({"m": {"engine": {"batch": 1, "times_ms": {"b1": [1.0]}},
                                       "single": {"best": None, "history": [_trial(50.0, False, limited=True)]}}})
    assert none_held["m.node_rate_rps"] is None and none_held["m.node_over_engine_ratio"] is None
    assert none_held["m.meets_goal"] is False and none_held["m.generator_limited"] is True


@pytest.mark.parametrize(("argv", "message"), [
    (["--trial-s", "0"], "--trial-s must be a positive number, got 0.0"),
    (["--max-rate", "nan"], "--max-rate must be a positive number, got nan"),
    (["--start-rps", "-5"], "--start-rps must be a positive number, got -5.0"),
    (["--warmup-s", "-1"], "--warmup-s must be >= 0, got -1.0"),
    (["--max-trials", "0"], "--max-trials must be >= 1, got 0"),
    (["--width", "0"], "--width must be >= 1, got 0"),
    (["--engine-reps", "2"], "--engine-reps must be >= 5, got 2"),
    (["--mixed-widths", "8", "8", "16"], "--mixed-widths needs three or more different widths >= 1"),
    (["--mixed-widths", "0", "8", "16"], "--mixed-widths needs three or more different widths >= 1"),
    (["--process", "bursty"], "invalid choice: 'bursty'"),
    (["--repository", "/nonexistent/repo"], "--repository '/nonexistent/repo' is not a directory"),
])
def test_bad_arguments_are_refused_naming_the_value(argv: list[str], message: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_models_asked_for_must_be_in_the_repository(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = repository(tmp_path / "repo")
    names = bench.model_names(root)
    assert sorted(names) == ["broken", "detector", "multi", "noconfig"]
    assert bench.pick_models(names, ["multi", "multi"], False, root) == ["multi"]
    assert bench.pick_models(names, None, False, root) == names
    quick = bench.pick_models(names, None, True, root)  # the first model with a dynamic input that batches
    assert quick in (["multi"], ["noconfig"])
    with pytest.raises(ValueError, match=r"no model\(s\) \['nope'\] in the repository \(it has: "):
        bench.pick_models(names, ["nope"], False, root)
    with pytest.raises(SystemExit) as e:  # refused before any node starts or any file is built
        bench.main(["--repository", str(root), "--models", "nope", "--out-dir", str(tmp_path / "out")])
    assert e.value.code == 2 and "no model(s) ['nope']" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_node_serves_the_one_model_from_the_repository(tmp_path: Path) -> None:
    root = repository(tmp_path / "repo")
    cfg = bench.node_config(root, "multi", tmp_path / "cache")
    assert [a.name for a in cfg.apps] == ["multi"] and cfg.node.model_control_mode == "explicit"
    assert cfg.node.engine_cache == str(tmp_path / "cache") and cfg.node.autoscale is False
    assert cfg.node.listen.host == "127.0.0.1" and cfg.node.backend == "cpu"


def test_a_model_that_does_not_read_gets_a_row_saying_why(tmp_path: Path) -> None:
    root = repository(tmp_path / "repo")
    _, args = bench.parse_args(["--repository", str(root)])
    row = bench.run_model(root, "broken", tmp_path, lambda: pytest.fail("no trial without a model"), args)
    assert row["error"].startswith("the model does not read:") and "not a readable ONNX model" in row["error"]
    assert "broken.error" in bench.summarise({"broken": row})


@pytest.mark.heavy  # the example repository built, two real nodes, the driver process and ONNX Runtime
def test_a_quick_run_serves_the_dynamic_model_and_writes_the_result(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    path = bench.main(["--quick", "--out-dir", str(tmp_path), "--name", "repository-test"])
    assert path == tmp_path / "repository-test.json"
    doc = json.loads(path.read_text())
    s = doc["summary"]
    assert doc["experiment"] == "repository" and "load_avg_before" in doc["machine"]
    assert s["models"] == ["ocr"] and "ocr.error" not in s
    assert s["ocr.engine_rate_rps"] > 0 and s["ocr.engine_batch"] == 4
    assert s["ocr.start_cold_s"] > 0 and s["ocr.start_cached_s"] > 0
    assert s["ocr.start_cold_engine_cache_hit"] is False and s["ocr.start_cached_engine_cache_hit"] is True
    # Every request answered once, whatever the machine's speed (a busy one answers some DEADLINE_MISSED).
    assert s["ocr.trials"] == 4 and s["ocr.lost"] == 0 and s["ocr.duplicates"] == 0
    assert "ocr.mixed_shape_rate_rps" in s and s["ocr.mixed_widths"] == list(bench.MIXED_WIDTHS)
    samples = json.loads((tmp_path / "repository-test.samples.json").read_text())
    ocr = samples["ocr"]
    for search in ("single", "mixed"):
        for trial in ocr[search]["history"]:
            assert trial["once"] == trial["sent_all"] == len(trial["requests"]["status"])
    assert set(ocr["mixed"]["history"][0]["requests"]["width"]) == set(bench.MIXED_WIDTHS)
    assert set(ocr["engine"]["times_ms"]) == {"b1", "b4", "b4@w32", "b4@w64", "b4@w128"}


class _Pumped:
    """What Driver.trial pumps while it waits: a node's control loop, counted."""

    def __init__(self) -> None:
        self.steps = 0

    def step(self, timeout_ms: float) -> None:
        self.steps += 1


@pytest.mark.slow  # spawns the driver process (it imports the bench)
def test_a_driver_whose_trial_fails_says_why_is_broken_and_is_reaped() -> None:
    driver = bench.Driver()
    try:
        node = _Pumped()
        with pytest.raises(RuntimeError, match=r"the driver failed: .*process must be constant or poisson"):
            driver.trial(node, wait_s=120, port=9, app_id=1, bodies=[], rate=10.0, duration_s=1.0, warmup_s=0.0,
                         process="bursty", seed=0, timeout_s=1.0, cores=[0])
        assert driver.broken and node.steps > 0 and driver.proc.is_alive()
    finally:
        driver.close()
    assert not driver.proc.is_alive() and driver.proc.exitcode is not None
