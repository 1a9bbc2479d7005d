"""What ONNX Runtime's two engines set up alike: the session options and the CUDA provider's options,
for a zoo model's ONNX export (``engine: onnxruntime``) and a model file (``gpuprims.engines.file_onnx``).
Torch-free, as the file engine is; the module is handed in (``ort``), so tests may pass a stand-in.
"""

from __future__ import annotations

import os
from typing import Any

from gpuprims.cuda.event import stream_handle


def default_threads() -> int:
    """The CPUs this process may run on (its affinity, which an instance's share sets)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def session_options(ort: Any, threads: int, level: str) -> Any:
    """``SessionOptions`` for one instance: `threads` intra-op threads, sequential, the optimization
    `level` (a ``GraphOptimizationLevel`` name), idle threads that block, and errors-only logging."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    # Idle pool threads block instead of spinning: they would burn the neighbouring app's core.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    so.log_severity_level = 3  # errors only: ORT's warnings go to stderr, not our log
    return so


def cuda_provider_options(device_index: int, stream: Any) -> tuple[dict[str, str], int]:
    """The CUDA provider's options on `device_index`, with the instance's `stream` as its compute
    stream when it has one, and that stream's handle (0: the legacy default stream, which ORT takes
    for "no stream given")."""
    options: dict[str, str] = {"device_id": str(device_index)}
    handle = stream_handle(stream)
    if handle:
        options.update(has_user_compute_stream="1", user_compute_stream=str(handle))
    return options, handle
