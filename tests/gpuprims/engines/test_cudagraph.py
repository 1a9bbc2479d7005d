"""``engine: cudagraph`` on the fake CUDA runtime: one graph per bucket captured at prepare (never on
the serving path), equal to eager at batch 1, max/2 and max, the static input that GPU-DMA fills, the
replay on the instance's stream that Sync-lite waits for, capture errors as CudaError, and close()
destroying every graph; ``streams: opara`` on GoogLeNet and Inception-v3 (small variants): the capture
follows the Opara plan (its streams, its waits, fork and join, read from the fake's records)."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from gpuprims.cuda import graph as cuda_graph
from gpuprims.cuda import runtime
from gpuprims.cuda.errors import CudaError
from gpuprims.cuda.event import Event, Stream
from gpuprims.engines import EngineError, EngineUnavailable, ModelSource, Target, check_engine, make_engine
from gpuprims.engines.cudagraph import CudaGraphEngine, bucket_of, buckets_for

MAX = 8
SOURCE = ModelSource("tests.gpuprims.engines.nets:tiny", (3, 8, 8), max_batch=MAX)


def _eager(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return SOURCE.build_module("cpu")(x)


def test_buckets_are_powers_of_two_and_max() -> None:
    assert buckets_for(1) == [1]
    assert buckets_for(8) == [1, 2, 4, 8]
    assert buckets_for(12) == [1, 2, 4, 8, 12]
    assert [bucket_of(n, buckets_for(12)) for n in (1, 3, 5, 9, 12)] == [1, 4, 8, 12, 12]
    with pytest.raises(EngineError, match="exceeds"):
        bucket_of(13, buckets_for(12))


def test_check_refuses_cpu_and_bad_options() -> None:
    with pytest.raises(EngineUnavailable, match=r"'cudagraph' needs the cuda backend; this node runs on cpu"):
        check_engine("cudagraph", "cpu")
    check_engine("cudagraph", "cuda", {"streams": "opara", "max_streams": 4})
    with pytest.raises(EngineError, match=r"max_streams=4 applies only to streams: opara"):
        check_engine("cudagraph", "cuda", {"max_streams": 4})
    for bad in (0, -1, 1.5, True, "4", 10_000):
        with pytest.raises(EngineError, match="max_streams must be an integer"):
            check_engine("cudagraph", "cuda", {"streams": "opara", "max_streams": bad})
    with pytest.raises(EngineError, match="streams must be one of"):
        check_engine("cudagraph", "cuda", {"streams": "many"})
    with pytest.raises(EngineError, match="warmup"):
        check_engine("cudagraph", "cuda", {"warmup": 0})
    with pytest.raises(EngineError, match="no option"):
        check_engine("cudagraph", "cuda", {"stream": "single"})
    check_engine("cudagraph", "cuda", {"streams": "single", "warmup": 2})


def test_outputs_equal_eager_and_serving_never_captures(fake_cuda: Any) -> None:
    stream = Stream(0)
    eng = make_engine("cudagraph", SOURCE, Target("cuda", stream=stream))
    assert isinstance(eng, CudaGraphEngine)
    before = cuda_graph.captures()
    msgs: list[str] = []
    eng.prepare(progress=lambda m, f: msgs.append(m))
    assert eng.captures == len(buckets_for(MAX)) == cuda_graph.captures() - before
    assert fake_cuda.captures_begun == eng.captures
    assert any("capturing bucket" in m for m in msgs)
    begun = fake_cuda.captures_begun
    ev = Event(0)
    rng = torch.Generator().manual_seed(0)
    rtol, atol = CudaGraphEngine.tolerance
    for n in (1, MAX // 2, 3, MAX, 1):
        x = torch.rand((n, *SOURCE.input_shape), generator=rng)
        out = eng.run(x)
        ev.record(stream)  # Sync-lite: an event after the replay on the instance's stream
        ev.wait(50, timeout_s=30)
        torch.testing.assert_close(out, _eager(x), rtol=rtol, atol=atol)
    assert fake_cuda.captures_begun == begun and eng.captures == len(buckets_for(MAX))  # no capture while serving
    assert eng.replays == 5
    d = eng.describe()
    assert d["kind"] == "cudagraph" and d["buckets"] == [1, 2, 4, 8] and d["replays"] == 5
    ev.close()
    eng.close()
    stream.close()
    gc.collect()
    assert fake_cuda.live("graph") == [] and fake_cuda.live("graph_exec") == []
    assert fake_cuda.live("device") == [] and fake_cuda.live("stream") == [] and fake_cuda.unsafe_frees == []


def test_static_input_is_the_device_buffer_the_graphs_read(fake_cuda: Any) -> None:
    eng = make_engine("cudagraph", SOURCE, Target("cuda"))
    assert eng.static_input() is None
    eng.prepare()
    static = eng.static_input()
    assert tuple(static.shape) == (MAX, *SOURCE.input_shape) and static.dtype == torch.float32
    # it lies in fake device memory (what a GPU-DMA kernel may write), and a batch written there runs as is
    assert any(r.handle <= static.data_ptr() < r.handle + r.nbytes for r in fake_cuda.live("device"))
    x = torch.rand((5, *SOURCE.input_shape), generator=torch.Generator().manual_seed(1))
    static[:5].copy_(x)
    copies = fake_cuda.calls.get("cuda_memcpy_async", 0)
    out = eng.run(static[:5])
    eng.synchronize()
    assert fake_cuda.calls.get("cuda_memcpy_async", 0) == copies  # no copy: pool -> kernel -> graph
    torch.testing.assert_close(out, _eager(x), rtol=1e-4, atol=1e-5)
    eng.close()
    gc.collect()
    assert fake_cuda.live("graph_exec") == [] and fake_cuda.live("device") == []


def test_bad_batches_are_refused_by_name(fake_cuda: Any) -> None:
    eng = make_engine("cudagraph", SOURCE, Target("cuda"))
    with pytest.raises(EngineError, match="not prepared"):
        eng.run(torch.zeros(1, 3, 8, 8))
    eng.prepare()
    for bad in (torch.zeros(MAX + 1, 3, 8, 8), torch.zeros(1, 3, 4, 4), torch.zeros(3, 8, 8)):
        with pytest.raises(EngineError, match=r"takes \(n, 3, 8, 8\)"):
            eng.run(bad)
    eng.close()


@pytest.mark.parametrize(("call", "status", "name"), [
    ("cuda_stream_begin_capture", 900, "cudaErrorStreamCaptureUnsupported"),
    ("cuda_stream_end_capture", 904, "cudaErrorStreamCaptureUnjoined"),
    ("cuda_graph_instantiate", 2, "cudaErrorMemoryAllocation"),
])
def test_capture_errors_surface_as_cuda_error_and_leave_nothing(fake_cuda: Any, call: str, status: int,
                                                               name: str) -> None:
    fake_cuda.inject(call, status)
    eng = make_engine("cudagraph", SOURCE, Target("cuda"))
    with pytest.raises(CudaError) as ei:
        eng.prepare()
    assert ei.value.name == name and not eng.prepared
    gc.collect()
    assert fake_cuda.live("graph") == [] and fake_cuda.live("graph_exec") == [] and fake_cuda.live("device") == []
    assert fake_cuda.live("stream") == []


def test_run_inside_a_host_function_is_refused(fake_cuda: Any) -> None:
    """An engine that enqueues must be driven from the host thread; from a stream callback CUDA refuses
    every call (cudaErrorNotPermitted), which the fake enforces."""
    eng = make_engine("cudagraph", SOURCE, Target("cuda"))
    eng.prepare()
    s = Stream(0)
    box: list[BaseException] = []

    def inside() -> None:
        try:
            eng.run(torch.zeros(1, 3, 8, 8))
        except CudaError as e:
            box.append(e)

    runtime.cuda().launch_host_func(s.handle, inside)
    s.synchronize()
    assert [type(e).__name__ for e in box] == ["CudaError"] and "NotPermitted" in str(box[0])
    s.close()
    eng.close()


def test_close_after_a_device_fault_releases_everything(fake_cuda: Any) -> None:
    """A sticky fault (the context is lost) while a replay is queued: close() logs it and still releases."""
    eng = make_engine("cudagraph", SOURCE, Target("cuda"))
    eng.prepare()
    eng.run(torch.zeros(2, 3, 8, 8))
    fake_cuda.fault(700)  # cudaErrorIllegalAddress: every later call fails
    eng.close()
    assert not eng.prepared and eng.graphs == {}


@pytest.mark.gpu
def test_on_a_gpu_torch_capture_equals_eager_at_every_bucket() -> None:
    """The real path: torch.cuda.graph per bucket, replayed on a torch stream, against eager on the GPU."""
    source = ModelSource("mobilenet_v2", (3, 64, 64), max_batch=MAX, num_classes=10)
    stream = torch.cuda.Stream()
    eng = make_engine("cudagraph", source, Target("cuda", stream=stream))
    module = source.build_module("cuda")
    eng.prepare(module)
    before = cuda_graph.captures()
    gen = torch.Generator().manual_seed(0)
    rtol, atol = CudaGraphEngine.tolerance
    for n in (1, MAX // 2, 3, MAX):
        x = torch.rand((n, 3, 64, 64), generator=gen).cuda()
        torch.cuda.synchronize()
        out = eng.run(x)
        eng.synchronize()
        with torch.no_grad():
            torch.testing.assert_close(out, module(x), rtol=rtol, atol=atol)
    assert cuda_graph.captures() == before
    eng.close()


def test_a_request_goes_pool_to_kernel_to_graph_with_no_copy(fake_cuda: Any) -> None:
    """GPU-DMA gathers uint8 requests (scaled to [0, 1]) straight into the engine's static input on the
    instance's stream, the graph replays after it on the same stream, and Sync-lite waits on an event
    after the replay: the answers equal eager on the same images, and no memcpy was issued."""
    import numpy as np

    from gpuprims.cuda.dma import UNIT, DeviceRows, PinnedPool, gpu_dma_async
    from gpuprims.testing.synthetic import SyntheticPool

    stream = Stream(0)
    eng = make_engine("cudagraph", SOURCE, Target("cuda", stream=stream))
    eng.prepare()
    static = eng.static_input()
    n, row = 5, 3 * 8 * 8
    rng = np.random.default_rng(7)
    bodies = [rng.integers(0, 256, row, dtype=np.uint8) for _ in range(n)]
    sp = SyntheticPool(slot_count=64, max_payload=1024, record_count=n + 2, max_chunks=4, seed=1)
    recs = np.array([sp.add_request(1, i, b) for i, b in enumerate(bodies)], np.uint32)
    pp = PinnedPool(sp, backend="cuda")
    rows = DeviceRows(static.data_ptr(), static.numel() * 4, MAX, 0, True, static)
    copies = fake_cuda.calls.get("cuda_memcpy_async", 0)
    job = gpu_dma_async(pp.packets(recs), n, rows, 0, stream=stream, normalize=UNIT)
    out = eng.run(static[:n])  # queued behind the gather on the same stream, no wait in between
    ev = Event(0)
    ev.record(stream)
    ev.wait(50, timeout_s=30)
    assert job.wait(20, timeout_s=30) == n
    assert fake_cuda.calls.get("cuda_memcpy_async", 0) == copies
    x = torch.from_numpy(np.stack(bodies).astype(np.float32).reshape(n, 3, 8, 8)) / 255.0
    torch.testing.assert_close(out, _eager(x), rtol=1e-4, atol=1e-5)
    ev.close()
    pp.close()
    eng.close()
    stream.close()
    gc.collect()
    assert fake_cuda.live("registered") == [] and fake_cuda.live("device") == [] and fake_cuda.unsafe_frees == []


OPARA_MAX = 4
OPARA_SOURCES = {
    "googlenet": ModelSource("tests.gpuprims.engines.nets:googlenet_small", (3, 32, 32), max_batch=OPARA_MAX),
    "inception_v3": ModelSource("tests.gpuprims.engines.nets:inception_v3_small", (3, 75, 75), max_batch=OPARA_MAX),
}


@pytest.mark.slow
@pytest.mark.parametrize(("name", "cap"), [
    ("googlenet", None), ("googlenet", 3),
    pytest.param("inception_v3", None, marks=pytest.mark.slow),  # ~25 s at load 10: each bucket's first runs
])
def test_opara_capture_follows_the_plan_and_equals_eager(fake_cuda: Any, name: str, cap: int | None) -> None:
    source = OPARA_SOURCES[name]
    stream = Stream(0)
    eng = make_engine("cudagraph", source, Target("cuda", stream=stream),
                      {"streams": "opara", "warmup": 1, "max_streams": cap})
    waits0 = fake_cuda.calls.get("cuda_stream_wait_event", 0)
    eng.prepare()
    assert sorted(eng.plans) == buckets_for(OPARA_MAX) == sorted(eng.graphs)
    # What the fake recorded: per bucket one host node per operator, captured on the plan's streams, each
    # node depending on the nodes of the ops its plan says it waits for; fork + plan waits + join as
    # cudaStreamWaitEvent calls.
    expected_waits = 0
    for b, plan in eng.plans.items():
        assert plan.num_streams > 1 and plan.num_waits > 0
        if cap is None:
            assert plan.num_streams == plan.chains
        else:
            assert plan.num_streams <= cap < plan.chains
        nodes = fake_cuda.graph_nodes(eng.graphs[b]._graph)
        assert len(nodes) == len(plan.order) == eng.graphs[b].nodes
        assert len({n.stream for n in nodes}) == plan.num_streams
        index = {op: i for i, op in enumerate(plan.order)}
        handles: dict[int, int] = {}
        for op, node in zip(plan.order, nodes):
            assert handles.setdefault(plan.stream_of[op], node.stream) == node.stream  # one stream per plan stream
            assert {index[u] for u in plan.waits[op]} <= set(node.deps)
        assert len(set(handles.values())) == plan.num_streams
        expected_waits += 2 * (plan.num_streams - 1) + plan.num_waits
    assert fake_cuda.calls.get("cuda_stream_wait_event", 0) - waits0 == expected_waits
    d = eng.describe()
    assert d["streams"] == "opara" and d["opara"]["max_streams"] == cap
    assert d["opara"]["num_streams"] == max(p.num_streams for p in eng.plans.values())
    assert d["opara"]["buckets"][OPARA_MAX]["num_events"] == eng.plans[OPARA_MAX].num_events
    assert d["opara"]["planning_ms"] > 0
    # Replays on the instance's stream, as streams: single: equal to eager at batch 1, max/2, max.
    module = source.build_module("cpu")
    rng = torch.Generator().manual_seed(2)
    rtol, atol = CudaGraphEngine.tolerance
    begun = fake_cuda.captures_begun
    for n in (1, OPARA_MAX // 2, OPARA_MAX, 3):
        x = torch.rand((n, *source.input_shape), generator=rng)
        out = eng.run(x)
        eng.synchronize()
        with torch.no_grad():
            torch.testing.assert_close(out, module(x), rtol=rtol, atol=atol)
    assert fake_cuda.captures_begun == begun
    eng.close()
    stream.close()
    gc.collect()
    assert fake_cuda.live("graph") == [] and fake_cuda.live("graph_exec") == [] and fake_cuda.live("event") == []
    assert fake_cuda.live("stream") == [] and fake_cuda.live("device") == [] and fake_cuda.unsafe_frees == []


def test_opara_capture_with_an_unjoined_stream_is_a_cuda_error(fake_cuda: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture that leaves work on a side stream that never joins back: the fake's cudaStreamEndCapture
    refuses it as CUDA does (cudaErrorStreamCaptureUnjoined), prepare raises it, and nothing stays live."""
    from gpuprims.engines import cudagraph as module

    real = module.capture_plan

    def leaves_a_stream_unjoined(cap: Any, plan: Any, launch_op: Any, streams: Any) -> None:
        real(cap, plan, launch_op, streams)
        cap.launch(lambda: None, streams[1])  # work forked into the capture after the join

    monkeypatch.setattr(module, "capture_plan", leaves_a_stream_unjoined)
    source = ModelSource("tests.gpuprims.engines.nets:googlenet_small", (3, 32, 32), max_batch=1)
    eng = make_engine("cudagraph", source, Target("cuda"), {"streams": "opara", "warmup": 1})
    with pytest.raises(CudaError) as ei:
        eng.prepare()
    assert ei.value.name == "cudaErrorStreamCaptureUnjoined" and not eng.prepared
    gc.collect()
    assert fake_cuda.live("graph") == [] and fake_cuda.live("graph_exec") == [] and fake_cuda.live("device") == []
    assert fake_cuda.live("stream") == [] and fake_cuda.live("event") == []


def test_opara_refuses_a_model_fx_cannot_trace(fake_cuda: Any) -> None:
    source = ModelSource("tests.gpuprims.engines.nets:untraceable", (3, 8, 8), max_batch=2)
    eng = make_engine("cudagraph", source, Target("cuda"), {"streams": "opara", "warmup": 1})
    with pytest.raises(EngineError, match=r"streams: opara cannot plan 'tests.gpuprims.engines.nets:untraceable'"):
        eng.prepare()
    gc.collect()
    assert fake_cuda.live("graph") == [] and fake_cuda.live("device") == [] and fake_cuda.live("stream") == []


@pytest.mark.gpu
def test_on_a_gpu_the_opara_capture_equals_eager_at_every_bucket() -> None:
    """The real path of streams: opara: torch's capture of the plan's forked streams, replayed on a torch
    stream, against eager on the GPU (GoogLeNet and Inception-v3 at full width, batch 1, max/2, max)."""
    for name, shape in (("googlenet", (3, 224, 224)), ("inception_v3", (3, 299, 299))):
        source = ModelSource(name, shape, max_batch=MAX, num_classes=10)
        stream = torch.cuda.Stream()
        eng = make_engine("cudagraph", source, Target("cuda", stream=stream), {"streams": "opara"})
        module = source.build_module("cuda")
        eng.prepare(module)
        assert eng.describe()["opara"]["num_streams"] > 1
        gen = torch.Generator().manual_seed(0)
        rtol, atol = CudaGraphEngine.tolerance
        for n in (1, MAX // 2, MAX):
            x = torch.rand((n, *shape), generator=gen).cuda()
            torch.cuda.synchronize()
            out = eng.run(x)
            eng.synchronize()
            with torch.no_grad():
                torch.testing.assert_close(out, module(x), rtol=rtol, atol=atol)
        eng.close()


def test_the_run_seam_runs_an_asynchronous_engine_on_the_host_thread(fake_cuda: Any) -> None:
    """The instance's run seam (ModelRunner) calls a graph engine on its own thread (a CUDA call inside a
    stream callback is not permitted) and waits on an event recorded after the replay: equal to eager."""
    from gpuprims.gather import ModelRunner

    stream = Stream(0)
    eng = make_engine("cudagraph", SOURCE, Target("cuda", stream=stream))
    eng.prepare()
    seam = ModelRunner("cuda", 0, stream=stream)
    x = torch.rand(3, 3, 8, 8)
    eng.static_input()[:3].copy_(x)
    out = seam.run(eng, eng.static_input()[:3])
    torch.testing.assert_close(out, _eager(x), rtol=1e-4, atol=1e-5)
    seam.close()
    eng.close()
    stream.close()
    gc.collect()
    assert fake_cuda.live("device") == []
