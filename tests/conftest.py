from __future__ import annotations

import os
from collections.abc import Iterator

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


@pytest.fixture(scope="session", autouse=True)
def _fork_servers_reaped() -> Iterator[None]:
    """The nodes of this session share this process's fork servers (orchestrator.launcher.ForkLauncher);
    they end, and are reaped, with the session."""
    yield
    from orchestrator.launcher import ForkLauncher

    ForkLauncher.close_all()


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


@pytest.fixture(autouse=True)
def _cpu_affinity_unchanged() -> Iterator[None]:
    """A test that confines this process to some cores (an in-process runner applying its share) must put
    them back: every later test would otherwise run on fewer cores (the overflow tests read the host as a
    1-core machine). The affinity is restored and the test that left it changed fails, named."""
    before = os.sched_getaffinity(0)
    yield
    after = os.sched_getaffinity(0)
    if after != before:
        os.sched_setaffinity(0, before)
        pytest.fail(f"the test left this process's CPU affinity at {sorted(after)} (was {sorted(before)})")
