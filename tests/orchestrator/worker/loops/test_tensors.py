"""An instance serving a model file (named tensors, any shapes) against a real pool and ingest, in this process.

Every answer is compared with the file run directly in ONNX Runtime; every request id is answered once.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gpuprims import wire
from gpuprims.ingest import Ingest, packet_balance
from gpuprims.modelrepo import load_config
from gpuprims.pool import PacketPool
from gpuprims.tensors import DataType, ModelSignature, TensorSpec
from gpuprims.tensorwire import WireTensor, decode_arrays, encode, encode_arrays
from gpuprims.wire import DType, Status
from orchestrator.control.messages import RunBatch
from orchestrator.control.records import EngineSpec
from orchestrator.worker.file_runner import FileRunner, zero_request
from orchestrator.worker.instance import Instance, InstanceSpec
from orchestrator.worker.loops import serving_loop
from orchestrator.worker.loops.tensors import TensorLoop, raw_input
from tests.modelfiles import multi_inputs, repository, run_onnx

MULTI, DETECTOR = 1, 2


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return repository(tmp_path_factory.mktemp("repo"))


def _spec(repo: Path, name: str, app_id: int, pool: PacketPool, consumer: int, max_batch: int) -> InstanceSpec:
    cfg = load_config(repo / name)
    path = repo / name / "1" / "model.onnx"
    return InstanceSpec(name=f"{name}-0", app=name, app_id=app_id, model=str(path), pool=pool.name, consumer=consumer,
                        slo_ms=5000.0, max_batch=max_batch, max_wait_ms=0.0, warmup=True,
                        engine=EngineSpec("onnxruntime", {"provider": "cpu"}), model_config=cfg.to_json(), model_path=str(path),
                        model_version=1)


@pytest.fixture
def node(repo: Path) -> Iterator[tuple[dict[int, Instance], Ingest, socket.socket]]:
    pool = PacketPool.create(slot_count=2048, record_count=128, max_chunks=64, consumer_count=2)
    ing = Ingest(pool, [("127.0.0.1", 0)]).start()
    ing.set_route(MULTI, [0])
    ing.set_route(DETECTOR, [1])
    insts = {MULTI: Instance(_spec(repo, "multi", MULTI, pool, 0, 8), control=None),
             DETECTOR: Instance(_spec(repo, "detector", DETECTOR, pool, 1, 1), control=None)}
    for inst in insts.values():
        inst.init_compute(100)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    yield insts, ing, sock
    sock.close()
    for inst in insts.values():
        inst.close()
    ing.stop()
    pool.close()


def _send(ing: Ingest, sock: socket.socket, app: int, rid: int, body: bytes, dtype: DType = DType.TENSORS) -> None:
    for d in wire.encode_request(app, rid, body, dtype=int(dtype)):
        sock.sendto(d, ("127.0.0.1", ing.ports[0]))


def _serve(insts: dict[int, Instance], sock: socket.socket, n: int) -> dict[int, wire.Response]:
    """Step every instance until n responses arrived, each request id once (a second answer fails)."""
    asm, got = wire.ResponseAssembler(), {}
    sock.settimeout(0.01)
    deadline = time.monotonic() + 60
    while len(got) < n and time.monotonic() < deadline:
        for inst in insts.values():
            inst.step(max_wait_ms=5)
        try:
            r = asm.feed(sock.recv(65536))
        except TimeoutError:
            continue
        if r is not None:
            assert r.request_id not in got, f"request {r.request_id} answered twice"
            got[r.request_id] = r
    assert len(got) == n, f"{len(got)} of {n} answered"
    return got


def test_requests_of_many_shapes_are_answered_as_the_file_answers(node, repo: Path) -> None:
    insts, ing, sock = node
    want: dict[int, dict[str, np.ndarray]] = {}
    rid = 0
    for width in (1, 5, 5, 7, 5, 2):  # several widths in flight: each batch holds one width only
        x = multi_inputs(1, width, seed=rid)
        row = {k: v[0] for k, v in x.items()}
        want[rid] = {k: v[0] for k, v in run_onnx(repo / "multi" / "1" / "model.onnx", x).items()}
        _send(ing, sock, MULTI, rid, encode_arrays(row))
        rid += 1
    got = _serve(insts, sock, rid)
    for i, r in got.items():
        assert r.status == Status.OK and r.dtype == DType.TENSORS
        out = decode_arrays(r.body)
        assert set(out) == {"mean out", "half", "is pos", "k twice"}
        for name, arr in want[i].items():
            assert out[name].dtype == arr.dtype and out[name].shape == arr.shape, name
            np.testing.assert_allclose(out[name].astype(np.float64), arr.astype(np.float64), rtol=1e-5, atol=1e-5)
    sizes = insts[MULTI].stats.batch_sizes
    assert sum(b * c for b, c in sizes.items()) == rid  # every request ran once, in batches of one width


def test_a_model_without_batching_answers_outputs_whose_size_follows_the_input(node, repo: Path) -> None:
    insts, ing, sock = node
    scores = [np.array([0.1, 0.9, 0.7], np.float32), np.zeros(5, np.float32), np.linspace(0, 1, 11, dtype=np.float32)]
    for i, s in enumerate(scores):
        _send(ing, sock, DETECTOR, i, encode_arrays({"scores": s}))
    got = _serve(insts, sock, len(scores))
    for i, s in enumerate(scores):
        out = decode_arrays(got[i].body)
        np.testing.assert_array_equal(out["idx"], run_onnx(repo / "detector" / "1" / "model.onnx", {"scores": s})["idx"])
    assert set(insts[DETECTOR].stats.batch_sizes) == {1}  # never batched


def test_bodies_that_do_not_fit_the_model_are_refused_and_the_rest_served(node, repo: Path) -> None:
    insts, ing, sock = node
    good = {k: v[0] for k, v in multi_inputs(1, 3).items()}
    bad = {
        0: encode_arrays({**good, "flag": good["flag"].astype(np.uint8)}),  # a datatype the model does not take
        1: encode_arrays({k: v for k, v in good.items() if k != "scale.k"}),  # a missing input
        2: encode_arrays({**good, "extra": np.zeros(1, np.float32)}),  # an unknown input
        3: encode_arrays({**good, "image in": np.zeros((4, 3), np.float32)}),  # a fixed dimension wrong
        4: b"GPTB not a tensor body at all",  # does not decode
        # a name given twice (patched in: the encoder refuses to write it)
        5: encode([WireTensor("image in", DataType.FP32, good["image in"]),
                   WireTensor("image_in", DataType.FP32, good["image in"])]).replace(b"image_in", b"image in"),
    }
    for rid, body in bad.items():
        _send(ing, sock, MULTI, rid, body)
    _send(ing, sock, MULTI, 99, encode_arrays(good))
    _send(ing, sock, MULTI, 98, good["image in"].tobytes(), DType.FLOAT32)  # raw: the model has three inputs
    got = _serve(insts, sock, len(bad) + 2)
    assert got[99].status == Status.OK
    assert all(got[r].status == Status.BAD_REQUEST for r in [*bad, 98])
    assert insts[MULTI].stats.counts["error"] == len(bad) + 1
    c = ing.counters()
    assert packet_balance(c) == 0


def test_raw_v1_bodies_are_taken_for_a_model_with_one_fixed_input() -> None:
    sig = ModelSignature((TensorSpec("x", DataType.FP16, (2, 3)),), (TensorSpec("y", DataType.FP32, (1,)),), 4)
    assert raw_input(sig) == sig.inputs[0]
    dyn = ModelSignature((TensorSpec("x", DataType.FP16, (2, -1)),), (TensorSpec("y", DataType.FP32, (1,)),), 4)
    assert raw_input(dyn) is None
    zeros = zero_request(dyn)
    assert zeros["x"].shape == (2, 1) and zeros["x"].dtype == np.float16


def test_the_runner_warms_up_every_batch_size_and_describes_its_file(node) -> None:
    insts, _, _ = node
    inst = insts[MULTI]
    assert isinstance(inst.runner, FileRunner) and isinstance(inst.serving, TensorLoop)
    assert inst.runner.warm_sizes() == [1, 4, 8]
    assert all(inst.policy.model.samples(b) >= 1 for b in (1, 4, 8))
    d = inst.runner.describe()
    assert d["model_path"].endswith("multi/1/model.onnx") and d["model_version"] == 1


def test_outputs_that_do_not_split_into_the_batch_fail_that_batch_only(node, repo: Path) -> None:
    insts, ing, sock = node
    inst = insts[MULTI]
    engine_run = inst.runner.model
    inst.runner.model = lambda x, outputs=None: {k: v[:1] for k, v in engine_run(x).items()}  # one row, whatever the batch
    x = {k: v[0] for k, v in multi_inputs(1, 4).items()}
    try:
        for rid in range(3):
            _send(ing, sock, MULTI, rid, encode_arrays(x))
        deadline = time.monotonic() + 30
        while len(inst.queue) < 3:  # (so the three run as one batch of 3, whose outputs have 1 row)
            assert time.monotonic() < deadline, "the three requests never reached the instance"
            inst._pull(50)
        got = _serve(insts, sock, 3)
    finally:
        inst.runner.model = engine_run
    assert {r.status for r in got.values()} == {Status.INTERNAL}
    _send(ing, sock, MULTI, 10, encode_arrays(x))
    assert _serve(insts, sock, 1)[10].status == Status.OK  # the instance serves on


def test_a_model_file_is_not_served_in_dispatched_mode_nor_through_a_zoo_runner(node) -> None:
    insts, _, _ = node
    inst = insts[MULTI]
    with pytest.raises(ValueError, match="a model file is not served in dispatched mode"):
        inst.serving.run_batch(RunBatch(instance=inst.spec.name, id=0, stage="main", batch=1))
    zoo = InstanceSpec(name="z-0", app="z", app_id=9, model="mobilenet_v2", pool=inst.spec.pool, consumer=0)
    with pytest.raises(TypeError, match="a zoo model is served through an AppRunner, got a FileRunner"):
        serving_loop(zoo, inst.pool, inst.runner)

