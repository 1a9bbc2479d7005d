"""CUDA primitives of the paper (V-A Sync-lite, V-B GPU-DMA, V-E Param-Share), their baselines, and
CPU-backend equivalents with the same API.

Names are imported lazily on first use, so ``import gpuprims.cuda`` loads neither torch nor the
native extension and never touches the GPU (CONTRIBUTING.md, house style 6).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    # errors
    "CudaError": "errors", "CudaUnavailableError": "errors", "check_status": "errors",
    # runtime
    "DeviceMemory": "runtime", "PinnedBuffer": "runtime", "PinnedRegion": "runtime", "device_count": "runtime",
    "set_schedule": "runtime", "get_schedule": "runtime", "mem_get_info": "runtime", "kernels_built": "runtime",
    # events and streams
    "Event": "event", "Stream": "event", "CpuEvent": "event", "CpuStream": "event", "stream_handle": "event",
    # CUDA graphs
    "CudaGraph": "graph", "capture_plan": "graph",
    # GPU-DMA
    "gpu_dma": "dma", "gpu_dma_async": "dma", "cuda_copy_gather": "dma", "DmaJob": "dma", "DmaStatus": "dma",
    "Normalize": "dma", "IMAGENET": "dma", "UNIT": "dma", "DeviceRows": "dma", "Packets": "dma", "PinnedPool": "dma", "PoolLayout": "dma",
    # Sync-lite
    "sync_lite": "sync", "sync_blocking": "sync", "sync_callback": "sync", "AdaptiveWait": "sync",
    "default_cpu_stream": "sync",
    # Param-Share
    "export_parameters": "ipc", "share_parameters": "ipc", "ExportedParameters": "ipc",
    "SharedParameters": "ipc", "ParameterHandles": "ipc", "TensorEntry": "ipc",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gpuprims.cuda' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"gpuprims.cuda.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
