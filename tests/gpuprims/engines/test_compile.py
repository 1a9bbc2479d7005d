"""``engine: compile``: batch buckets compiled at prepare so nothing recompiles while serving, outputs
equal to eager, inductor's cache inside the engine cache root, options checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpuprims.engines import EngineCache, EngineError, EngineUnavailable, ModelSource, Target, make_engine
from gpuprims.engines.compile import CompileEngine, buckets_for
from tests.gpuprims.engines.tinynet import SPEC


def _eager(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return module(x)


def test_buckets() -> None:
    assert buckets_for(1) == [1]
    assert buckets_for(4) == [1, 2, 4]
    assert buckets_for(6) == [1, 2, 4, 6]
    assert buckets_for(3, "all") == [1, 2, 3]
    assert buckets_for(5, "max") == [5]


@pytest.mark.parametrize(("options", "reason"), [
    ({"mode": "fast"}, "mode must be one of default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs, "
                       "got 'fast'"),
    ({"buckets": "fib"}, "buckets must be one of pow2, all, max, got 'fib'"),
    ({"backend": "tvm"}, "backend must be one of inductor, aot_eager, got 'tvm'"),
])
def test_bad_options_are_named(options: dict[str, Any], reason: str) -> None:
    with pytest.raises(EngineError, match=reason):
        CompileEngine.check("cpu", options)


def test_cuda_graph_mode_is_refused_on_the_cpu_backend() -> None:
    with pytest.raises(EngineUnavailable, match="'reduce-overhead' is CUDA graphs and needs the cuda backend"):
        CompileEngine.check("cpu", {"mode": "reduce-overhead"})
    CompileEngine.check("cuda", {"mode": "reduce-overhead"})


@pytest.mark.slow  # dynamo traces the model once per bucket: ~50 s on this busy machine
def test_no_recompilation_while_serving(tmp_path: Path) -> None:
    from torch._dynamo.utils import counters

    src = ModelSource(SPEC, (3, 16, 16), max_batch=5)
    module = src.build_module()
    eng = make_engine("compile", src, Target("cpu", threads=1), {"backend": "aot_eager"},
                      cache=EngineCache(tmp_path))
    assert eng.buckets == [1, 2, 4, 5]
    before = counters["stats"]["unique_graphs"]
    info = eng.prepare(module)
    compiled = counters["stats"]["unique_graphs"] - before
    assert compiled == 4 and sorted(info.extra["compile_ms"]) == [1, 2, 4, 5]
    after_prepare = counters["stats"]["unique_graphs"]
    for n in range(1, 6):
        x = torch.randn(n, *src.input_shape)
        y = eng.run(x)
        assert y.shape == (n, 10)
        torch.testing.assert_close(y, _eager(module, x), rtol=eng.tolerance[0], atol=eng.tolerance[1])
    assert counters["stats"]["unique_graphs"] == after_prepare  # every size 1..5 ran in a prepared bucket
    assert [eng.bucket(n) for n in range(1, 6)] == [1, 2, 4, 4, 5]
    with pytest.raises(EngineError, match=r"batch of 6 is outside 1\.\.5"):
        eng.run(torch.zeros(6, *src.input_shape))
    with pytest.raises(EngineError, match=r"input of shape \(3, 8, 8\) per sample"):
        eng.run(torch.zeros(1, 3, 8, 8))
    assert eng.describe()["buckets"] == [1, 2, 4, 5]
    eng.close()
    again = make_engine("compile", src, Target("cpu", threads=1), {"backend": "aot_eager"},
                        cache=EngineCache(tmp_path))
    assert again.prepare(module).cache_hit  # the entry is there; dynamo traces again from inductor's cache


def test_unprepared_run_is_refused(tmp_path: Path) -> None:
    eng = make_engine("compile", ModelSource(SPEC, (3, 16, 16), max_batch=2), Target("cpu"),
                      cache=EngineCache(tmp_path))
    with pytest.raises(EngineError, match="not prepared"):
        eng.run(torch.zeros(1, 3, 16, 16))


@pytest.mark.slow
@pytest.mark.timeout(1200)  # inductor's first compile: minutes on a loaded 2-core machine (docs/engines.md)
def test_inductor_equals_eager_and_caches_in_the_engine_root(tmp_path: Path) -> None:
    src = ModelSource(SPEC, (3, 16, 16), max_batch=2)
    module = src.build_module()
    eng = make_engine("compile", src, Target("cpu", threads=1), {"buckets": "max"}, cache=EngineCache(tmp_path))
    info = eng.prepare(module)  # one bucket (2): batch 1 runs padded
    assert not info.cache_hit and Path(info.artefact or "") == tmp_path / "inductor"
    assert any((tmp_path / "inductor").iterdir())  # inductor wrote its cache under the engine cache root
    for n in (1, 2):
        x = torch.randn(n, *src.input_shape)
        torch.testing.assert_close(eng.run(x), _eager(module, x), rtol=eng.tolerance[0], atol=eng.tolerance[1])
