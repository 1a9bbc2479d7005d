from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuprims.profile import (
    PAPER_MODELS,
    ProfileError,
    load_profile,
    load_profiles,
    paper_profile,
    paper_profiles,
    profile_from_dict,
    save_profile,
)
from tests.gpuprims.sched._profiles import grid


def _prof():
    return grid("toy", {50: {1: 4.0, 4: 10.0}, 100: {1: 2.0, 4: 5.0}})


def test_exact_points_and_bilinear_interpolation() -> None:
    p = _prof()
    assert p.batch_sizes == [1, 4] and p.gpu_pcts == [50, 100]
    assert p.latency_ms(1, 100) == 2.0
    assert p.latency_ms(4, 50) == 10.0
    assert p.latency_ms(1, 75) == pytest.approx(3.0)
    assert p.latency_ms(2, 100) == pytest.approx(3.0)
    # centre of the cell: mean of the four corners
    assert p.latency_ms(2.5, 75) == pytest.approx((4 + 10 + 2 + 5) / 4)
    assert p.latency_ms(1, 100, stat="p99") == 2.0
    assert p.peak_mem_mb(4, 50) == 104.0
    assert p.point(4, 100).latency_p50_ms == 5.0
    assert p.covers(2, 60) and not p.covers(5, 60) and not p.covers(2, 40)


@pytest.mark.parametrize(("batch", "pct", "needle"), [(8, 100, "batch_size 8"), (0, 100, "batch_size 0"),
                                                     (1, 25, "gpu_pct 25"), (1, 101, "gpu_pct 101")])
def test_outside_measured_range_names_model_value_and_range(batch: int, pct: int, needle: str) -> None:
    with pytest.raises(ValueError, match="toy") as e:
        _prof().latency_ms(batch, pct)
    assert needle in str(e.value) and "range" in str(e.value)


def test_bad_stat_and_missing_point() -> None:
    with pytest.raises(ValueError, match="stat"):
        _prof().latency_ms(1, 100, stat="p90")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no measured point"):
        _prof().point(2, 100)


def test_round_trip(tmp_path: Path) -> None:
    p = _prof()
    f = save_profile(p, tmp_path / "sub" / "toy.json")
    q = load_profile(f)
    assert q == p
    assert q.latency_ms(2, 60) == p.latency_ms(2, 60)
    assert load_profiles([tmp_path / "sub"]) == {"toy": p}


def _doc() -> dict:
    return _prof().model_dump(mode="json")


@pytest.mark.parametrize(("mutate", "needle"), [
    (lambda d: d.update(format_version=3), "format_version"),
    (lambda d: d.pop("model"), "model"),
    (lambda d: d.update(source="guess"), "source"),
    (lambda d: d["points"][0].update(gpu_pct=0), "points.0.gpu_pct"),
    (lambda d: d["points"][0].update(latency_p99_ms=0.5), "points.0"),
    (lambda d: d["points"].pop(0), "full grid"),
    (lambda d: d["points"].append(dict(d["points"][0])), "duplicate"),
    (lambda d: d.update(extra_key=1), "extra_key"),
    (lambda d: d.update(points=[]), "points"),
])
def test_invalid_profile_names_file_and_key(tmp_path: Path, mutate, needle: str) -> None:
    d = _doc()
    mutate(d)
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(d))
    with pytest.raises(ProfileError) as e:
        load_profile(f)
    assert str(f) in str(e.value) and needle in str(e.value)


def test_unreadable_and_non_json_files(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "nope.json")
    f = tmp_path / "x.json"
    f.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(f)
    f.write_text("[1, 2]")
    with pytest.raises(ProfileError, match="JSON object"):
        load_profile(f)
    with pytest.raises(ProfileError, match="<mem>"):
        profile_from_dict({}, origin="<mem>")


def test_two_files_for_one_model_are_refused(tmp_path: Path) -> None:
    save_profile(_prof(), tmp_path / "a.json")
    save_profile(_prof(), tmp_path / "b.json")
    with pytest.raises(ProfileError, match="already profiled"):
        load_profiles([tmp_path])


def test_paper_profiles_are_labelled_and_cite_the_paper() -> None:
    ps = paper_profiles()
    assert set(ps) == set(PAPER_MODELS)
    for name, p in ps.items():
        assert p.model == name and p.source == "paper"
        assert "Fig." in p.source_note or "Table" in p.source_note
        # latency never rises with more GPU% and never falls with a bigger batch
        for b in p.batch_sizes:
            lats = [p.latency_ms(b, g) for g in p.gpu_pcts]
            assert lats == sorted(lats, reverse=True)
        for g in p.gpu_pcts:
            lats = [p.latency_ms(b, g) for b in p.batch_sizes]
            assert lats == sorted(lats)
    # Table I anchors (batch 8, 100% GPU, GPU-DMA column)
    assert ps["resnet50"].latency_ms(8, 100) == pytest.approx(9.76, abs=0.01)
    assert ps["vgg19"].latency_ms(8, 100) == pytest.approx(30.49, abs=0.01)
    with pytest.raises(ValueError, match="no paper profile"):
        paper_profile("bert")


# --- per-device entries (format version 2) ----------------------------------------------------------


def test_version1_files_still_load_and_take_their_device_from_the_backend(tmp_path: Path) -> None:
    doc = _prof().model_dump(mode="json")
    doc["format_version"] = 1
    f = tmp_path / "old.json"
    f.write_text(json.dumps(doc))
    old = load_profile(f)
    assert old.format_version == 1 and old.stages == () and old.device_kind is None
    assert old.kind == ("accelerator" if old.backend == "cuda" else "cpu")
    assert paper_profile("resnet50").kind == "accelerator"  # the bundled v1 paper profiles
    bad = dict(doc, device_kind="cpu")
    with pytest.raises(ProfileError, match="format_version 2"):
        profile_from_dict(bad)


def test_stages_carry_a_latency_per_device_and_round_trip(tmp_path: Path) -> None:
    from gpuprims.coexec.graph import CPU, GPU
    from gpuprims.profile import merge_stage_latencies, with_stages

    stages = [{"name": "a", "latency_ms": {"cpu": 2.0}, "out_mb": 1.0},
              {"name": "b", "deps": ["a"], "latency_ms": {"cpu": 5.0}, "mem_mb": 3.0}]
    cpu = with_stages(_prof(), stages, device_kind="cpu", cpu_cores=2)
    assert cpu.format_version == 2 and cpu.kind == "cpu" and cpu.cpu_cores == 2
    back = load_profile(save_profile(cpu, tmp_path / "cpu.json"))
    assert back == cpu
    gpu = with_stages(_prof(), [{"name": "a", "latency_ms": {"gpu": 0.5}}, {"name": "b", "latency_ms": {"gpu": 1.0}}],
                      device_kind="accelerator")
    both = merge_stage_latencies(cpu, gpu)
    assert both.stage_latency_ms("b", "gpu") == 1.0 and both.stage_latency_ms("b", "cpu") == 5.0
    g = both.task_graph()
    assert g.task("b").deps == ("a",) and g.task("b").latency_ms == {CPU: 5.0, GPU: 1.0} and g.task("a").out_mb == 1.0
    with pytest.raises(ValueError, match="no stage 'zz'"):
        both.stage_latency_ms("zz", "cpu")
    with pytest.raises(ValueError, match="no stages"):
        _prof().task_graph()
    with pytest.raises(ValueError, match="stages differ"):
        merge_stage_latencies(cpu, with_stages(_prof(), [{"name": "a", "latency_ms": {"gpu": 1.0}}]))


@pytest.mark.parametrize(("stages", "needle"), [
    ([{"name": "a", "latency_ms": {"cpu": 1.0}}, {"name": "a", "latency_ms": {"cpu": 1.0}}], "duplicate stage"),
    ([{"name": "a", "deps": ["x"], "latency_ms": {"cpu": 1.0}}], "unknown stages"),
    ([{"name": "a", "latency_ms": {"tpu": 1.0}}], "stages.0.latency_ms"),
    ([{"name": "a", "latency_ms": {}}], "stages.0.latency_ms"),
    ([{"name": "a", "latency_ms": {"cpu": -1.0}}], "finite and >= 0"),
])
def test_bad_stages_are_refused_with_the_key(stages: list, needle: str) -> None:
    doc = _prof().model_dump(mode="json") | {"format_version": 2, "stages": stages}
    with pytest.raises(ProfileError, match=needle):
        profile_from_dict(doc)
