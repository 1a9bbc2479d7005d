"""A model file's runner: config.pbtxt's ``model_warmup`` samples are made as Triton makes them (zero_data,
random_data, input_data_file of the model's ``warmup/`` directory, repeated to batch_size) and run count
times on the engine before the model serves; a sample that cannot be read or run fails the instance's start
with the reason (orchestrator/worker/file_runner.py). On a real node that reason makes the model UNAVAILABLE."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpuprims.client import Client
from gpuprims.modelrepo import load_config
from orchestrator.config.schema import load_config as load_node_config
from orchestrator.control.records import EngineSpec
from orchestrator.control.spec import InstanceSpec
from orchestrator.node.node import Node
from orchestrator.worker.file_runner import FileRunner, WarmupError, warmup_dir

from ...modelfiles import DETECTOR_CONFIG, MULTI_CONFIG, detector_onnx, multi_io_onnx, run_onnx

WARMUP = """
model_warmup [
  {{ name: "zeros" batch_size: 2 count: 3
     inputs {{ key: "image in" value {{ data_type: TYPE_FP32 dims: [3, 4] zero_data: true }} }}
     inputs {{ key: "scale.k" value {{ data_type: TYPE_INT64 dims: [1] random_data: true }} }}
     inputs {{ key: "flag" value {{ data_type: TYPE_BOOL dims: [1] input_data_file: "{flag}" }} }} }}
]
"""


class Recording:
    """An engine stand-in that keeps every batch it is asked to run."""

    def __init__(self) -> None:
        self.runs: list[dict[str, np.ndarray]] = []

    def run(self, x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.runs.append(x)
        return {}


def _runner(tmp_path: Path, flag: bytes | None) -> FileRunner:
    model = multi_io_onnx(tmp_path / "multi" / "1" / "model.onnx")
    (tmp_path / "multi" / "config.pbtxt").write_text(MULTI_CONFIG.format(name="multi") + WARMUP.format(flag="flag.bin"))
    if flag is not None:
        (tmp_path / "multi" / "warmup").mkdir()
        (tmp_path / "multi" / "warmup" / "flag.bin").write_bytes(flag)
    cfg = load_config(tmp_path / "multi", torch_ok=False)
    spec = InstanceSpec(name="multi-0", app="multi", app_id=1, model=str(model), pool="p", consumer=0,
                        engine=EngineSpec("onnxruntime"), model_config=cfg.to_json(), model_path=str(model))
    return FileRunner(spec)


def test_the_warmup_directory_is_beside_the_version_directory(tmp_path: Path) -> None:
    assert warmup_dir(str(tmp_path / "m" / "3" / "model.onnx")) == tmp_path / "m" / "warmup"
    assert warmup_dir(str(tmp_path / "m" / "3" / "model.onnx" / "model.onnx")) == tmp_path / "m" / "warmup"
    assert warmup_dir(str(tmp_path / "models" / "m.onnx")) == tmp_path / "models" / "warmup"


def test_the_samples_are_made_as_triton_makes_them_and_run_count_times(tmp_path: Path) -> None:
    runner = _runner(tmp_path, b"\x01")
    [(w, x)] = runner.warmup_requests()
    assert (w.name, w.batch_size, w.count) == ("zeros", 2, 3)
    assert x["image in"].shape == (2, 3, 4) and not x["image in"].any() and x["image in"].dtype == np.float32
    assert x["scale.k"].shape == (2, 1) and x["scale.k"].dtype == np.int64
    assert x["flag"].tolist() == [[True], [True]]  # the file's one byte, repeated to the batch
    engine = Recording()
    runner.engine = engine  # type: ignore[assignment]
    runner.model_warmup()
    assert len(engine.runs) == 3
    runner.model_warmup()  # once per installed engine
    assert len(engine.runs) == 3
    # The real engine runs the samples, and answers them as the file run in onnxruntime does.
    real = _runner(tmp_path / "real", b"\x00")
    real.install(real.build("cpu"))
    assert not real.samples_run
    real.model_warmup()
    assert real.samples_run and real.engine is not None
    [(_, x)] = real.warmup_requests()
    got = real.engine.run(x)
    want = run_onnx(Path(real.spec.model_path or ""), x)
    assert set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize(("flag", "match"), [
    (None, r"model_warmup 'zeros': input 'flag': input_data_file .*flag\.bin cannot be read"),
    (b"\x01\x00", r"model_warmup 'zeros': input 'flag': input_data_file .*flag\.bin holds 2 bytes; dims \[1\] "
                  r"of BOOL take 1"),
])
def test_a_sample_that_cannot_be_read_fails_naming_the_file(tmp_path: Path, flag: bytes | None, match: str) -> None:
    runner = _runner(tmp_path, flag)
    runner.engine = Recording()  # type: ignore[assignment]
    with pytest.raises(WarmupError, match=match):
        runner.model_warmup()


def test_a_sample_the_engine_refuses_fails_naming_the_sample(tmp_path: Path) -> None:
    runner = _runner(tmp_path, b"\x01")

    class Refusing(Recording):
        def run(self, x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            raise RuntimeError("bad input\nmore")

    runner.engine = Refusing()  # type: ignore[assignment]
    with pytest.raises(WarmupError, match=r"model_warmup 'zeros' failed in the engine: RuntimeError: bad input$"):
        runner.model_warmup()


NODE = """
node:
  listen: {{host: 127.0.0.1, port: 0}}
  backend: cpu
  run_dir: {run_dir}
  autoscale: false
  model_repository: repo
apps: []
"""
DET_WARMUP = """
model_warmup [ { name: "file" inputs { key: "scores" value { data_type: TYPE_FP32 dims: [3] input_data_file: "s.bin" } } } ]
parameters { key: "gpu_pct" value { string_value: "40" } }
"""


@pytest.mark.slow
def test_a_bad_warmup_file_makes_the_model_unavailable_with_the_reason(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for name, data in (("good", np.array([0.9, 0.1, 0.7], np.float32).tobytes()), ("bad", b"\x00" * 5)):
        detector_onnx(repo / name / "1" / "model.onnx")
        (repo / name / "config.pbtxt").write_text(DETECTOR_CONFIG.format(name=name) + DET_WARMUP)
        (repo / name / "warmup").mkdir()
        (repo / name / "warmup" / "s.bin").write_bytes(data)
    p = tmp_path / "apps.yaml"
    p.write_text(NODE.format(run_dir=tmp_path / "run"))
    node = Node(load_node_config(p), warmup=False, heartbeat_ms=100).start()
    try:
        assert list(node.apps) == ["good"]
        [u] = node.unavailable
        assert u.name == "bad" and "model_warmup 'file'" in u.reason and "holds 5 bytes" in u.reason, u.reason
        assert node.ingest is not None
        with Client(("127.0.0.1", node.ingest.ports[0]), timeout_s=30.0) as c:  # the other model serves
            fut = c.submit(node.apps["good"].cfg.app_id, {"scores": np.array([0.9, 0.1], np.float32)})
            deadline = time.monotonic() + 60
            while not fut.done() and time.monotonic() < deadline:
                node.step(20)
            r: Any = fut.result(timeout=1)
            assert r.outputs["idx"].tolist() == [0]
    finally:
        node.stop()
