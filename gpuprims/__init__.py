"""gpuprims: multiplex DNN inference services on the GPUs of an edge server.

Importing this package never touches the GPU: backends probe CUDA lazily (STYLE.md 6).
"""

from __future__ import annotations

from gpuprims._version import __version__
from gpuprims.backend import cuda_available, cuda_kernels_built, native_available

__all__ = ["__version__", "cuda_available", "cuda_kernels_built", "native_available"]
