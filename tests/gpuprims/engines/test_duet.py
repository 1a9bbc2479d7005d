"""``engine: duet`` on the cpu backend: the plan (DUET's subgraphs of GoogLeNet placed on the two
"devices", here both this machine's cores), answers equal to eager at batch 1, max/2 and max, what
describe() shows, and bad input refused by name."""

from __future__ import annotations

import threading

import pytest
import torch

from gpuprims.engines import EngineError, ModelSource, Target, check_engine, make_engine
from gpuprims.engines.base import ExportError
from gpuprims.engines.duet import DuetEngine

MAX = 4
SOURCE = ModelSource("tests.gpuprims.engines.nets:googlenet_small", (3, 32, 32), max_batch=MAX)


@pytest.mark.slow
def test_duet_plans_googlenet_and_answers_as_eager() -> None:
    eng = make_engine("duet", SOURCE, Target("cpu"), {"repeats": 1})
    assert isinstance(eng, DuetEngine)
    msgs: list[str] = []
    eng.prepare(progress=lambda m, f: msgs.append(m))
    assert any("subgraph(s) in" in m for m in msgs)
    plan = eng.describe()["plan"]
    assert plan["same_cores"] and plan["accelerator"] == "cpu"
    assert plan["subgraphs"] == len(plan["placement"]) > plan["phases"] > 1
    assert set(plan["placement"].values()) == {"gpu", "cpu"}  # symmetric devices, parallel branches: a split
    assert plan["on_cpu"] == [n for n, d in plan["placement"].items() if d == "cpu"]
    assert plan["planning_ms"] >= 0 and set(plan["baselines_ms"]) == {"gpu", "cpu"}
    module = SOURCE.build_module("cpu")
    rng = torch.Generator().manual_seed(4)
    rtol, atol = DuetEngine.tolerance
    for n in (1, MAX // 2, MAX):
        x = torch.rand((n, *SOURCE.input_shape), generator=rng)
        with torch.inference_mode():
            want = module(x)
        torch.testing.assert_close(eng.run(x), want, rtol=rtol, atol=atol)
    eng.close()
    assert not eng.prepared
    assert not any(t.name.startswith("coexec-cpu") for t in threading.enumerate() if t.is_alive())


def test_duet_refuses_bad_options_batches_and_untraceable_models() -> None:
    for bad in (0, -2, 1.5, True, "3", 10_000):
        with pytest.raises(EngineError, match="option repeats must be an integer"):
            check_engine("duet", "cpu", {"repeats": bad})
    with pytest.raises(EngineError, match="no option"):
        check_engine("duet", "cpu", {"alpha": 1})
    source = ModelSource("tests.gpuprims.engines.nets:googlenet_small", (3, 32, 32), max_batch=1)
    eng = make_engine("duet", source, Target("cpu"), {"repeats": 1})
    with pytest.raises(EngineError, match="not prepared"):
        eng.run(torch.zeros(1, 3, 32, 32))
    eng.prepare()
    for bad in (torch.zeros(2, 3, 32, 32), torch.zeros(1, 3, 16, 16), torch.zeros(3, 32, 32), [[0.0]]):
        with pytest.raises(EngineError, match=r"'duet' takes \(n, 3, 32, 32\) with 1 <= n <= 1"):
            eng.run(bad)
    eng.close()
    odd = make_engine("duet", ModelSource("tests.gpuprims.engines.nets:untraceable", (3, 8, 8), max_batch=2),
                      Target("cpu"), {"repeats": 1})
    with pytest.raises(ExportError, match=r"'duet' cannot partition 'tests.gpuprims.engines.nets:untraceable'"):
        odd.prepare()
