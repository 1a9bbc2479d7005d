"""The Python CUDA layer on the fake CUDA runtime (gpuprims.testing.fake): GPU-DMA with Sync-lite,
events, streams, the callback wait, IPC across processes, every error path of check(), lifetimes
(no leak, no free while work is queued, no hang) and that the real device error surfaces."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np
import pytest

from gpuprims import backend
from gpuprims.cuda import runtime
from gpuprims.cuda.dma import DeviceRows, DmaStatus, PinnedPool, gpu_dma_async
from gpuprims.cuda.errors import CudaError
from gpuprims.cuda.event import Event, Stream
from gpuprims.testing import fake
from gpuprims.testing.synthetic import SyntheticPool

ROW = 2000


def _filled(n: int = 4, seed: int = 0) -> tuple[SyntheticPool, np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    sp = SyntheticPool(slot_count=n * 3 + 8, max_payload=1024, record_count=n + 2, max_chunks=4, seed=seed)
    bodies = [rng.integers(0, 256, ROW, dtype=np.uint8) for _ in range(n)]
    recs = np.array([sp.add_request(1, i, b) for i, b in enumerate(bodies)], np.uint32)
    return sp, recs, bodies


def _rows(n: int) -> tuple[runtime.DeviceMemory, DeviceRows]:
    mem = runtime.DeviceMemory(n * ROW, 0)
    return mem, DeviceRows(mem.ptr, mem.nbytes, n, 0, False, mem)


def _host(mem: runtime.DeviceMemory) -> np.ndarray:
    return runtime._host_array(mem.ptr, mem.nbytes)


def test_gpu_dma_places_rows_and_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fake.FAKE_ENV, "delay_us=300000")  # long enough to see the job in flight on a busy machine
    fake_cuda = fake.reset()
    sp, recs, bodies = _filled()
    pp = PinnedPool(sp, backend="cuda")
    mem, rows = _rows(4)
    s = Stream(0)
    job = gpu_dma_async(pp.packets(recs), 4, rows, 0, stream=s)
    assert not job.done  # the "kernel" takes delay_us
    assert job.wait(20, timeout_s=5) == 4
    assert _host(mem).tobytes() == b"".join(b.tobytes() for b in bodies)
    assert job.statuses.tolist() == [0] * 4
    pp.close()
    mem.close()
    s.close()
    gc.collect()
    assert fake_cuda.live("registered") == [] and fake_cuda.live("device") == []
    assert fake_cuda.live("host_alloc") == [] and fake_cuda.live("event") == []
    assert fake_cuda.unsafe_frees == []
    sp.close()
    fake.reset("1")


def test_pool_close_waits_for_a_job_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 5: close() on the timeout path must not unregister the pool or free the scratch while
    the kernel still reads and writes them; a later close() finishes the job."""
    monkeypatch.setenv(fake.FAKE_ENV, "delay_us=400000")
    rt = fake.reset()
    sp, recs, _ = _filled()
    pp = PinnedPool(sp, backend="cuda")
    mem, rows = _rows(4)
    job = gpu_dma_async(pp.packets(recs), 4, rows, 0)
    with pytest.raises(TimeoutError, match="still running"):
        pp.close(timeout_s=0.01)
    assert rt.unsafe_frees == []
    assert len(rt.live("registered")) == 1
    pp.close(timeout_s=10)
    assert job.wait() == 4
    assert rt.unsafe_frees == [] and rt.live("registered") == []
    mem.close()
    fake.reset("1")


def test_device_error_surfaces_instead_of_in_flight(fake_cuda: fake.FakeRuntime) -> None:
    """Finding 5: after a device fault under a GPU-DMA job, its wait raises the fault, and so does
    every later launch (not "still in flight"); the pool still closes."""
    sp, recs, _ = _filled()
    pp = PinnedPool(sp, backend="cuda")
    _mem, rows = _rows(4)
    fake_cuda.inject("kernel", fake.ILLEGAL_ADDRESS)
    job = gpu_dma_async(pp.packets(recs), 4, rows, 0)
    with pytest.raises(CudaError) as e:
        job.wait(20, timeout_s=5)
    assert e.value.name == "cudaErrorIllegalAddress"
    with pytest.raises(CudaError) as e2:
        gpu_dma_async(pp.packets(recs), 4, rows, 0)
    assert e2.value.status == fake.ILLEGAL_ADDRESS
    with pytest.raises(CudaError):
        job.wait()  # the job stays failed
    pp.close()  # the context is gone; close() still releases what it holds in Python


def test_unwaited_failed_job_raises_its_error_at_the_next_launch(fake_cuda: fake.FakeRuntime) -> None:
    sp, recs, _ = _filled()
    pp = PinnedPool(sp, backend="cuda")
    _mem, rows = _rows(4)
    fake_cuda.inject("kernel", fake.LAUNCH_FAILURE)
    gpu_dma_async(pp.packets(recs), 4, rows, 0)
    fake_cuda.quiesce()
    with pytest.raises(CudaError) as e:
        gpu_dma_async(pp.packets(recs), 4, rows, 0)
    assert e.value.name == "cudaErrorLaunchFailure"


def test_freeing_under_a_running_kernel_is_caught_by_the_ledger(fake_cuda: fake.FakeRuntime) -> None:
    """The fake's ledger sees a free while work is queued and the kernel faults, as a GPU would."""
    sp, recs, _ = _filled()
    pp = PinnedPool(sp, backend="cuda")
    _mem, rows = _rows(4)
    job = gpu_dma_async(pp.packets(recs), 4, rows, 0)
    assert pp.region is not None
    pp.region.close()  # bypasses PinnedPool.close's wait on purpose
    assert fake_cuda.unsafe_frees and "cudaHostUnregister" in fake_cuda.unsafe_frees[0]
    with pytest.raises(CudaError, match="cudaErrorIllegalAddress"):
        job.wait(20, timeout_s=5)


def test_bad_rows_get_verdicts(fake_cuda: fake.FakeRuntime) -> None:
    sp, recs, _bodies = _filled()
    sp.set_header_field(int(recs[2]), 1, "request_id", 77)
    pp = PinnedPool(sp, backend="cuda")
    _mem, rows = _rows(4)
    st = np.zeros(4, np.int32)
    assert gpu_dma_async(pp.packets(recs), 4, rows, 0, statuses=st).wait() == 3
    assert st.tolist() == [0, 0, DmaStatus.MISMATCH, 0]
    pp.close()


def test_events_streams_and_sync_lite_polling(fake_cuda: fake.FakeRuntime) -> None:
    s = Stream(0)
    ev = Event(0)
    assert ev.query()  # never recorded: complete
    fake_cuda.launch_host_func(s.handle, lambda: time.sleep(0.3))
    ev.record(s)
    assert not ev.query() and not s.query()
    polls = ev.wait(1000, timeout_s=10)
    assert polls >= 2 and ev.query() and s.query()
    assert ev.last_wait_ns >= 200_000_000 and ev.achieved_interval_us >= 1000
    fake_cuda.launch_host_func(s.handle, lambda: time.sleep(0.3))
    ev.record(s)
    with pytest.raises(TimeoutError, match="not complete"):
        ev.wait(100, timeout_s=0.02)
    s.synchronize()
    ev.close()
    s.close()


def test_callback_wait_stops_on_a_device_fault(fake_cuda: fake.FakeRuntime) -> None:
    """Finding 4 (the fake follows the native slicing): CUDA never runs a host function after a fault,
    so the wait checks the stream and raises the fault instead of hanging."""
    s = Stream(0)
    rt = runtime.cuda()

    def fault() -> None:
        time.sleep(0.02)
        fake_cuda.fault(fake.ILLEGAL_ADDRESS)

    fake_cuda.launch_host_func(s.handle, fault)
    fake_cuda.launch_host_func(s.handle, lambda: time.sleep(0.01))  # never runs: the context is dead
    t0 = time.monotonic()
    with pytest.raises(CudaError, match="cudaErrorIllegalAddress"):
        rt.cuda_callback_wait(s.handle, -1)  # no deadline: only the fault check ends it
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("call,make", [
    ("cuda_malloc", lambda: runtime.DeviceMemory(64, 0)),
    ("cuda_host_alloc", lambda: runtime.PinnedBuffer(64)),
    ("cuda_host_register", lambda: PinnedPool(_filled()[0], backend="cuda")),
    ("cuda_event_create", lambda: Event(0)),
    ("cuda_stream_create", lambda: Stream(0)),
    ("cuda_memset", lambda: PinnedPool(_filled()[0], backend="cuda")._engine(0)),
    ("cuda_host_get_device_pointer", lambda: runtime.PinnedBuffer(64).device_pointer(0)),
    ("dma_launch", lambda: _launch_once()),
    ("cuda_event_record", lambda: _launch_once()),
    ("cuda_event_query", lambda: _launch_once().wait()),
    ("cuda_device_count", lambda: runtime.device_count()),
])
def test_every_error_path_raises_the_named_cuda_error_and_leaks_nothing(fake_cuda: fake.FakeRuntime, call: str,
                                                                        make: Any) -> None:
    fake_cuda.inject(call, fake.MEMORY_ALLOCATION)
    with pytest.raises(CudaError) as e:
        make()
    assert e.value.status == fake.MEMORY_ALLOCATION and e.value.is_out_of_memory
    assert e.value.call  # names the call that failed
    del e  # its traceback holds the half-built objects; their finalizers release them
    fake_cuda.quiesce()
    gc.collect()
    leaked = [r for r in fake_cuda.live() if r.kind != "stream"]
    assert leaked == [], leaked
    assert fake_cuda.unsafe_frees == []


def _launch_once() -> Any:
    sp, recs, _ = _filled(seed=5)
    pp = PinnedPool(sp, backend="cuda")
    _mem, rows = _rows(4)
    job = gpu_dma_async(pp.packets(recs), 4, rows, 0)
    job._pool = pp  # keep the pool alive with the job
    return job


def test_probe_and_backend_on_the_fake(monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 2: a runtime newer than the driver, or no kernel image for the device, is found by the
    native layer's own probe, and backend auto falls back to cpu with the reason."""
    monkeypatch.setenv(fake.FAKE_ENV, "driver=12040,runtime=13000")
    fake.reset()
    probe = backend.cuda_probe()
    assert not probe.ok and "13.0" in probe.reason and "12.4" in probe.reason and "rebuild" in probe.reason
    assert backend.resolve_backend("auto") == "cpu"
    with pytest.raises(RuntimeError, match="cannot run"):
        backend.resolve_backend("cuda")
    monkeypatch.setenv(fake.FAKE_ENV, "no_kernel_image,capability=7.0")
    fake.reset()
    probe = backend.cuda_probe()
    assert not probe.ok and "sm_7.0" in probe.reason and "cudaErrorNoKernelImageForDevice" in probe.reason
    assert backend.resolve_backend("auto") == "cpu"
    monkeypatch.setenv(fake.FAKE_ENV, "driver=12080,runtime=12040")
    fake.reset()
    probe = backend.cuda_probe()
    assert probe.ok and probe.devices[0]["kernels"]["gather_regs"] > 0
    assert backend.resolve_backend("auto") == "cuda"
    fake.reset("1")


def _ipc_child(handle: bytes, q: Any) -> None:
    try:
        rt = runtime.cuda()
        p = rt.cuda_ipc_open_mem_handle(0, handle)
        q.put(runtime._host_array(p, 8).tobytes())
        runtime._host_array(p, 8)[:] = 7
        rt.cuda_ipc_close_mem_handle(0, p)
        q.put(len(fake.runtime().live("ipc_open")))
    except Exception as e:  # reported to the parent
        q.put(repr(e))


def test_ipc_open_and_close_across_processes(fake_cuda: fake.FakeRuntime) -> None:
    rt = runtime.cuda()
    mem = runtime.DeviceMemory(4096, 0)
    runtime._host_array(mem.ptr, 8)[:] = np.arange(8, dtype=np.uint8)
    handle = rt.cuda_ipc_get_mem_handle(0, mem.ptr)
    assert len(handle) == 64
    with pytest.raises(CudaError):
        rt.cuda_ipc_open_mem_handle(0, handle)  # a process cannot open its own handle
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_ipc_child, args=(handle, q))
    p.start()
    try:
        assert q.get(timeout=60) == bytes(range(8))
        assert q.get(timeout=60) == 0
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
            p.join()
    assert runtime._host_array(mem.ptr, 8).tolist() == [7] * 8  # the child wrote through its mapping
    (res,) = [r for r in fake_cuda.live("device") if r.handle == mem.ptr]
    mem.close()
    assert not os.path.exists(f"/dev/shm/{res.keep.name}")


def _ipc_exporter(q: Any, go: Any) -> None:
    """Export 4 KiB of fake device memory filled with 1s, send its handle, then free it or exit when told."""
    try:
        rt = runtime.cuda()
        mem = runtime.DeviceMemory(4096, 0)
        runtime._host_array(mem.ptr, 4096)[:] = 1
        q.put(bytes(rt.cuda_ipc_get_mem_handle(0, mem.ptr)))
        how = go.get(timeout=120)
        if how == "free":
            mem.close()
            q.put("freed")
            go.get(timeout=120)  # stays alive: only the free is under test
        # "exit": returns without freeing; the process's exit takes the allocation with it.
    except Exception as e:  # reported to the parent
        q.put(repr(e))


def _read_op(rt: fake.FakeRuntime, p: int, kind: str, dst: runtime.DeviceMemory) -> int:
    """Queue an operation that reads 4 KiB at ``p`` (a copy into ``dst``, or a host function standing
    in for a model on imported weights) on a fresh stream; returns the stream."""
    s = int(rt.cuda_stream_create(0, 0, 0))
    if kind == "memcpy":
        rt.cuda_memcpy_async(dst.ptr, p, 4096, s)
    else:
        rt.launch_host_func(s, lambda: runtime._host_array(p, 4096).sum())
    return s


@pytest.mark.real  # a spawned exporter process
@pytest.mark.parametrize("how", ["free", "exit"])
@pytest.mark.parametrize("kind", ["memcpy", "host"])
def test_reading_ipc_memory_after_its_exporter_freed_it_or_exited_faults(
        fake_cuda: fake.FakeRuntime, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, how: str, kind: str) -> None:
    """cudaIpcOpenMemHandle: "Calling cudaFree on an exported memory region before calling
    cudaIpcCloseMemHandle in the importing context will result in undefined behavior" (and an exit frees
    everything). The fake turns that into cudaErrorIllegalAddress on the importer's next read, counted."""
    log = tmp_path / "faults.jsonl"
    monkeypatch.setenv(fake.FAULT_LOG_ENV, str(log))
    rt = fake_cuda
    ctx = mp.get_context("spawn")
    q, go = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_ipc_exporter, args=(q, go))
    child.start()
    try:
        handle = q.get(timeout=120)
        assert isinstance(handle, bytes), handle
        p = rt.cuda_ipc_open_mem_handle(0, handle)
        dst = runtime.DeviceMemory(4096, 0)
        rt.cuda_stream_synchronize(_read_op(rt, p, kind, dst))  # the exporter holds it: reads succeed
        assert runtime._host_array(p, 4096).tolist() == [1] * 4096 and rt.ipc_use_after_free == []
        go.put(how)
        if how == "free":
            assert q.get(timeout=120) == "freed"
        else:
            child.join(120)
            assert child.exitcode == 0
        with pytest.raises(CudaError) as e:
            rt.cuda_stream_synchronize(_read_op(rt, p, kind, dst))
        assert e.value.name == "cudaErrorIllegalAddress"
        assert len(rt.ipc_use_after_free) == 1 and f"pid {child.pid}" in rt.ipc_use_after_free[0]
        (logged,) = fake.read_fault_log(log)
        assert logged["fault"] == "ipc_use_after_free" and logged["owner"] == child.pid
        if how == "free":  # the freed memory was poisoned (what a read outside the fake's checks would see)
            assert set(runtime._host_array(p, 4096).tolist()) == {0xFF}
    finally:
        go.put("done")
        child.join(120)
        if child.is_alive():
            child.kill()
            child.join()


def _ipc_exporter_killed(q: Any) -> None:
    rt = runtime.cuda()
    mem = runtime.DeviceMemory(4096, 0)
    q.put(bytes(rt.cuda_ipc_get_mem_handle(0, mem.ptr)))
    time.sleep(600)  # until the parent kills it


def test_a_handle_whose_exporter_was_killed_cannot_be_opened_and_its_mapping_faults(
        fake_cuda: fake.FakeRuntime) -> None:
    rt = fake_cuda
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    child = ctx.Process(target=_ipc_exporter_killed, args=(q,))
    child.start()
    try:
        handle = q.get(timeout=120)
        rt.cuda_ipc_open_mem_handle(0, handle)
        child.kill()  # SIGKILL: nothing of the exporter's runs, its name stays on /dev/shm
        child.join(120)
        with pytest.raises(CudaError, match="cudaErrorInvalidValue"):
            rt.cuda_ipc_open_mem_handle(0, handle)  # a later importer cannot map what died with it
        rt.launch_host_func(0, lambda: None)
        with pytest.raises(CudaError, match="cudaErrorIllegalAddress"):
            rt.cuda_device_synchronize(0)
        assert len(rt.ipc_use_after_free) == 1
        assert rt.sticky == fake.ILLEGAL_ADDRESS  # the context is lost, as after a fault on a GPU
    finally:
        if child.is_alive():
            child.kill()
        child.join()


def test_isolated_probe_runs_in_a_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """The node probes without creating a CUDA context of its own: the child inherits the environment."""
    monkeypatch.setenv(fake.FAKE_ENV, "driver=12020,runtime=13000")
    probe = backend.cuda_probe(isolated=True)
    assert not probe.ok and probe.fake and "rebuild" in probe.reason
    assert backend.resolve_backend("auto", isolated=True) == "cpu"
    monkeypatch.setenv(fake.FAKE_ENV, "1")
    assert backend.cuda_probe(isolated=True).ok


_LEAKER = """
import os, signal, sys
os.environ["GPUPRIMS_FAKE_CUDA"] = "1"
from gpuprims.testing import fake
fake.runtime().cuda_malloc(0, 4096)  # never freed
print(os.getpid(), flush=True)
if sys.argv[1] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _fake_files(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"gpuprims-fakecuda-{pid}-")]


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_fake_device_memory_leaves_nothing_behind(how: str) -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _LEAKER, how], capture_output=True, text=True, timeout=120)
    pid = int(r.stdout.split()[0])
    if how == "exit":  # a process that never freed its fake allocations removes them at exit
        assert r.returncode == 0 and _fake_files(pid) == [], r.stderr
        return
    assert r.returncode == -9 and _fake_files(pid)  # SIGKILL: nothing ran at exit ...
    fake.FakeRuntime("1")  # ... the next fake runtime made on this machine removes them
    assert _fake_files(pid) == []


# -- stream capture and graphs (cudaStreamBeginCapture .. cudaGraphLaunch) ---------------------------------

def _cap_stream(rt: Any) -> int:
    return int(rt.cuda_stream_create(0, runtime.STREAM_NON_BLOCKING, 0))


def test_capture_records_instead_of_running_and_replays_in_order(fake_cuda: Any) -> None:
    rt = fake_cuda
    s = _cap_stream(rt)
    seen: list[str] = []
    rt.cuda_stream_begin_capture(s, fake.CAPTURE_MODE_GLOBAL)
    assert rt.cuda_stream_is_capturing(s) == fake.CAPTURE_STATUS_ACTIVE
    rt.launch_host_func(s, lambda: seen.append("a"))
    rt.launch_host_func(s, lambda: seen.append("b"))
    g = rt.cuda_stream_end_capture(s)
    assert rt.cuda_stream_is_capturing(s) == fake.CAPTURE_STATUS_NONE
    assert seen == []  # captured work does not run at capture
    nodes = rt.graph_nodes(g)
    assert [n.deps for n in nodes] == [(), (0,)]
    x = rt.cuda_graph_instantiate(g)
    launch = _cap_stream(rt)
    for _ in range(3):
        rt.cuda_graph_launch(x, launch)
    rt.cuda_stream_synchronize(launch)
    assert seen == ["a", "b"] * 3
    rt.cuda_graph_exec_destroy(x)
    rt.cuda_graph_destroy(g)
    with pytest.raises(CudaError) as ei:  # a destroyed executable graph
        rt.cuda_graph_launch(x, launch)
    assert ei.value.name == "cudaErrorInvalidValue"
    for h in (s, launch):
        rt.cuda_stream_destroy(h)
    assert rt.live("graph") == [] and rt.live("graph_exec") == [] and rt.live("stream") == []


def test_cross_stream_capture_forks_and_joins(fake_cuda: Any) -> None:
    rt = fake_cuda
    s, side = _cap_stream(rt), _cap_stream(rt)
    fork, join = rt.cuda_event_create(0, 2), rt.cuda_event_create(0, 2)
    seen: list[str] = []
    rt.cuda_stream_begin_capture(s, fake.CAPTURE_MODE_GLOBAL)
    rt.launch_host_func(s, lambda: seen.append("root"))
    rt.cuda_event_record(fork, s)
    rt.cuda_stream_wait_event(side, fork)  # pulls `side` into the capture
    assert rt.cuda_stream_is_capturing(side) == fake.CAPTURE_STATUS_ACTIVE
    rt.launch_host_func(side, lambda: seen.append("branch"))
    rt.launch_host_func(s, lambda: seen.append("main"))
    rt.cuda_event_record(join, side)
    rt.cuda_stream_wait_event(s, join)
    rt.launch_host_func(s, lambda: seen.append("tail"))
    g = rt.cuda_stream_end_capture(s)
    assert rt.cuda_stream_is_capturing(side) == fake.CAPTURE_STATUS_NONE
    nodes = rt.graph_nodes(g)
    assert [(n.stream, n.deps) for n in nodes] == [(s, ()), (side, (0,)), (s, (0,)), (s, (2, 1))]
    x = rt.cuda_graph_instantiate(g)
    rt.cuda_graph_launch(x, s)
    rt.cuda_stream_synchronize(s)
    assert seen[0] == "root" and seen[-1] == "tail" and sorted(seen[1:3]) == ["branch", "main"]
    rt.cuda_graph_exec_destroy(x)
    rt.cuda_graph_destroy(g)


def test_capture_with_an_unjoined_stream_fails_and_leaves_no_graph(fake_cuda: Any) -> None:
    rt = fake_cuda
    s, side = _cap_stream(rt), _cap_stream(rt)
    fork = rt.cuda_event_create(0, 2)
    rt.cuda_stream_begin_capture(s, fake.CAPTURE_MODE_GLOBAL)
    rt.cuda_event_record(fork, s)
    rt.cuda_stream_wait_event(side, fork)
    rt.launch_host_func(side, lambda: None)
    with pytest.raises(CudaError) as ei:
        rt.cuda_stream_end_capture(s)
    assert ei.value.name == "cudaErrorStreamCaptureUnjoined" and ei.value.status == 904
    # every stream left the capture, nothing was made, and the streams work again
    assert rt.cuda_stream_is_capturing(side) == fake.CAPTURE_STATUS_NONE
    assert rt.live("graph") == []
    rt.cuda_stream_synchronize(side)


@pytest.mark.parametrize("call", ["cuda_stream_synchronize", "cuda_stream_query"])
def test_synchronize_or_query_while_capturing_invalidates_the_capture(fake_cuda: Any, call: str) -> None:
    rt = fake_cuda
    s = _cap_stream(rt)
    rt.cuda_stream_begin_capture(s, fake.CAPTURE_MODE_GLOBAL)
    with pytest.raises(CudaError) as ei:
        getattr(rt, call)(s)
    assert ei.value.name == "cudaErrorStreamCaptureUnsupported"
    assert rt.cuda_stream_is_capturing(s) == fake.CAPTURE_STATUS_INVALIDATED
    with pytest.raises(CudaError) as ei:  # later work on the stream fails too
        rt.launch_host_func(s, lambda: None)
    assert ei.value.name == "cudaErrorStreamCaptureInvalidated"
    with pytest.raises(CudaError) as ei:
        rt.cuda_stream_end_capture(s)
    assert ei.value.name == "cudaErrorStreamCaptureInvalidated"
    assert rt.cuda_stream_is_capturing(s) == fake.CAPTURE_STATUS_NONE and rt.live("graph") == []


def test_capture_rules_refuse_what_cuda_refuses(fake_cuda: Any) -> None:
    rt = fake_cuda
    s, other = _cap_stream(rt), _cap_stream(rt)
    with pytest.raises(CudaError) as ei:  # EndCapture on a stream that is not capturing
        rt.cuda_stream_end_capture(s)
    assert ei.value.name == "cudaErrorIllegalState"
    with pytest.raises(CudaError) as ei:  # the legacy stream cannot be captured
        rt.cuda_stream_begin_capture(0, fake.CAPTURE_MODE_GLOBAL)
    assert ei.value.name == "cudaErrorStreamCaptureUnsupported"
    with pytest.raises(CudaError) as ei:
        rt.cuda_stream_begin_capture(s, 7)
    assert ei.value.name == "cudaErrorInvalidValue"
    # ending the capture on a joined stream instead of the origin
    fork = rt.cuda_event_create(0, 2)
    rt.cuda_stream_begin_capture(s, fake.CAPTURE_MODE_GLOBAL)
    with pytest.raises(CudaError) as ei:
        rt.cuda_stream_begin_capture(s, fake.CAPTURE_MODE_GLOBAL)
    assert ei.value.name == "cudaErrorIllegalState"
    rt.cuda_event_record(fork, s)
    with pytest.raises(CudaError) as ei:  # a captured event is not work scheduled for execution
        rt.cuda_event_query(fork)
    assert ei.value.name == "cudaErrorCapturedEvent"
    with pytest.raises(CudaError):
        rt.cuda_stream_end_capture(s)  # invalidated by the query
    rt.cuda_stream_begin_capture(s, fake.CAPTURE_MODE_GLOBAL)
    rt.cuda_event_record(fork, s)
    rt.cuda_stream_wait_event(other, fork)
    with pytest.raises(CudaError) as ei:
        rt.cuda_stream_end_capture(other)
    assert ei.value.name == "cudaErrorStreamCaptureUnmatched"
    rt.cuda_event_record(fork, other)
    rt.cuda_stream_wait_event(s, fork)
    rt.cuda_graph_destroy(rt.cuda_stream_end_capture(s))
    # waiting on an event recorded outside the capture, and the legacy stream during a global capture
    outside = rt.cuda_event_create(0, 2)
    rt.cuda_event_record(outside, other)
    rt.cuda_stream_begin_capture(s, fake.CAPTURE_MODE_GLOBAL)
    with pytest.raises(CudaError) as ei:
        rt.cuda_stream_wait_event(s, outside)
    assert ei.value.name == "cudaErrorStreamCaptureIsolation"
    with pytest.raises(CudaError):
        rt.cuda_stream_end_capture(s)
    # the legacy stream while a blocking stream captures; a non-blocking one may capture beside it
    blocking = int(rt.cuda_stream_create(0, 0, 0))
    rt.cuda_stream_begin_capture(blocking, fake.CAPTURE_MODE_GLOBAL)
    with pytest.raises(CudaError) as ei:
        rt.launch_host_func(0, lambda: None)
    assert ei.value.name == "cudaErrorStreamCaptureImplicit"
    assert rt.cuda_stream_is_capturing(blocking) == fake.CAPTURE_STATUS_INVALIDATED
    with pytest.raises(CudaError):
        rt.cuda_stream_end_capture(blocking)
    rt.cuda_stream_begin_capture(s, fake.CAPTURE_MODE_GLOBAL)
    rt.launch_host_func(0, lambda: None)  # s is non-blocking: the legacy stream does not touch it
    with pytest.raises(CudaError) as ei:
        rt.cuda_device_synchronize(0)
    assert ei.value.name == "cudaErrorStreamCaptureUnsupported"
    with pytest.raises(CudaError):
        rt.cuda_stream_end_capture(s)
    rt.cuda_stream_synchronize(0)
    assert rt.live("graph") == []


def test_end_capture_from_another_thread_is_refused_unless_relaxed(fake_cuda: Any) -> None:
    import threading

    rt = fake_cuda
    s = _cap_stream(rt)
    out: list[Any] = []

    def end() -> None:
        try:
            out.append(rt.cuda_stream_end_capture(s))
        except CudaError as e:
            out.append(e)

    rt.cuda_stream_begin_capture(s, fake.CAPTURE_MODE_GLOBAL)
    t = threading.Thread(target=end)
    t.start()
    t.join(10)
    assert isinstance(out[0], CudaError) and out[0].name == "cudaErrorStreamCaptureWrongThread"
    rt.cuda_graph_destroy(rt.cuda_stream_end_capture(s))
    rt.cuda_stream_begin_capture(s, fake.CAPTURE_MODE_RELAXED)
    t = threading.Thread(target=end)
    t.start()
    t.join(10)
    assert isinstance(out[1], int)
    rt.cuda_graph_destroy(out[1])


def test_a_host_function_may_not_call_cuda(fake_cuda: Any) -> None:
    rt = fake_cuda
    s = _cap_stream(rt)
    errors: list[CudaError] = []

    def bad() -> None:
        try:
            rt.cuda_stream_query(s)
        except CudaError as e:
            errors.append(e)

    rt.launch_host_func(s, bad)
    rt.cuda_stream_synchronize(s)
    assert [e.name for e in errors] == ["cudaErrorNotPermitted"]


def test_graph_launches_of_one_exec_are_ordered_across_streams(fake_cuda: Any) -> None:
    rt = fake_cuda
    s, a, b = _cap_stream(rt), _cap_stream(rt), _cap_stream(rt)
    seen: list[int] = []
    rt.cuda_stream_begin_capture(s, fake.CAPTURE_MODE_GLOBAL)
    rt.launch_host_func(s, lambda: (time.sleep(0.02), seen.append(len(seen))))
    x = rt.cuda_graph_instantiate(g := rt.cuda_stream_end_capture(s))
    for i in range(4):
        rt.cuda_graph_launch(x, a if i % 2 else b)
    rt.cuda_stream_synchronize(a)
    rt.cuda_stream_synchronize(b)
    assert seen == [0, 1, 2, 3]
    rt.cuda_graph_exec_destroy(x)
    rt.cuda_graph_destroy(g)


def test_a_thread_local_capture_lets_other_threads_synchronize(fake_cuda: Any) -> None:
    import threading

    rt = fake_cuda
    s = _cap_stream(rt)
    rt.cuda_stream_begin_capture(s, fake.CAPTURE_MODE_THREAD_LOCAL)
    errors: list[BaseException] = []

    def other() -> None:
        try:
            rt.cuda_device_synchronize(0)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=other)
    t.start()
    t.join(30)
    assert errors == [] and rt.cuda_stream_is_capturing(s) == fake.CAPTURE_STATUS_ACTIVE
    with pytest.raises(CudaError, match="cudaErrorStreamCaptureUnsupported"):
        rt.cuda_device_synchronize(0)  # from the capturing thread it is refused
    with pytest.raises(CudaError, match="cudaErrorStreamCaptureInvalidated"):
        rt.cuda_stream_end_capture(s)
