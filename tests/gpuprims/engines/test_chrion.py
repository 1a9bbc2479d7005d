"""``engine: chrion`` on the cpu backend: Chrion's plan of the zoo's unrolled LSTM within the app's share
of cores, answers equal to eager, what describe() shows, and bad input refused by name."""

from __future__ import annotations

import threading

import pytest
import torch

from gpuprims.engines import EngineError, ModelSource, Target, check_engine, make_engine
from gpuprims.engines.base import ExportError
from gpuprims.engines.chrion import ChrionEngine

MAX = 4
SOURCE = ModelSource("lstm", (1, 5, 16), max_batch=MAX)


@pytest.mark.parametrize(("threads", "options"), [(2, {"repeats": 3}), (None, {"repeats": 3, "alpha": 2.5})])
def test_chrion_plans_the_lstm_and_answers_as_eager(threads: int | None, options: dict[str, object]) -> None:
    eng = make_engine("chrion", SOURCE, Target("cpu", threads=threads), options)
    assert isinstance(eng, ChrionEngine)
    eng.prepare()
    plan = eng.describe()["plan"]
    layers = len(SOURCE.build_module("cpu").cells)
    assert plan["cells"] == layers * 5 and plan["on_cpu"] + plan["on_accelerator"] == layers * 5 + 1  # + head
    assert plan["cores_allowed"] == (threads or 1) and 0 <= plan["cores"] <= plan["cores_allowed"]
    assert len(plan["slowdown"]) == plan["cores_allowed"] and plan["same_cores"]
    assert plan["alpha"] == options.get("alpha", 0.0) and plan["estimated_ms"] > 0
    module = SOURCE.build_module("cpu")
    rng = torch.Generator().manual_seed(6)
    rtol, atol = ChrionEngine.tolerance
    for n in (1, MAX // 2, MAX):
        x = torch.rand((n, *SOURCE.input_shape), generator=rng)
        with torch.inference_mode():
            want = module(x)
        torch.testing.assert_close(eng.run(x), want, rtol=rtol, atol=atol)
    eng.close()
    assert not eng.prepared
    assert not any(t.name.startswith("coexec-core") for t in threading.enumerate() if t.is_alive())


def test_chrion_refuses_bad_options_shares_batches_and_models() -> None:
    for key, bad in (("cores", 0), ("cores", 1.5), ("cores", True), ("alpha", -1.0), ("alpha", float("nan")),
                     ("alpha", "1"), ("repeats", 0)):
        with pytest.raises(EngineError, match=f"option {key} must be"):
            check_engine("chrion", "cpu", {key: bad})
    over = make_engine("chrion", SOURCE, Target("cpu", threads=1), {"cores": 2, "repeats": 1})
    with pytest.raises(EngineError, match=r"cores=2 exceeds the app's share of 1 CPU thread"):
        over.prepare()
    eng = make_engine("chrion", SOURCE, Target("cpu"), {"repeats": 1})
    with pytest.raises(EngineError, match="not prepared"):
        eng.run(torch.zeros(1, 1, 5, 16))
    eng.prepare()
    with pytest.raises(EngineError, match=r"'chrion' takes \(n, 1, 5, 16\)"):
        eng.run(torch.zeros(1, 1, 6, 16))
    eng.close()
    cnn = make_engine("chrion", ModelSource("tests.gpuprims.engines.nets:tiny", (3, 8, 8), max_batch=2),
                      Target("cpu"), {"repeats": 1})
    with pytest.raises(ExportError, match=r"'chrion' places the cells of an unrolled LSTM.*'tests.gpuprims"):
        cnn.prepare()
