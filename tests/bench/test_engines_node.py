"""bench/engines_node: the rate search, the trial's judgement and the summary, then a tiny run through a
real node (--quick). The measurement itself is the lead's to run (python -m bench.engines_node)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import common
from bench import engines_node as bench


def _stats(**kw: Any) -> dict[str, Any]:
    base = {"slo_attainment": 1.0, "lost": 0, "duplicates": 0, "once": 10, "sent_all": 10, "sent": 8}
    return {**base, **kw}


def test_judge_needs_attainment_nothing_lost_and_every_request_answered_once() -> None:
    assert bench.judge(_stats())
    assert bench.judge(_stats(slo_attainment=0.99))
    assert not bench.judge(_stats(slo_attainment=0.98))
    assert not bench.judge(_stats(slo_attainment=None, sent=0))
    assert not bench.judge(_stats(lost=1))
    assert not bench.judge(_stats(duplicates=1))
    assert not bench.judge(_stats(once=9))  # a warm-up request unanswered (or answered twice) fails it too
    assert not bench.judge(_stats(sent=0))


def _capacity_trial(capacity: float, generator_max: float = 1e9) -> tuple[Any, list[float]]:
    seen: list[float] = []

    def trial(rate: float) -> dict[str, Any]:
        seen.append(rate)
        offered = min(rate, generator_max)
        return {"passed": offered <= capacity, "generator_limited": offered < 0.98 * rate, "offered_rps": offered}

    return trial, seen


def test_find_max_rate_doubles_then_bisects_to_the_tolerance() -> None:
    trial, seen = _capacity_trial(300.0)
    best, history = bench.find_max_rate(trial, 100.0, max_trials=12, rel_tol=0.1)
    assert seen[:3] == [100.0, 200.0, 400.0]
    assert best is not None and 300.0 / 1.1 <= best["rate_rps"] <= 300.0
    fails = [h["rate_rps"] for h in history if not h["passed"]]
    assert min(fails) / best["rate_rps"] <= 1.1
    assert len(history) < 12


def test_find_max_rate_halves_down_when_the_start_is_too_high() -> None:
    trial, seen = _capacity_trial(30.0)
    best, _ = bench.find_max_rate(trial, 200.0, max_trials=12)
    assert seen[:4] == [200.0, 100.0, 50.0, 25.0]
    assert best is not None and 27.0 <= best["rate_rps"] <= 30.0


def test_find_max_rate_stops_going_up_at_the_generator_and_at_the_floor_and_the_budget() -> None:
    trial, seen = _capacity_trial(1e6, generator_max=500.0)
    best, _ = bench.find_max_rate(trial, 200.0, max_trials=12)
    assert seen == [200.0, 400.0, 800.0] and best is not None and best["generator_limited"]
    nothing, _ = bench.find_max_rate(_capacity_trial(0.5)[0], 8.0, max_trials=12, floor_rps=1.0)
    assert nothing is None
    _, short = bench.find_max_rate(_capacity_trial(1e6)[0], 1.0, max_trials=3)
    assert len(short) == 3


@pytest.mark.parametrize("bad", [{"start_rps": 0.0}, {"max_trials": 0}, {"rel_tol": 0.0}, {"floor_rps": -1.0}])
def test_find_max_rate_refuses_a_bad_search(bad: dict[str, Any]) -> None:
    kw: dict[str, Any] = {"start_rps": 10.0, "max_trials": 3, **bad}
    start = kw.pop("start_rps")
    with pytest.raises(ValueError, match="bad search"):
        bench.find_max_rate(lambda r: {"passed": True}, start, **kw)


def test_summarise_gives_ratios_against_eager_and_the_best_engine() -> None:
    res = {"classify": {"eager": {"max_rate_rps": 100.0, "p50_at_30rps_ms": 10.0},
                        "onnxruntime": {"max_rate_rps": 600.0, "p50_at_30rps_ms": 4.0},
                        "openvino": {"max_rate_rps": 450.0, "p50_at_30rps_ms": 5.0}},
           "resnet50": {"eager": {"max_rate_rps": None}, "onnxruntime": {"max_rate_rps": 20.0}}}
    s = bench.summarise(res)
    assert s["classify.onnxruntime.ratio_vs_eager"] == 6.0 and s["classify.openvino.ratio_vs_eager"] == 4.5
    assert s["classify.onnxruntime.p50_ratio_vs_eager"] == 0.4
    assert s["classify.best_engine"] == "onnxruntime" and s["classify.best_ratio"] == 6.0
    assert s["resnet50.onnxruntime.ratio_vs_eager"] is None  # eager held nothing: no ratio, not a crash
    assert s["resnet50.best_engine"] == "onnxruntime"
    failed = bench.summarise({"m": {"eager": {"max_rate_rps": 10.0},
                                    "openvino": {"engine": "openvino", "error": "node did not start: boom"}}})
    assert failed["m.openvino.error"] == "node did not start: boom" and failed["m.openvino.ratio_vs_eager"] is None
    assert failed["m.best_engine"] is None and "m.eager.error" not in failed


def test_config_puts_the_app_on_the_engine_and_the_share_asked() -> None:
    case = bench.CASES["resnet50"]
    one = bench.config(case, "resnet50", "onnxruntime", None)
    both = bench.config(case, "resnet50", "eager", "/tmp/x-cache", gpu_pct=100)
    assert one.apps[0].gpu_pct == 50 and one.apps[0].engine.kind == "onnxruntime"
    assert both.apps[0].gpu_pct == 100 and both.apps[0].engine.kind == "eager"
    assert both.node.engine_cache == "/tmp/x-cache" and one.node.engine_cache != "/tmp/x-cache"


@pytest.mark.heavy  # a real node per engine; the node with engines is tests/orchestrator/node/test_node_engines.py
def test_quick_run_through_a_node_writes_the_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "results_dir", lambda backend: tmp_path)
    bench.main(["--quick", "--cache", str(tmp_path / "cache"), "--name", "engines_node-smoke"])
    assert not (tmp_path / "engines_node-quick.json").exists()
    doc = json.loads((tmp_path / "engines_node-smoke.json").read_text())
    s = doc["summary"]
    assert doc["experiment"] == "engines_node" and "load_avg_before" in doc["machine"]
    assert s["classify.eager.engine_kind"] == "eager" and s["classify.onnxruntime.engine_kind"] == "onnxruntime"
    samples = json.loads((tmp_path / "engines_node-smoke.samples.json").read_text())
    for engine in ("eager", "onnxruntime"):
        r = samples["classify"][engine]
        # at 30 req/s on an idle-enough core every request is answered exactly once
        assert r["light"]["once"] == r["light"]["sent_all"] > 0 and r["light"]["lost"] == 0
        assert r["history"] and all("latency_ms" in h and h["sent_all"] > 0 for h in r["history"])
        assert s[f"classify.{engine}.p50_at_30rps_ms"] > 0
    # the engines' trials took turns: eager's first, then onnxruntime's, and so on
    turns = {e: [h["turn"] for h in samples["classify"][e]["history"]] for e in ("eager", "onnxruntime")}
    assert turns["eager"][0] == 0 and turns["onnxruntime"][0] == 1
    assert not set(turns["eager"]) & set(turns["onnxruntime"])
    assert s["classify.onnxruntime.model_rate_ratio_b4"] > 0


def test_generator_limited_by_rate_or_by_lag_behind_the_schedule() -> None:
    assert not bench.generator_limited(99.0, 100.0, 500.0, 200.0)
    assert bench.generator_limited(97.0, 100.0, 500.0, 200.0)  # more than 2 % short of the target
    assert bench.generator_limited(100.0, 100.0, 20_001.0, 200.0)  # sends 20 ms late: a tenth of a 200 ms SLO
    assert not bench.generator_limited(100.0, 100.0, None, 200.0)


def test_model_only_summary_pairs_each_round_and_takes_the_median() -> None:
    times = {"eager": {"b1": [10.0, 12.0, 11.0], "b4": [20.0, 40.0, 30.0]},
             "onnxruntime": {"b1": [2.0, 3.0, 2.5], "b4": [5.0, 8.0, 10.0]},
             "openvino": {"b1": [], "b4": []}}
    s = bench.model_only_summary(times, 4)
    assert s["eager.model_b1_ms"] == 11.0 and s["eager.model_b4_ms"] == 30.0
    assert s["onnxruntime.model_b4_ms"] == 8.0
    # rounds paired: 20/5, 40/8, 30/10 -> 4, 5, 3 -> median 4 (not 30/8 of the two medians)
    assert s["onnxruntime.model_rate_ratio_b4"] == 4.0
    assert "openvino.model_rate_ratio_b4" not in s and "openvino.model_b4_ms" not in s  # nothing measured
    assert "eager.model_rate_ratio_b4" not in s
    assert bench.model_only_summary({"onnxruntime": {"b4": [1.0]}}, 4) == {"onnxruntime.model_b4_ms": 1.0}


@pytest.mark.slow
def test_model_only_times_each_engine_on_the_share_and_restores_the_thread(tmp_path: Path) -> None:
    import os

    import torch

    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    case = bench.CASES["classify"]
    mo = bench.model_only(case, ["eager", "onnxruntime", "no-such-engine"], cache=str(tmp_path / "cache"),
                          rounds=2, reps=2)
    assert set(mo["times"]) == {"eager", "onnxruntime"} and "no-such-engine" in mo["errors"]
    for t in mo["times"].values():
        assert set(t) == {"b1", "b4"} and all(len(v) == 2 and min(v) > 0 for v in t.values())
    assert mo["threads"] >= 1 and mo["cores"]
    assert os.sched_getaffinity(0) == before and torch.get_num_threads() == threads


def test_rate_search_takes_one_trial_at_a_time_and_ends() -> None:
    search = bench.RateSearch(100.0, max_trials=3)
    assert search.rate == 100.0 and not search.done
    search.record({"passed": True})
    assert search.rate == 200.0
    search.record({"passed": False})
    assert search.rate == pytest.approx(141.42, abs=0.01)
    search.record({"passed": True})
    assert search.done and search.best is not None and search.best["rate_rps"] == pytest.approx(141.42, abs=0.01)
    assert [h["rate_rps"] for h in search.history][:2] == [100.0, 200.0]
    with pytest.raises(RuntimeError, match="over"):
        search.record({"passed": True})


def test_the_pump_steps_every_node_in_turn() -> None:
    calls: list[tuple[str, float]] = []

    class Node:
        def __init__(self, name: str) -> None:
            self.name = name

        def step(self, timeout_ms: float) -> None:
            calls.append((self.name, timeout_ms))

    bench._Pump([Node("a"), Node("b")]).step(50)
    assert calls == [("a", 25.0), ("b", 25.0)]
