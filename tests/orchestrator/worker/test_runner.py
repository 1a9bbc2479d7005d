"""The model runner: the app's engine made, prepared (built or from the cache) and run, in this process."""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from apps.zoo import load_model
from gpuprims.batching import LatencyModel
from orchestrator.control.records import EngineSpec, StageSpec
from orchestrator.control.share_spec import ERROR_SUFFIX
from orchestrator.control.spec import InstanceSpec
from orchestrator.worker.zoo_runner import AppRunner, DagModel, await_handles

SHAPE = (3, 32, 32)
UNEXPORTABLE = '''
import torch


class Spectral(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3 * 32 * 32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.fft.fft(x.flatten(1)).real)  # no ONNX symbolic for aten::fft_fft


def build(num_classes: int = 10, input_shape: tuple = (3, 32, 32)) -> torch.nn.Module:
    torch.manual_seed(0)
    return Spectral().eval()
'''


def _spec(tmp_path: Path, **kw: Any) -> InstanceSpec:
    base: dict[str, Any] = {"name": "t-0", "app": "t", "app_id": 1, "model": "mobilenet_v2", "pool": "unused",
                            "consumer": 0, "input_shape": SHAPE, "num_classes": 10, "max_batch": 4,
                            "engine_cache": str(tmp_path / "cache")}
    base.update(kw)
    return InstanceSpec(**base)


def _ready(spec: InstanceSpec) -> AppRunner:
    runner = AppRunner(spec)
    runner.init_device(100)
    runner.install(runner.build(runner.device))
    return runner


def _batch(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, *SHAPE, generator=torch.Generator().manual_seed(seed))


def _eager(model: str = "mobilenet_v2") -> torch.nn.Module:
    return load_model(model, seed=0, num_classes=10, input_shape=SHAPE).eval()


def test_eager_is_the_default_and_runs_on_torch_weights(tmp_path: Path) -> None:
    runner = _ready(_spec(tmp_path))
    try:
        d = runner.describe()
        assert d["kind"] == "eager" and d["param_share"] is True and "fallback" not in d
        assert runner.params_mode == "own"
        x = _batch(3)
        with torch.inference_mode():
            assert torch.equal(runner.model(x), _eager()(x))
    finally:
        runner.close()


@pytest.mark.slow
def test_onnxruntime_engine_equals_eager_is_cached_and_holds_its_own_weights(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime", reason="the onnx extra is not installed")
    spec = _spec(tmp_path, engine=EngineSpec("onnxruntime"), threads=1, share_params=None)
    first = _ready(spec)
    try:
        d = first.describe()
        assert d["kind"] == "onnxruntime" and d["cache_hit"] is False and d["build_ms"] > 0
        assert d["threads"] == 1 and d["param_share"] is False and first.params_mode == "engine"
        rtol, atol = d["tolerance"]
        ref = _eager()
        for n in (1, 2, 4):  # batch 1, max_batch/2, max_batch
            x = _batch(n, seed=n)
            with torch.inference_mode():
                torch.testing.assert_close(first.model(x), ref(x), rtol=rtol, atol=atol)
        latency = LatencyModel()
        first.warm_up(latency)  # the engine seeds the batching policy
        assert latency.known
    finally:
        first.close()
    again = _ready(spec)  # a restart, a change of share: nothing is built
    try:
        d2 = again.describe()
        assert d2["cache_hit"] is True and d2["build_ms"] == 0 and d2["fingerprint"] == d["fingerprint"]
    finally:
        again.close()


@pytest.mark.slow
def test_an_engine_prepared_before_the_share_is_made_again_for_it_from_the_cache(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime", reason="the onnx extra is not installed")
    runner = AppRunner(_spec(tmp_path, engine=EngineSpec("onnxruntime")))
    built = runner.build(torch.device("cpu"))  # a shadow's pre-warm: its share is not known yet
    assert built["engines"]["main"].describe()["cache_hit"] is False
    runner.spec.cores, runner.spec.threads = [0], 1  # InitGpu brings the share
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        runner.init_device(50)  # confines this (the test's) process, as it does an instance
        runner.install(built)
        d = runner.describe()
        assert d["threads"] == 1 and d["cache_hit"] is True and d["build_ms"] == 0
        assert runner.model is runner.engines["main"]
    finally:
        runner.close()
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)


def test_a_model_the_engine_cannot_take_is_served_by_eager_after_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("onnxruntime", reason="the onnx extra is not installed")
    (tmp_path / "spectral_model.py").write_text(UNEXPORTABLE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "spectral_model", raising=False)
    caplog.set_level(logging.ERROR, logger="gpuprims.instance")
    runner = _ready(_spec(tmp_path, app="spec", model="spectral_model:build", engine=EngineSpec("onnxruntime")))
    try:
        d = runner.describe()
        assert d["kind"] == "eager" and "does not export to ONNX" in d["fallback"]
        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(lines) == 1 and "\n" not in lines[0]
        assert "app spec: engine onnxruntime cannot serve model spectral_model:build" in lines[0]
        assert "serving it with eager instead" in lines[0]
        out = runner.model(_batch(2))
        assert out.shape == (2, 10)
    finally:
        runner.close()


@pytest.mark.slow
def test_a_dag_app_has_one_engine_per_stage(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime", reason="the onnx extra is not installed")
    stages = (StageSpec("r", "mobilenet_v2", ("x",), EngineSpec("onnxruntime")), StageSpec("x", "resnet18"))
    runner = _ready(_spec(tmp_path, model="", stages=stages, entry="r", threads=1))
    try:
        d = runner.describe()["stages"]
        assert d["r"]["kind"] == "onnxruntime" and d["x"]["kind"] == "eager"
        assert isinstance(runner.model, DagModel) and runner.stage_model("r") is runner.engines["r"]
        groups = runner.model(_batch(4))
        assert sum(len(rows) for rows, _ in groups) == 4
    finally:
        runner.close()


def test_an_importer_waits_for_the_handles_its_holder_writes(tmp_path: Path) -> None:
    path = tmp_path / "params-0.bin"

    def holder() -> None:  # writes atomically, as a holder does, while the importer waits (or before)
        tmp = tmp_path / "params-0.bin.tmp"
        tmp.write_bytes(b"handles")
        os.replace(tmp, path)

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert await_handles(str(path), timeout_s=60) == b"handles"
    finally:
        t.join()


def test_an_importer_fails_with_its_holders_reason_or_after_its_deadline(tmp_path: Path) -> None:
    path = tmp_path / "params-0.bin"
    with pytest.raises(TimeoutError, match=r"params-0\.bin"):
        await_handles(str(path), timeout_s=0.05)
    (tmp_path / ("params-0.bin" + ERROR_SUFFIX)).write_text("RuntimeError: out of memory")
    with pytest.raises(RuntimeError, match=r"holder of the shared weights .* failed: RuntimeError: out of memory"):
        await_handles(str(path), timeout_s=60)
