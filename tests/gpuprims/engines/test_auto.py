"""``engine: auto``: builds the candidates, drops those that fail or differ from eager, times the rest,
picks the fastest, caches the decision (a second prepare measures nothing) and says what it picked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpuprims.engines import (
    KINDS,
    EngineCache,
    EngineError,
    EngineUnavailable,
    ModelSource,
    Target,
    make_engine,
)
from gpuprims.engines import auto as auto_mod
from gpuprims.engines.auto import AutoEngine
from gpuprims.engines.eager import EagerEngine
from gpuprims.engines.kinds import EngineKind
from tests.gpuprims.engines.tinynet import SPEC

SRC = ModelSource(SPEC, (3, 16, 16), max_batch=4)


class WrongEngine(EagerEngine):
    """Builds and runs, but its outputs are not eager's."""

    kind = "wrong"
    tolerance = (1e-3, 1e-4)

    def run(self, x: Any) -> Any:
        return super().run(x) + 1.0


class MissingEngine(EagerEngine):
    """Its library is not installed here."""

    kind = "missing"

    def _prepare(self, module: Any, progress: Any) -> None:
        raise EngineUnavailable("engine 'missing' needs the nosuchlib package")


@pytest.fixture
def extra_kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(KINDS, "wrong", EngineKind("wrong", f"{__name__}:WrongEngine", needs_torch=True))
    monkeypatch.setitem(KINDS, "missing", EngineKind("missing", f"{__name__}:MissingEngine", needs_torch=True))
    monkeypatch.setitem(auto_mod.CANDIDATES, "cpu", (("eager", {}), ("onnxruntime", {"provider": "cpu"}),
                                                     ("wrong", {}), ("missing", {}), ("compile", {})))


def test_auto_picks_the_fastest_equal_candidate_and_caches_the_decision(
        extra_kinds: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = SRC.build_module()
    opts = {"candidates": ["eager", "onnxruntime", "wrong", "missing"], "runs": 3}
    eng = make_engine("auto", SRC, Target("cpu", threads=1), opts, cache=EngineCache(tmp_path))
    info = eng.prepare(module)
    d = eng.describe()
    assert not info.cache_hit and d["picked"] in ("eager", "onnxruntime")
    assert set(d["timings_ms"]) == {"eager", "onnxruntime:cpu"}
    best = min(d["timings_ms"], key=lambda k: d["timings_ms"][k]["score_ms"])
    assert d["engine"]["kind"] == best.split(":")[0]
    for t in d["timings_ms"].values():
        assert t["p50_ms_batch1"] > 0 and t["p50_ms_batch4"] > 0
        assert t["score_ms"] == pytest.approx(t["p50_ms_batch1"] + t["p50_ms_batch4"] / 4)
    assert "differs from eager at batch 1" in d["rejected"]["wrong"]
    assert d["rejected"]["missing"] == "engine 'missing' needs the nosuchlib package"
    assert "compile" not in str(d)  # not among the wanted candidates
    x = torch.randn(3, *SRC.input_shape)
    with torch.inference_mode():
        want = module(x)
    rtol, atol = d["tolerance"]
    torch.testing.assert_close(eng.run(x), want, rtol=max(rtol, 1e-6), atol=max(atol, 1e-6))
    eng.close()

    def measured(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a cached decision was measured again")

    monkeypatch.setattr(AutoEngine, "_decide", measured)
    monkeypatch.setattr(AutoEngine, "_time", measured)
    again = make_engine("auto", SRC, Target("cpu", threads=2), opts, cache=EngineCache(tmp_path))
    info2 = again.prepare(module)
    assert info2.cache_hit and again.describe()["picked"] == d["picked"]
    assert again.describe()["timings_ms"] == d["timings_ms"]
    torch.testing.assert_close(again.run(x), want, rtol=max(rtol, 1e-6), atol=max(atol, 1e-6))


def test_auto_keeps_eager_when_nothing_else_qualifies(extra_kinds: None, tmp_path: Path) -> None:
    eng = make_engine("auto", SRC, Target("cpu", threads=1), {"candidates": ["wrong", "missing"], "runs": 1},
                      cache=EngineCache(tmp_path))
    eng.prepare()
    d = eng.describe()
    assert d["picked"] == "eager" and set(d["rejected"]) == {"wrong", "missing"}


@pytest.mark.parametrize(("options", "reason"), [
    ({"candidates": "onnxruntime"}, "candidates must be a non-empty list of engine kinds, got 'onnxruntime'"),
    ({"candidates": []}, "candidates must be a non-empty list"),
    ({"candidates": ["eager", "tvm"]}, r"unknown candidate\(s\) \['tvm'\]"),
    ({"candidates": ["auto"]}, r"unknown candidate\(s\) \['auto'\]"),
    ({"runs": 0}, "runs must be an integer in 1..1000, got 0"),
])
def test_bad_options_are_named(options: dict[str, Any], reason: str) -> None:
    with pytest.raises(EngineError, match=reason):
        AutoEngine.check("cpu", options)


def test_unprepared_run_is_refused(tmp_path: Path) -> None:
    eng = make_engine("auto", SRC, Target("cpu"), cache=EngineCache(tmp_path))
    assert eng.static_input() is None and "picked" not in eng.describe()
    with pytest.raises(EngineError, match="not prepared"):
        eng.run(torch.zeros(1, *SRC.input_shape))


def test_a_cached_pick_that_no_longer_loads_is_measured_again(extra_kinds: None, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    import json

    opts = {"candidates": ["eager"], "runs": 1}
    first = make_engine("auto", SRC, Target("cpu", threads=1), opts, cache=EngineCache(tmp_path))
    manifest = Path(first.prepare().artefact or "") / "manifest.json"
    m = json.loads(manifest.read_text())
    m["meta"]["picked"] = "missing"  # as if the picked engine's library had been uninstalled since
    manifest.write_text(json.dumps(m))
    again = make_engine("auto", SRC, Target("cpu", threads=1), opts, cache=EngineCache(tmp_path))
    with caplog.at_level("WARNING", logger="gpuprims.engines"):
        info = again.prepare()
    assert not info.cache_hit and again.describe()["picked"] == "eager"
    assert "the cached pick does not load (engine 'missing' needs the nosuchlib package)" in caplog.text
    third = make_engine("auto", SRC, Target("cpu", threads=1), opts, cache=EngineCache(tmp_path))
    assert third.prepare().cache_hit and third.describe()["picked"] == "eager"
