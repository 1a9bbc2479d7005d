"""bench/e2e: the model runner its model-alone references use is the node's own engine when one is asked."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench import e2e


@pytest.mark.slow
def test_load_runner_eager_is_the_zoo_module_and_the_engine_matches_it(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    import torch

    eager = e2e.load_runner("mobilenet_v2", "eager", 1)
    assert isinstance(eager, torch.nn.Module) and not eager.training
    engine = e2e.load_runner("mobilenet_v2", "onnxruntime", 1, cache=str(tmp_path))
    assert engine.describe()["kind"] == "onnxruntime"
    x = torch.from_numpy(np.random.default_rng(0).random((2, *e2e.SHAPE), dtype=np.float32))
    with torch.inference_mode():
        want, got = eager(x).numpy(), engine(x).float().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
    assert any(tmp_path.iterdir())  # built into the cache it was given, not the user's


@pytest.mark.slow
def test_model_latency_ms_times_the_engine_back_to_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("onnxruntime")
    built: list[str] = []
    real = e2e.load_runner

    def recording(model_name: str, engine: str, threads: int, cache: str | None = None) -> object:
        built.append(engine)
        return real(model_name, engine, threads, cache=str(tmp_path))

    monkeypatch.setattr(e2e, "load_runner", recording)
    ms = e2e.model_latency_ms("mobilenet_v2", "onnxruntime", 1, cores=e2e.share()[0], threads=1, reps=3)
    assert built == ["onnxruntime"] and ms.shape == (3,) and (ms > 0).all()


def _fake_send(capacity: float) -> object:
    def send(rate: float, duration_s: float) -> dict[str, object]:
        return {"slo_attainment": 1.0 if rate <= capacity else 0.5, "p99_ms": 1.0}
    return send


def test_sweep_steps_up_until_two_misses_and_halves_down_when_nothing_held() -> None:
    up = e2e.sweep(_fake_send(150.0), 100.0, 100.0, 10, 0.1, "t")
    assert [s["rate_rps"] for s in up] == [100.0, 120.0, 144.0, 172.8, 207.4]
    assert e2e.best_rate(up) == 144.0
    down = e2e.sweep(_fake_send(30.0), 100.0, 100.0, 10, 0.1, "t")
    assert [s["rate_rps"] for s in down] == [100.0, 120.0, 50.0, 25.0] and e2e.best_rate(down) == 25.0
    never = e2e.sweep(_fake_send(0.0), 100.0, 100.0, 10, 0.1, "t")
    assert len(never) == 2 + e2e.HALVINGS and e2e.best_rate(never) == 0.0  # bounded, and 0 said plainly
