"""gpuprims: multiplex DNN inference services on the GPUs of an edge server.

The paper's primitives are importable from here: ``from gpuprims import sync_lite``. Names load
lazily, so importing this package loads neither torch nor the native extension and never touches
the GPU: backends probe CUDA only when asked (CONTRIBUTING.md, house style 6).
"""

from __future__ import annotations

import importlib
from typing import Any

from gpuprims._version import __version__ as __version__
from gpuprims.backend import cuda_available as cuda_available
from gpuprims.backend import cuda_kernels_built as cuda_kernels_built
from gpuprims.backend import native_available as native_available

_LAZY: dict[str, str] = {
    # V-A Sync-lite, V-B GPU-DMA, V-E Param-Share (with their baselines)
    "sync_lite": "gpuprims.cuda", "sync_blocking": "gpuprims.cuda", "sync_callback": "gpuprims.cuda",
    "gpu_dma": "gpuprims.cuda", "cuda_copy_gather": "gpuprims.cuda", "PinnedPool": "gpuprims.cuda",
    "export_parameters": "gpuprims.cuda", "share_parameters": "gpuprims.cuda", "CudaError": "gpuprims.cuda",
    "Event": "gpuprims.cuda", "Stream": "gpuprims.cuda",
    # V-D Multi-Model, V-F Batch-Latency, IV-C knee
    "multi_model": "gpuprims.sched", "batch_latency": "gpuprims.sched", "knee": "gpuprims.profile",
    # the data path
    "PacketPool": "gpuprims.pool", "Ingest": "gpuprims.ingest",
}

__all__ = sorted(["__version__", "cuda_available", "cuda_kernels_built", "native_available", *_LAZY])


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gpuprims' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
