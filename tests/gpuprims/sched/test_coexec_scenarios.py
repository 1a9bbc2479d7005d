from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuprims.sched.coexec_scenarios import PAPER_DUET, bundled, paper_chrion, paper_duet, paper_sir
from gpuprims.sched.sim_cli import main as sim_main


def test_bundled_profiles_say_where_they_come_from() -> None:
    for model in ("wide_deep", "siamese", "mt_dnn", "lstm"):
        p = bundled("paper", model)
        assert p.source == "paper" and p.kind == "accelerator" and "Table" in p.source_note
        assert all(s.source for s in p.stages)
    for model in ("wide_deep", "siamese", "mt_dnn", "resnet50"):
        p = bundled("cpu", model)
        assert p.source == "measured" and p.kind == "cpu" and p.cpu_cores
    with pytest.raises(ValueError, match="kind"):
        bundled("gpu", "lstm")
    with pytest.raises(ValueError, match="no bundled"):
        bundled("cpu", "nope")


def test_duet_on_the_papers_own_times_places_as_table2() -> None:
    res = paper_duet()
    assert res["simulated"]
    for model in ("wide_deep", "siamese"):
        pair = res["models"][model]["paper_pair"]
        assert sorted(pair["gpu"]) == sorted(["flatten", *PAPER_DUET[model]["gpu"]] if model == "wide_deep"
                                             else PAPER_DUET[model]["gpu"])
        assert sorted(pair["cpu"]) == sorted(PAPER_DUET[model]["cpu"])
    mt = res["models"]["mt_dnn"]["paper_pair"]
    assert len(mt["cpu"]) == 4 and "encoder" in mt["gpu"]
    for m in res["models"].values():
        ours = m["ours"]
        assert ours["latency_ms"] <= min(ours["gpu_only_ms"], ours["cpu_only_ms"]) + 1e-9


@pytest.mark.slow
def test_chrion_modes_trade_latency_and_memory() -> None:
    r = paper_chrion()
    assert r["latency_optimal_latency_ms"] <= r["gpu_latency_ms"] + 1e-9
    assert r["memory_optimal_mem_mb"] <= r["latency_optimal_mem_mb"] + 1e-9
    assert r["memory_optimal_latency_ms"] <= r["gpu_latency_ms"] + 1e-9
    assert r["gpu_mem_mb"] == pytest.approx(r["paper"]["gpu_mem_mb"], rel=1e-3)
    assert r["gpu_latency_ms"] == pytest.approx(r["paper"]["gpu_latency_ms"], rel=1e-3)


def test_sir_overflow_never_hurts_and_adds_throughput() -> None:
    r = paper_sir(requests=3000, loads=(0.5, 0.96))
    for m in r["models"].values():
        assert m["mean_latency_ms_overflow"] <= m["mean_latency_ms_gpu_only"] * 1.01
        assert m["throughput_rps_overflow"] >= m["throughput_rps_gpu_only"]
        assert m["by_load"][0]["gpu_only"]["simulated"]


@pytest.mark.slow
def test_sim_cli_runs_the_coexec_scenarios(tmp_path: Path) -> None:
    out = tmp_path / "chrion.json"
    res = CliRunner().invoke(sim_main, ["--scenario", "paper-chrion", "--out", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["simulated"] and doc["scenario"] == "paper-chrion" and "paper" in doc
