from __future__ import annotations

import multiprocessing as mp
import pickle
import shutil
import subprocess
import sys

import pytest

from gpuprims.backend import cuda_available
from gpuprims.cuda import CudaError, CudaUnavailableError, check_status, runtime
from gpuprims.cuda.errors import CUDA_ERROR_MEMORY_ALLOCATION, CUDA_ERROR_NO_DEVICE

needs_kernels = pytest.mark.skipif(not runtime.kernels_built(), reason="extension built without CUDA (no nvcc)")


def test_cuda_error_fields_message_and_pickle() -> None:
    e = CudaError(2, "cudaErrorMemoryAllocation", "out of memory", "cudaMalloc")
    assert (e.status, e.name, e.message, e.call) == (2, "cudaErrorMemoryAllocation", "out of memory", "cudaMalloc")
    assert str(e) == "cudaMalloc: cudaErrorMemoryAllocation (2): out of memory"
    assert e.is_out_of_memory
    back = pickle.loads(pickle.dumps(e))
    assert isinstance(back, CudaError) and back.args == e.args
    assert (back.status, back.name, back.message, back.call) == (e.status, e.name, e.message, e.call)
    assert isinstance(e, RuntimeError)


@needs_kernels
def test_check_status_uses_the_runtime_names() -> None:
    check_status(0)
    with pytest.raises(CudaError) as info:
        check_status(CUDA_ERROR_MEMORY_ALLOCATION, "cudaMalloc")
    assert info.value.name == "cudaErrorMemoryAllocation"
    assert info.value.call == "cudaMalloc" and info.value.message
    with pytest.raises(CudaError, match="cudaErrorNoDevice"):
        check_status(CUDA_ERROR_NO_DEVICE)


@needs_kernels
def test_native_choke_point_raises_cuda_error() -> None:
    native = runtime.native()
    native.cuda_raise(0, "nothing")
    with pytest.raises(CudaError) as info:
        native.cuda_raise(700, "cudaMemcpy")
    assert (info.value.status, info.value.name, info.value.call) == (700, "cudaErrorIllegalAddress", "cudaMemcpy")


@needs_kernels
@pytest.mark.skipif(cuda_available(), reason="checks the error a machine without a GPU driver gives")
def test_real_cuda_call_without_driver_raises_cuda_error() -> None:
    from gpuprims.cuda import Event

    with pytest.raises(CudaError) as info:
        Event(0)
    assert info.value.name in ("cudaErrorInsufficientDriver", "cudaErrorNoDevice")
    assert pickle.loads(pickle.dumps(info.value)).status == info.value.status
    with pytest.raises(CudaError):
        runtime.device_count()


def _child_uses_cuda(q: mp.Queue) -> None:  # type: ignore[type-arg]
    try:
        runtime.cuda()
        q.put("allowed")
    except CudaUnavailableError as exc:
        q.put(str(exc))


@needs_kernels
def test_forked_child_after_cuda_use_is_told_to_use_spawn() -> None:
    try:
        runtime.device_count()  # reaches the runtime (fails without a driver; that still counts)
    except CudaError:
        pass
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_uses_cuda, args=(q,))
    p.start()
    try:
        msg = q.get(timeout=30)
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
            p.join()
    assert "spawn" in msg and "forked" in msg


def test_importing_gpuprims_cuda_loads_neither_torch_nor_the_extension() -> None:
    code = ("import sys, gpuprims.cuda as c; c.__all__; "
            "print('torch' in sys.modules, 'gpuprims._native' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_lazy_exports_resolve_and_unknown_name_fails() -> None:
    import gpuprims.cuda as c

    for name in c.__all__:
        assert getattr(c, name) is not None
    assert "gpu_dma" in dir(c)
    with pytest.raises(AttributeError, match="no_such_thing"):
        c.no_such_thing  # noqa: B018


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_kernels_built_where_nvcc_is() -> None:
    assert runtime.kernels_built()

# The build without CUDA is checked for real in tests/gpuprims/test_build.py.
