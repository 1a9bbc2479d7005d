"""gpuprims: multiplex DNN inference services on the GPUs of an edge server.

The paper's primitives are importable from here: ``from gpuprims import sync_lite``. Names load
lazily, so importing this package loads neither torch nor the native extension (nor numpy: the
backend probes load on first use too) and never touches the GPU: backends probe CUDA only when asked
(CONTRIBUTING.md, house style 6). ``gpuprims.__version__`` is all that a command-line client (the
orchestrator's ``status``) pays for.
"""

from __future__ import annotations

import importlib
from typing import Any

from gpuprims._version import __version__ as __version__

_LAZY: dict[str, str] = {
    # which backends this process can use (gpuprims.backend imports numpy through the CUDA runtime)
    "cuda_available": "gpuprims.backend", "cuda_kernels_built": "gpuprims.backend",
    "native_available": "gpuprims.backend",
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

__all__ = sorted(["__version__", *_LAZY])


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gpuprims' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
