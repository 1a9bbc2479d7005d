from __future__ import annotations

import pytest


def _has_gpu() -> bool:
    from gpuprims.backend import cuda_available

    return cuda_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any("gpu" in item.keywords for item in items):
        return
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with a driver; none is present here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
