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


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> object:
    """This process on the fake CUDA runtime (gpuprims.cuda.fake) for one test; a fresh runtime whose
    ledger the test may inspect. Afterwards its streams are drained."""
    from gpuprims.cuda import fake

    monkeypatch.setenv(fake.FAKE_ENV, "delay_us=300")
    rt = fake.reset()
    yield rt
    rt.quiesce()
    fake.reset("1")
