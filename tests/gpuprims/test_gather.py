"""The gather seam of the serving path (gpuprims.gather): the host method is bit for bit today's
``preprocess(pool.gather(...))``; the cuda methods (GPU-DMA with Sync-lite, CUDA-Copy) produce the same
tensor on the fake CUDA runtime; and a pool filled by the real ingest from UDP on loopback is served
end to end (gather, model, respond) on the fake runtime with the outputs torch gives directly."""

from __future__ import annotations

import ctypes
import math
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from gpuprims import wire
from gpuprims.cuda import runtime
from gpuprims.gather import ModelRunner, make_gatherer, preprocess, torch_device
from gpuprims.ingest import Ingest
from gpuprims.pool import PacketPool
from gpuprims.stats import StageClock
from gpuprims.wire import Status

APP = 3
SHAPE = (3, 8, 10)  # 240 elements: 240 uint8 bytes (one chunk with 100-byte chunks: 3), 960 float32 bytes


class Loopback:
    """A real pool and ingest on 127.0.0.1 with a client socket."""

    def __init__(self) -> None:
        self.pool = PacketPool.create(slot_count=512, record_count=32, max_chunks=64, consumer_count=1)
        self.ingest = Ingest(self.pool, [("127.0.0.1", 0)], timeout_ms=500).start()
        self.ingest.set_route(APP, [0])
        self.addr = ("127.0.0.1", self.ingest.ports[0])
        self.client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.client.bind(("127.0.0.1", 0))
        self.client.settimeout(5.0)

    def send(self, bodies: list[np.ndarray], chunk: int = 100) -> None:
        for rid, body in enumerate(bodies):
            for d in wire.encode_request(APP, rid, body, chunk_payload=chunk):
                self.client.sendto(d, self.addr)

    def take(self, n: int, timeout_s: float = 10.0) -> np.ndarray:
        c = self.pool.consumer(0)
        got: list[int] = []
        deadline = time.monotonic() + timeout_s
        while len(got) < n and time.monotonic() < deadline:
            got += c.poll(64, 100).tolist()
        assert len(got) == n, f"got {len(got)} of {n} requests; ingest counters {self.ingest.counters()}"
        return np.array(got, np.uint32)

    def close(self) -> None:
        self.ingest.stop()
        self.client.close()
        self.pool.close()


@pytest.fixture
def loop() -> Iterator[Loopback]:
    lb = Loopback()
    yield lb
    lb.close()


def _bodies(dtype: str, n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if dtype == "uint8":
        return [rng.integers(0, 256, size=SHAPE, dtype=np.uint8) for _ in range(n)]
    return [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(n)]


def _today(pool: PacketPool, recs: np.ndarray, dtype: str) -> torch.Tensor:
    """What the instance computed before the gather seam: gather into a host tensor, then preprocess."""
    host = torch.empty((recs.size, *SHAPE), dtype=torch.uint8 if dtype == "uint8" else torch.float32)
    pool.gather(recs, host)
    return preprocess(host.to("cpu"), dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == torch.float32 and a.shape == b.shape and a.numpy().tobytes() == b.numpy().tobytes()


@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_host_method_is_bit_identical_to_todays_preprocess(loop: Loopback, dtype: str) -> None:
    loop.send(_bodies(dtype, 5))
    recs = loop.take(5)
    g = make_gatherer("cpu", loop.pool, SHAPE, dtype, 8)
    assert g.method == "host"
    x = g.gather(recs)
    assert _same_bits(x, _today(loop.pool, recs, dtype))
    assert g.statuses.tolist() == [0] * 5
    g.close()


def test_host_gather_reuses_one_batch_buffer_and_its_stage_laps(loop: Loopback) -> None:
    loop.send(_bodies("float32", 5, seed=2))
    recs = loop.take(5)
    g = make_gatherer("cpu", loop.pool, SHAPE, "float32", 8)
    clock = StageClock()
    g.clock = clock
    clock.start()
    first = g.gather(recs)
    ptr = first.data_ptr()
    for sub in (recs[:1], recs[::-1][:3], recs):  # every size is a view of the same buffer: nothing allocated
        x = g.gather(sub)
        assert x.data_ptr() == ptr and x.is_contiguous()
        assert _same_bits(x, _today(loop.pool, sub, "float32"))
        assert g.statuses.tolist() == [0] * sub.size
        assert not g.statuses.flags.writeable  # shared all-OK verdicts: a caller cannot corrupt them
    clock.end()
    got = clock.samples_ms()
    assert got["gather"][0] > 0 and got["preprocess"][0] >= 0 and got["model"][0] == 0
    g.close()


@pytest.mark.parametrize("method", ["gpu_dma", "cuda_copy"])
@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_cuda_methods_match_host_bits_on_fake_runtime(loop: Loopback, fake_cuda: object, dtype: str,
                                                      method: str) -> None:
    loop.send(_bodies(dtype, 6, seed=1))
    recs = loop.take(6)
    g = make_gatherer("cuda", loop.pool, SHAPE, dtype, 8, 0, method)
    try:
        for sub in (recs, recs[::-1][:4], recs[2:3]):  # reused buffers, other orders and sizes
            x = g.gather(sub)
            assert _same_bits(x, _today(loop.pool, sub, dtype)), (method, dtype)
            assert g.statuses.tolist() == [0] * sub.size
    finally:
        g.close()
    assert fake_cuda.live("registered") == [] and fake_cuda.live("device") == []  # type: ignore[attr-defined]
    assert fake_cuda.unsafe_frees == []  # type: ignore[attr-defined]


@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_gpu_dma_gathers_into_a_given_out_buffer_on_fake_runtime(loop: Loopback, fake_cuda: object,
                                                                 dtype: str) -> None:
    # An engine's static input: the kernel writes it in place, and the gatherer never frees it.
    loop.send(_bodies(dtype, 5, seed=4))
    recs = loop.take(5)
    mem = runtime.DeviceMemory(8 * math.prod(SHAPE) * 4, 0)  # the engine's buffer (fake device memory)
    out = torch.frombuffer((ctypes.c_char * mem.nbytes).from_address(mem.ptr), dtype=torch.float32).view(8, *SHAPE)
    out.fill_(-1.0)
    g = make_gatherer("cuda", loop.pool, SHAPE, dtype, 8, 0, "gpu_dma", out=out)
    try:
        for sub in (recs, recs[::-1][:2]):
            x = g.gather(sub)
            assert x.data_ptr() == out.data_ptr()
            assert _same_bits(x, _today(loop.pool, sub, dtype)) and _same_bits(out[:sub.size], x)
        assert (out[5:] == -1.0).all()  # rows past the largest batch are untouched
    finally:
        g.close()
    assert fake_cuda.live("registered") == []  # type: ignore[attr-defined]
    # The buffer is its owner's to free: the gatherer did not.
    assert [r.handle for r in fake_cuda.live("device")] == [mem.ptr]  # type: ignore[attr-defined]
    del x, out
    mem.close()


def test_an_out_buffer_that_does_not_fit_is_refused_by_name(loop: Loopback, fake_cuda: object) -> None:
    with pytest.raises(ValueError, match=r"shape \(8, 3, 8, 10\)"):
        make_gatherer("cuda", loop.pool, SHAPE, "float32", 8, 0, "gpu_dma", out=torch.zeros(4, *SHAPE))
    with pytest.raises(ValueError, match="float32"):
        make_gatherer("cuda", loop.pool, SHAPE, "float32", 8, 0, "gpu_dma", out=torch.zeros(8, *SHAPE,
                                                                                             dtype=torch.float16))
    with pytest.raises(ValueError, match="not contiguous"):
        make_gatherer("cuda", loop.pool, SHAPE, "float32", 8, 0, "gpu_dma",
                      out=torch.zeros(8, 3, 10, 8).transpose(2, 3))
    with pytest.raises(ValueError, match="gpu_dma method only"):
        make_gatherer("cuda", loop.pool, SHAPE, "float32", 8, 0, "cuda_copy", out=torch.zeros(8, *SHAPE))
    assert fake_cuda.live("registered") == []  # type: ignore[attr-defined]  # refused before registering


def test_make_gatherer_validates() -> None:
    with pytest.raises(ValueError, match="resolve 'auto' first"):
        make_gatherer("auto", None, SHAPE, "uint8", 8)
    with pytest.raises(ValueError, match="does not run on the cpu backend"):
        make_gatherer("cpu", None, SHAPE, "uint8", 8, method="gpu_dma")
    with pytest.raises(ValueError, match="does not run on the cuda backend"):
        make_gatherer("cuda", None, SHAPE, "uint8", 8, method="host")
    with pytest.raises(ValueError, match="dtype"):
        make_gatherer("cpu", None, SHAPE, "float16", 8)
    with pytest.raises(ValueError, match="max_batch"):
        make_gatherer("cpu", None, SHAPE, "uint8", 513)
    with pytest.raises(ValueError, match="input_shape"):
        make_gatherer("cpu", None, (3, 0), "uint8", 8)
    with PacketPool.create(slot_count=16, record_count=4, consumer_count=1) as pool:
        g = make_gatherer("cpu", pool, SHAPE, "uint8", 4)
        with pytest.raises(ValueError, match=r"1\.\.4 record indices"):
            g.gather(np.arange(5, dtype=np.uint32))


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.fc = torch.nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).mean(dim=(2, 3)))


@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_serving_path_end_to_end_on_fake_runtime(loop: Loopback, fake_cuda: object, dtype: str) -> None:
    """UDP -> real ingest -> pool -> GPU-DMA gather (fake device) -> model (Sync-lite) -> responses;
    every request answered once with what torch computes directly on the same input."""
    bodies = _bodies(dtype, 7, seed=2)
    model = TinyNet().eval().to(torch_device("cuda", 0))
    g = make_gatherer("cuda", loop.pool, SHAPE, dtype, 4, 0)
    runner = ModelRunner("cuda", 0, stream=g.stream, interval_us=50)
    loop.send(bodies)
    recs = loop.take(len(bodies))
    rids = [int(r["request_id"]) for r in loop.pool.requests(recs)]
    try:
        for batch in (recs[:4], recs[4:]):
            info = loop.pool.requests(batch)
            x = g.gather(batch)
            out = runner.run(model, x)
            loop.pool.consumer(0).answer(batch, info, Status.OK, out.float().numpy().reshape(batch.size, -1))
    finally:
        runner.close()
        g.close()
    asm, got = wire.ResponseAssembler(), {}
    while len(got) < len(bodies):
        r = asm.feed(loop.client.recv(65536))
        if r is not None:
            assert r.request_id not in got, "answered twice"
            got[r.request_id] = r
    # The oracle: the same model on the same batch in torch directly (a batch, not one row at a time:
    # torch's kernels may round differently for another batch size).
    with torch.inference_mode():
        for sl in (slice(0, 4), slice(4, None)):
            batch_ids = rids[sl]
            x = preprocess(torch.from_numpy(np.stack([bodies[i] for i in batch_ids])), dtype)
            ref = model(x).numpy()
            for row, rid in enumerate(batch_ids):
                assert got[rid].status == Status.OK
                assert got[rid].array().tobytes() == ref[row].astype(np.float32).tobytes()
    assert fake_cuda.live("registered") == [] and fake_cuda.unsafe_frees == []  # type: ignore[attr-defined]


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["gpu_dma", "cuda_copy"])
@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_cuda_methods_match_host_bits_on_a_gpu(loop: Loopback, dtype: str, method: str) -> None:
    """The same bits as the host method, from the real kernels on a real device."""
    loop.send(_bodies(dtype, 6, seed=3))
    recs = loop.take(6)
    g = make_gatherer("cuda", loop.pool, SHAPE, dtype, 8, 0, method)
    try:
        x = g.gather(recs)
        assert x.is_cuda and _same_bits(x.cpu(), _today(loop.pool, recs, dtype))
        assert g.statuses.tolist() == [0] * 6
        del x
    finally:
        g.close()
