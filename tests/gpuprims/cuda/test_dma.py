from __future__ import annotations

import random
import socket
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuprims import _native, wire
from gpuprims.backend import cuda_available
from gpuprims.cuda import (
    DmaStatus,
    Normalize,
    Packets,
    PinnedPool,
    PoolLayout,
    cuda_copy_gather,
    gpu_dma,
    gpu_dma_async,
)
from gpuprims.cuda import dma as dma_mod
from gpuprims.testing.synthetic import RECORD_DTYPE, STATE_FILLING, SyntheticPool

APP = 7


def make_pool(bodies: list[np.ndarray], *, chunk_payload: int | None = None, max_payload: int = 1024,
              seed: int = 0) -> tuple[SyntheticPool, list[int]]:
    sp = SyntheticPool(slot_count=4096, max_payload=max_payload, record_count=64, max_chunks=1024, seed=seed)
    recs = [sp.add_request(APP, 1000 + i, b, chunk_payload=chunk_payload) for i, b in enumerate(bodies)]
    return sp, recs


def images(n: int, shape: tuple[int, ...] = (20, 17, 3), dtype: type = np.uint8, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if dtype == np.uint8:
        return [rng.integers(0, 256, size=shape, dtype=np.uint8) for _ in range(n)]
    return [rng.standard_normal(shape).astype(dtype) for _ in range(n)]


def normalized(body: np.ndarray, norm: Normalize) -> np.ndarray:
    """The numpy oracle of the fused gather (float32 arithmetic, three roundings)."""
    a, b, d = norm.coefficients
    c = len(norm.mean)
    flat = body.reshape(-1).astype(np.float32)
    ch = np.arange(flat.size) % c
    y = (flat * np.array(a, np.float32)[ch] + np.array(b, np.float32)[ch]) / np.array(d, np.float32)[ch]
    return y.reshape(body.shape)


# -- layout -------------------------------------------------------------------------------------------

def test_record_layout_matches_native_and_pool_module() -> None:
    lay = _native.dma_record_layout()
    assert lay.pop("size") == RECORD_DTYPE.itemsize == 128
    for name, (off, size) in lay.items():
        assert RECORD_DTYPE.fields[name][1] == off, name
        assert RECORD_DTYPE.fields[name][0].itemsize == size, name
    from gpuprims.pool import RECORD_DTYPE as POOL_RECORD

    for name in lay:
        assert POOL_RECORD.fields[name][1] == RECORD_DTYPE.fields[name][1], name


def test_constants_match_native() -> None:
    assert dma_mod.MAX_BATCH == _native.DMA_MAX_BATCH
    assert dma_mod._MODE_COPY == _native.DMA_MODE_COPY
    assert dma_mod._MODE_U8_TO_F32 == _native.DMA_MODE_U8_TO_F32


# -- CPU backend: placement -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
def test_shuffled_packets_several_requests_match_oracle(dtype: type) -> None:
    bodies = images(5, dtype=dtype)
    sp, recs = make_pool(bodies, chunk_payload=200)
    with PinnedPool(sp, backend="cpu") as pp:
        order = [3, 0, 4, 1, 2]
        out = np.zeros((5, *bodies[0].shape), dtype=dtype)
        st = np.full(5, -1, np.int32)
        assert gpu_dma(pp.packets([recs[i] for i in order]), 5, out, None, statuses=st) == 5
        assert st.tolist() == [0] * 5
        for row, i in enumerate(order):
            assert out[row].tobytes() == bodies[i].tobytes()


def test_packets_really_are_scattered_and_out_of_order() -> None:
    sp, recs = make_pool(images(2), chunk_payload=100)
    slots = sp.chunkmap[recs[0], :sp.records[recs[0]]["chunk_count"]]
    assert not np.all(np.diff(slots.astype(np.int64)) == 1)


def test_partial_batch_leaves_other_rows_alone() -> None:
    bodies = images(3)
    sp, recs = make_pool(bodies)
    pp = PinnedPool(sp, backend="cpu")
    out = np.full((8, *bodies[0].shape), 0xAB, np.uint8)
    assert gpu_dma(pp.packets(recs), 2, out, None) == 2
    assert out[0].tobytes() == bodies[0].tobytes() and out[1].tobytes() == bodies[1].tobytes()
    assert np.all(out[2:] == 0xAB)
    assert gpu_dma(pp.packets(recs), 0, out, None) == 0


def test_torch_cpu_tensor_destination() -> None:
    bodies = images(2, dtype=np.float32)
    sp, recs = make_pool(bodies)
    out = torch.zeros((2, *bodies[0].shape), dtype=torch.float32)
    assert gpu_dma(PinnedPool(sp, backend="cpu").packets(recs), 2, out, None) == 2
    assert np.array_equal(out.numpy(), np.stack(bodies))


@pytest.mark.parametrize("mean,std", [((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)), ((0.5,), (0.25,))])
def test_fused_uint8_to_float32(mean: tuple[float, ...], std: tuple[float, ...]) -> None:
    bodies = images(3, shape=(13, 11, 3))
    sp, recs = make_pool(bodies, chunk_payload=96)
    norm = Normalize(mean=mean, std=std)
    out = np.zeros((3, 13, 11, 3), np.float32)
    assert gpu_dma(PinnedPool(sp, backend="cpu").packets(recs), 3, out, None, normalize=norm) == 3
    for row in range(3):
        assert out[row].tobytes() == normalized(bodies[row], norm).tobytes()


def test_cuda_copy_gather_cpu_equals_gpu_dma_cpu() -> None:
    bodies = images(4)
    sp, recs = make_pool(bodies, chunk_payload=333)
    pp = PinnedPool(sp, backend="cpu")
    a = np.zeros((4, *bodies[0].shape), np.uint8)
    b = np.zeros_like(a)
    st = np.zeros(4, np.int32)
    assert gpu_dma(pp.packets(recs), 4, a, None) == 4
    assert cuda_copy_gather(pp.packets(recs), 4, b, None, statuses=st) == 4
    assert a.tobytes() == b.tobytes() == np.stack(bodies).tobytes()
    assert st.tolist() == [0, 0, 0, 0]
    assert cuda_copy_gather(pp.packets(recs), 0, b, None) == 0


def test_async_job_on_cpu_is_complete_on_return() -> None:
    bodies = images(2)
    sp, recs = make_pool(bodies)
    out = np.zeros((2, *bodies[0].shape), np.uint8)
    job = gpu_dma_async(PinnedPool(sp, backend="cpu").packets(recs), 2, out, None)
    assert job.done and job.event is None
    assert job.wait() == 2
    assert job.statuses.tolist() == [0, 0]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=6), chunk=st.integers(1, 1024),
       seed=st.integers(0, 2**16))
def test_property_any_sizes_and_chunkings(sizes: list[int], chunk: int, seed: int) -> None:
    # Rows of one call share a size; each example uses the first size for every request.
    size = sizes[0]
    rng = np.random.default_rng(seed)
    bodies = [rng.integers(0, 256, size=size, dtype=np.uint8) for _ in sizes]
    chunk = max(chunk, -(-size // 1024), -(-size * len(bodies) // 4000))  # fits max_chunks and the slots
    sp, recs = make_pool(bodies, chunk_payload=chunk, seed=seed)
    order = rng.permutation(len(recs))
    out = np.zeros((len(recs), size), np.uint8)
    assert gpu_dma(PinnedPool(sp, backend="cpu").packets([recs[i] for i in order]), len(recs), out, None) == len(recs)
    for row, i in enumerate(order):
        assert out[row].tobytes() == bodies[i].tobytes()


# -- CPU backend: verdicts ----------------------------------------------------------------------------

def _corrupt(sp: SyntheticPool, rec: int, what: str) -> None:
    r = sp.records[rec]
    if what == "not_delivered":
        r["state"] = STATE_FILLING
    elif what == "bad_chunk_count":
        r["chunk_count"] = 0
    elif what == "bad_slot":
        sp.chunkmap[rec, 1] = sp.layout["slot_count"] + 5
    elif what == "bad_magic":
        sp.set_header_field(rec, 2, "magic", 0x12345678)
    elif what == "bad_kind":
        sp.set_header_field(rec, 0, "kind", wire.KIND_RESPONSE)
    elif what == "other_request":
        sp.set_header_field(rec, 1, "request_id", 999999)
    elif what == "other_app":
        sp.set_header_field(rec, 1, "app_id", APP + 1)
    elif what == "wrong_index":
        sp.set_header_field(rec, 3, "chunk_index", 4)
    elif what == "bad_length":
        sp.set_header_field(rec, 0, "payload_len", 17)
    elif what == "stride_over_slot":
        r["stride"] = sp.layout["max_payload"] + 16
    else:
        raise AssertionError(what)


@pytest.mark.parametrize("what,status", [
    ("not_delivered", DmaStatus.BAD_RECORD),
    ("bad_chunk_count", DmaStatus.BAD_SHAPE),
    ("stride_over_slot", DmaStatus.BAD_SHAPE),
    ("bad_slot", DmaStatus.BAD_SLOT),
    ("bad_magic", DmaStatus.BAD_HEADER),
    ("bad_kind", DmaStatus.BAD_HEADER),
    ("other_request", DmaStatus.MISMATCH),
    ("other_app", DmaStatus.MISMATCH),
    ("wrong_index", DmaStatus.MISMATCH),
    ("bad_length", DmaStatus.BAD_LENGTH),
])
def test_bad_request_is_refused_and_others_are_placed(what: str, status: DmaStatus) -> None:
    bodies = images(3, shape=(40, 30, 3))
    sp, recs = make_pool(bodies, chunk_payload=512)
    _corrupt(sp, recs[1], what)
    out = np.zeros((3, 40, 30, 3), np.uint8)
    st = np.zeros(3, np.int32)
    assert gpu_dma(PinnedPool(sp, backend="cpu").packets(recs), 3, out, None, statuses=st) == 2
    assert st.tolist() == [0, int(status), 0]
    assert out[0].tobytes() == bodies[0].tobytes() and out[2].tobytes() == bodies[2].tobytes()


def test_record_index_out_of_range_and_wrong_size_and_dtype() -> None:
    bodies = images(2)
    sp, recs = make_pool(bodies)
    pp = PinnedPool(sp, backend="cpu")
    st = np.zeros(3, np.int32)
    out = np.zeros((3, *bodies[0].shape), np.uint8)
    assert gpu_dma(pp.packets([recs[0], 63_000, recs[1]]), 3, out, None, statuses=st) == 2
    assert st.tolist() == [0, DmaStatus.BAD_RECORD, 0]
    small = np.zeros((2, 10), np.uint8)
    assert gpu_dma(pp.packets(recs), 2, small, None, statuses=st) == 0
    assert st[:2].tolist() == [DmaStatus.BAD_SHAPE] * 2
    assert gpu_dma(pp.packets(recs), 2, out, None, expect_dtype=int(wire.DType.FLOAT32), statuses=st) == 0
    assert st[:2].tolist() == [DmaStatus.BAD_DTYPE] * 2
    f = np.zeros((2, *bodies[0].shape), np.float32)
    # A float32 request with as many bytes as a uint8 row: the fused variant wants uint8 records.
    fbody = images(1, dtype=np.float32, shape=(bodies[0].size // 4,))[0]
    rec_f = sp.add_request(APP, 5, fbody)
    assert gpu_dma(pp.packets([rec_f, recs[0]]), 2, f, None, normalize=Normalize(), statuses=st) == 1
    assert st[:2].tolist() == [DmaStatus.BAD_DTYPE, DmaStatus.OK]
    assert gpu_dma(pp.packets([rec_f]), 1, f, None, normalize=Normalize(), expect_dtype=int(wire.DType.FLOAT32)) == 1


# -- validation --------------------------------------------------------------------------------------

@pytest.fixture
def cpu_pool() -> tuple[PinnedPool, list[int], np.ndarray]:
    bodies = images(2)
    sp, recs = make_pool(bodies)
    return PinnedPool(sp, backend="cpu"), recs, np.zeros((2, *bodies[0].shape), np.uint8)


def test_argument_validation(cpu_pool: tuple[PinnedPool, list[int], np.ndarray]) -> None:
    pp, recs, out = cpu_pool
    pk = pp.packets(recs)
    with pytest.raises(TypeError, match=r"PinnedPool\.packets"):
        gpu_dma(recs, 2, out, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="num_packets"):
        gpu_dma(pk, 1.5, out, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="num_packets"):
        gpu_dma(pk, True, out, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"0\.\.2.*got 3"):
        gpu_dma(pk, 3, out, None)
    with pytest.raises(ValueError, match="got -1"):
        gpu_dma(pk, -1, out, None)
    with pytest.raises(ValueError, match="fewer than num_packets"):
        gpu_dma(pk, 2, out[:1], None)
    with pytest.raises(ValueError, match="pass None"):
        gpu_dma(pk, 2, out, 0)
    with pytest.raises(ValueError, match="C-contiguous"):
        gpu_dma(pk, 2, np.zeros((2, 40, 20, 3), np.uint8)[:, ::2], None)
    ro = out.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        gpu_dma(pk, 2, ro, None)
    with pytest.raises(ValueError, match="non-empty row"):
        gpu_dma(pk, 0, np.zeros((0, 4), np.uint8), None)
    with pytest.raises(TypeError, match="torch tensor or a numpy array"):
        gpu_dma(pk, 2, bytearray(10), None)
    with pytest.raises(ValueError, match="contiguous"):
        gpu_dma(pk, 2, torch.zeros(3, 2, 20, 17).transpose(0, 1), None)
    with pytest.raises(ValueError, match="float32 gpu_buffer"):
        gpu_dma(pk, 2, out, None, normalize=Normalize())
    with pytest.raises(TypeError, match="Normalize"):
        gpu_dma(pk, 2, out, None, normalize=(0.5, 0.5))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="statuses"):
        gpu_dma(pk, 2, out, None, statuses=np.zeros(1, np.int32))
    with pytest.raises(ValueError, match="statuses"):
        gpu_dma(pk, 2, out, None, statuses=np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="statuses"):
        cuda_copy_gather(pk, 2, out, None, statuses=[0, 0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pass None"):
        cuda_copy_gather(pk, 2, out, 1)


def test_too_many_rows_for_one_launch() -> None:
    sp = SyntheticPool(slot_count=1024, max_payload=64, record_count=600, max_chunks=2)
    recs = [sp.add_request(APP, i, np.full(8, i % 256, np.uint8)) for i in range(513)]
    pp = PinnedPool(sp, backend="cpu")
    out = np.zeros((513, 8), np.uint8)
    with pytest.raises(ValueError, match="at most 512"):
        gpu_dma(pp.packets(recs), 513, out, None)
    assert gpu_dma(pp.packets(recs), 512, out, None) == 512
    assert np.array_equal(out[:512, 0], np.arange(512) % 256)


def test_packets_and_normalize_validation(cpu_pool: tuple[PinnedPool, list[int], np.ndarray]) -> None:
    pp = cpu_pool[0]
    with pytest.raises(ValueError, match="one-dimensional"):
        pp.packets([[1, 2]])
    with pytest.raises(ValueError, match="non-negative uint32"):
        pp.packets([-1, 2])
    with pytest.raises(ValueError, match="non-negative uint32"):
        pp.packets([0.5])
    assert len(pp.packets([])) == 0
    with pytest.raises(ValueError, match="same length"):
        Normalize(mean=(0.1, 0.2), std=(1.0,))
    with pytest.raises(ValueError, match="same length"):
        Normalize(mean=(0.0,) * 5, std=(1.0,) * 5)
    with pytest.raises(ValueError, match="must not contain 0"):
        Normalize(std=(0.0,))
    with pytest.raises(ValueError, match="finite"):
        Normalize(scale=float("nan"))
    with pytest.raises(ValueError, match="does not look like a packet pool"):
        PinnedPool(object(), backend="cpu")
    with pytest.raises(ValueError, match="backend"):
        PinnedPool(cpu_pool[0].pool, backend="gpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend must be 'auto', 'cpu' or 'cuda'"):
        PinnedPool(cpu_pool[0].pool, backend="any")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not registered with CUDA"):
        pp.device_pointer(0)


def test_pool_geometry_is_checked() -> None:
    sp = SyntheticPool(slot_count=16, max_payload=64, record_count=4, max_chunks=4)
    good = PoolLayout.of(sp)
    good.geometry()
    for change, match in (({"nbytes": 4096}, "runs past"), ({"slot_size": 40}, "slot_size"),
                          ({"slot_size": 120}, "multiple of 16"), ({"max_chunks": 0}, "max_chunks"),
                          ({"slots_offset": 8}, "aligned")):
        with pytest.raises(ValueError, match=match):
            PoolLayout(**{**good.__dict__, **change}).geometry()


def test_native_gather_refuses_small_destination() -> None:
    sp, recs = make_pool(images(2))
    pp = PinnedPool(sp, backend="cpu")
    plan = dma_mod._plan(pp.packets(recs), 2, np.zeros((2, 20, 17, 3), np.uint8), None, None, None)
    with pytest.raises(ValueError, match="fewer than the rows"):
        dma_mod._gather_cpu(plan, plan.target.ptr, 100, np.zeros(2, np.int32))


# -- the real packet pool, filled by the real ingest ---------------------------------------------------

def test_real_pool_via_ingest_matches_pool_gather_and_oracle() -> None:
    from gpuprims.ingest import Ingest
    from gpuprims.pool import PacketPool

    bodies = images(4, shape=(16, 16, 3), seed=3)
    pool = PacketPool.create(slot_count=1024, record_count=32, max_chunks=64, consumer_count=1)
    ingest = Ingest(pool, [("127.0.0.1", 0)], timeout_ms=2000).start()
    try:
        ingest.set_route(APP, [0])
        dgrams = [d for i, b in enumerate(bodies) for d in wire.encode_request(APP, 50 + i, b, chunk_payload=100)]
        random.Random(4).shuffle(dgrams)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for d in dgrams:
                s.sendto(d, ("127.0.0.1", ingest.ports[0]))
        cons = pool.consumer(0)
        got: list[int] = []
        deadline = time.monotonic() + 30  # the ingest reacts at once; a busy machine may delay it
        while len(got) < 4 and time.monotonic() < deadline:
            got += cons.poll(8, 100).tolist()
        assert len(got) == 4
        recs = np.array(got, np.uint32)
        ids = pool.requests(recs)["request_id"]
        pp = PinnedPool(pool, backend="cpu")
        out = np.zeros((4, 16, 16, 3), np.uint8)
        ref = np.zeros_like(out)
        assert gpu_dma(pp.packets(recs), 4, out, None) == 4
        pool.gather(recs, ref)
        assert out.tobytes() == ref.tobytes()
        for row, rid in enumerate(ids):
            assert out[row].tobytes() == bodies[int(rid) - 50].tobytes()
        pp.close()
        cons.release(recs)
    finally:
        ingest.stop()
        pool.close()


def test_packets_type_is_frozen() -> None:
    sp, recs = make_pool(images(1))
    pk = PinnedPool(sp, backend="cpu").packets(recs)
    assert isinstance(pk, Packets) and len(pk) == 1
    with pytest.raises(AttributeError):
        pk.records = np.zeros(1, np.uint32)  # type: ignore[misc]


# -- CUDA (needs a GPU) ------------------------------------------------------------------------------

def _torch_dtype(dtype: type) -> torch.dtype:
    return {np.uint8: torch.uint8, np.float32: torch.float32}[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
def test_gpu_dma_matches_oracle_on_every_device(dtype: type) -> None:
    shape = (64, 48, 3)
    bodies = images(6, shape=shape, dtype=dtype, seed=11)
    sp, recs = make_pool(bodies, chunk_payload=1024)
    order = [5, 2, 0, 4, 1, 3]
    with PinnedPool(sp, backend="cuda") as pp:
        for dev in range(torch.cuda.device_count()):
            out = torch.zeros((8, *shape), dtype=_torch_dtype(dtype), device=f"cuda:{dev}")
            st = np.full(8, -1, np.int32)
            assert gpu_dma(pp.packets([recs[i] for i in order]), 6, out, dev, statuses=st) == 6
            assert st[:6].tolist() == [0] * 6 and st[6:].tolist() == [-1, -1]
            host = out.cpu().numpy()
            for row, i in enumerate(order):
                assert host[row].tobytes() == bodies[i].tobytes(), (dev, row)
            assert not host[6:].any()  # rows past num_packets untouched


@pytest.mark.gpu
def test_gpu_dma_partial_batches_and_back_to_back_launches() -> None:
    shape = (32, 32, 3)
    bodies = images(8, shape=shape, seed=12)
    sp, recs = make_pool(bodies, chunk_payload=700)
    with PinnedPool(sp, backend="cuda") as pp:
        out = torch.zeros((8, *shape), dtype=torch.uint8, device="cuda:0")
        for n in (1, 3, 8, 0, 5):
            out.zero_()
            assert gpu_dma(pp.packets(recs[::-1]), n, out, 0) == n
            host = out.cpu().numpy()
            for row in range(n):
                assert host[row].tobytes() == bodies[7 - row].tobytes()
            assert not host[n:].any()


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)), Normalize()])
def test_gpu_dma_fused_normalize_is_bit_exact(norm: Normalize) -> None:
    shape = (50, 40, 3)
    bodies = images(4, shape=shape, seed=13)
    sp, recs = make_pool(bodies, chunk_payload=1000)  # chunk starts not multiples of 16 elements
    with PinnedPool(sp, backend="cuda") as pp:
        for dev in range(torch.cuda.device_count()):
            out = torch.zeros((4, *shape), dtype=torch.float32, device=f"cuda:{dev}")
            assert gpu_dma(pp.packets(recs), 4, out, dev, normalize=norm) == 4
            host = out.cpu().numpy()
            for row in range(4):
                assert host[row].tobytes() == normalized(bodies[row], norm).tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("what", ["not_delivered", "bad_chunk_count", "stride_over_slot", "bad_slot", "bad_magic",
                                  "bad_kind", "other_request", "other_app", "wrong_index", "bad_length"])
def test_gpu_verdicts_and_bytes_equal_cpu_reference(what: str) -> None:
    shape = (40, 30, 3)
    bodies = images(3, shape=shape, seed=14)
    sp, recs = make_pool(bodies, chunk_payload=512)
    _corrupt(sp, recs[1], what)
    ref = np.zeros((3, *shape), np.uint8)
    st_ref = np.zeros(3, np.int32)
    n_ref = gpu_dma(PinnedPool(sp, backend="cpu").packets(recs), 3, ref, None, statuses=st_ref)
    with PinnedPool(sp, backend="cuda") as pp:
        out = torch.zeros((3, *shape), dtype=torch.uint8, device="cuda:0")
        st = np.zeros(3, np.int32)
        assert gpu_dma(pp.packets(recs), 3, out, 0, statuses=st) == n_ref == 2
        assert st.tolist() == st_ref.tolist()
        assert out.cpu().numpy().tobytes() == ref.tobytes()
        # The next launch starts from clean verdicts.
        sp.records[recs[1]]["state"] = 2
        good = [recs[0], recs[2]]
        assert gpu_dma(pp.packets(good), 2, out, 0, statuses=st) == 2
        assert st[:2].tolist() == [0, 0]


@pytest.mark.gpu
def test_gpu_dma_async_on_a_stream_and_one_job_in_flight() -> None:
    shape = (64, 64, 3)
    bodies = images(4, shape=shape, seed=15)
    sp, recs = make_pool(bodies)
    with PinnedPool(sp, backend="cuda") as pp:
        s = torch.cuda.Stream(device=0)
        out = torch.zeros((4, *shape), dtype=torch.uint8, device="cuda:0")
        job = gpu_dma_async(pp.packets(recs), 4, out, 0, stream=s)
        with pytest.raises(RuntimeError, match="still in flight"):
            gpu_dma_async(pp.packets(recs), 4, out, 0, stream=s)
        assert job.wait(timeout_s=10) == 4 and job.done
        assert job.statuses.tolist() == [0] * 4
        assert out.cpu().numpy().tobytes() == np.stack(bodies).tobytes()
        raw = gpu_dma_async(pp.packets(recs), 4, out, 0, stream=s.cuda_stream)
        assert raw.wait() == 4


@pytest.mark.gpu
def test_cuda_copy_gather_equals_gpu_dma_on_gpu() -> None:
    shape = (64, 64, 3)
    bodies = images(5, shape=shape, seed=16)
    sp, recs = make_pool(bodies)
    with PinnedPool(sp, backend="cuda") as pp:
        for dev in range(torch.cuda.device_count()):
            a = torch.zeros((5, *shape), dtype=torch.uint8, device=f"cuda:{dev}")
            b = torch.zeros_like(a)
            assert gpu_dma(pp.packets(recs), 5, a, dev) == 5
            assert cuda_copy_gather(pp.packets(recs), 5, b, dev) == 5
            assert torch.equal(a, b)
            assert a.cpu().numpy().tobytes() == np.stack(bodies).tobytes()


@pytest.mark.gpu
def test_gpu_argument_validation() -> None:
    sp, recs = make_pool(images(2))
    out = torch.zeros((2, 20, 17, 3), dtype=torch.uint8, device="cuda:0")
    cpu_pp = PinnedPool(sp, backend="cpu")
    with pytest.raises(ValueError, match="not registered with CUDA"):
        gpu_dma(cpu_pp.packets(recs), 2, out, 0)
    with PinnedPool(sp, backend="cuda") as pp:
        with pytest.raises(ValueError, match="gpu_id must be 0"):
            gpu_dma(pp.packets(recs), 2, out, None)
        with pytest.raises(ValueError, match="gpu_id=1 but gpu_buffer is on cuda:0"):
            gpu_dma(pp.packets(recs), 2, out, 1)
        assert pp.device_pointer(0) != 0


@pytest.mark.gpu
def test_gpu_dma_from_real_pool_registered_in_this_process() -> None:
    from gpuprims.pool import PacketPool

    pool = PacketPool.create(slot_count=256, record_count=8, max_chunks=16, consumer_count=1)
    try:
        with PinnedPool(pool, backend="cuda") as pp:
            out = torch.zeros((1, 8), dtype=torch.uint8, device="cuda:0")
            st = np.zeros(1, np.int32)
            # A free record is refused by the GPU's own check of the record state.
            assert gpu_dma(pp.packets([0]), 1, out, 0, statuses=st) == 0
            assert st.tolist() == [DmaStatus.BAD_RECORD]
    finally:
        pool.close()


@pytest.mark.gpu
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer_reports_no_errors(tool: str) -> None:
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    exe = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not Path(exe).exists():
        pytest.skip("compute-sanitizer is not installed")
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run([exe, "--tool", tool, "--error-exitcode", "3", sys.executable, "-m",
                           "tests.gpuprims.cuda.sanitize_target"], cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "ERROR SUMMARY: 0 errors" in proc.stdout + proc.stderr


def test_misaligned_pool_address_is_refused() -> None:
    sp = SyntheticPool(slot_count=16, max_payload=64, record_count=2, max_chunks=2)

    class Shifted:
        address = sp.address + 8
        nbytes = sp.nbytes - 8
        layout = sp.layout

    with pytest.raises(ValueError, match="16-byte aligned"):
        PinnedPool(Shifted(), backend="cpu")


@pytest.mark.skipif(cuda_available(), reason="passes fake device pointers; only safe where no GPU can run them")
@pytest.mark.skipif(not _native.CUDA_KERNELS_BUILT, reason="extension built without CUDA")
@pytest.mark.parametrize("normalize", [None, Normalize(mean=(0.5, 0.5, 0.5), std=(0.2, 0.2, 0.2))])
def test_native_launch_binding_accepts_what_python_passes(normalize: Normalize | None) -> None:
    from gpuprims.cuda import CudaError

    bodies = images(2)
    sp, recs = make_pool(bodies)
    pp = PinnedPool(sp, backend="cpu")
    out = np.zeros((2, *bodies[0].shape), np.float32 if normalize else np.uint8)
    plan = dma_mod._plan(pp.packets(recs), 2, out, None, normalize, None)
    # The arguments convert and pass the native checks; the first CUDA call then fails for want of a driver.
    with pytest.raises(CudaError) as info:
        dma_mod._launch(plan, 0, 0, 0x10000, 0x20000, 0x30000)
    assert info.value.name in ("cudaErrorInsufficientDriver", "cudaErrorNoDevice")
    many = SyntheticPool(slot_count=1024, max_payload=64, record_count=600, max_chunks=2)
    rs = [many.add_request(APP, i, np.zeros(8, np.uint8)) for i in range(513)]
    big = dma_mod._plan(PinnedPool(many, backend="cpu").packets(rs), 512, np.zeros((513, 8), np.uint8), None, None,
                        None)
    big.records = PinnedPool(many, backend="cpu").packets(rs).records  # 513 rows: past the native limit
    with pytest.raises(ValueError, match="at most 512"):
        dma_mod._launch(big, 0, 0, 0x10000, 0x20000, 0x30000)


def test_float_rows_off_a_4_byte_boundary_are_refused() -> None:
    """UBSan found misaligned float stores for such rows in the host-run kernel; on a GPU they are a
    misaligned-address fault, so the native checks refuse them up front (both launch and reference)."""
    sp = SyntheticPool(slot_count=8, max_payload=64, record_count=2, max_chunks=2)
    try:
        geo = PoolLayout.of(sp).geometry()
        recs = np.zeros(1, np.uint32)
        out = np.zeros(64, np.uint8)
        base = out.ctypes.data + (-out.ctypes.data) % 16
        args = (1, [1.0] * 4, [0.0] * 4, [1.0] * 4, np.zeros(1, np.int32))
        with pytest.raises(ValueError, match="4-byte boundaries"):
            _native.dma_gather_cpu(sp.address, geo, recs, base, 40, 10 * 4 + 2, 10, -1, 1, *args)
        with pytest.raises(ValueError, match="4-byte boundaries"):
            _native.dma_gather_cpu(sp.address, geo, recs, base + 2, 40, 40, 10, -1, 1, *args)
    finally:
        sp.close()


@pytest.mark.skipif(cuda_available(), reason="asserts the fall-back to cpu where no CUDA device exists")
def test_auto_is_cpu_where_the_runtime_sees_no_device() -> None:
    bodies = images(1)
    sp, _ = make_pool(bodies)
    pp = PinnedPool(sp)  # the default, as docs/primitives.md writes it
    assert pp.backend == "cpu" and pp.region is None
    pp.close()


def test_auto_registers_where_the_runtime_sees_a_device(fake_cuda: object) -> None:
    bodies = images(1)
    sp, _ = make_pool(bodies)
    pp = PinnedPool(sp, backend="auto")
    try:
        assert pp.backend == "cuda" and pp.region is not None
        assert fake_cuda.live("registered")  # type: ignore[attr-defined]
    finally:
        pp.close()
    assert fake_cuda.live("registered") == []  # type: ignore[attr-defined]
