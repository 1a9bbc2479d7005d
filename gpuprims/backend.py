"""Which compute backends this process can use, probed lazily.

`cuda_available()` asks the CUDA driver through torch only when called, never at import, and only
counts a device if torch was built with CUDA and a driver answers.
"""

from __future__ import annotations

import functools
from typing import Literal

BackendName = Literal["cpu", "cuda"]


@functools.cache
def native_available() -> bool:
    """True if the private native extension gpuprims._native imports."""
    try:
        from gpuprims import _native  # noqa: F401
    except ImportError:
        return False
    return True


def cuda_kernels_built() -> bool:
    """True if the native extension was built with its CUDA kernels (nvcc was found at build)."""
    if not native_available():
        return False
    from gpuprims import _native

    return bool(_native.CUDA_KERNELS_BUILT)


def cuda_available() -> bool:
    """True if torch sees at least one CUDA device with a working driver.

    This initialises nothing until called; after a call torch has queried the driver (but created
    no context), so call it in the process that will use the GPU, not in a parent that forks.
    """
    try:
        import torch
    except ImportError:
        return False
    if not torch.backends.cuda.is_built():
        return False
    try:
        return bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0
    except RuntimeError:
        return False


def resolve_backend(requested: str) -> BackendName:
    """Map 'auto' / 'cpu' / 'cuda' to the backend that will run, refusing cuda where there is none."""
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"backend must be 'auto', 'cpu' or 'cuda', got {requested!r}")
    if requested == "cpu":
        return "cpu"
    has_cuda = cuda_available()
    if requested == "cuda" and not has_cuda:
        raise RuntimeError("backend 'cuda' was requested but no CUDA device with a driver is present")
    return "cuda" if has_cuda else "cpu"
