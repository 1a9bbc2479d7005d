from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

#: Set by ``make test-fast``: a test whose setup or call takes longer than this many seconds of wall time
#: fails, naming the marks that move it out of the fast tier. Unset (``make test``): no limit.
FAST_LIMIT_ENV = "GPUPRIMS_FAST_TEST_LIMIT_S"


def fast_limit_s() -> float | None:
    """The fast tier's limit per test phase, from :data:`FAST_LIMIT_ENV`, or None when it is not set."""
    raw = os.environ.get(FAST_LIMIT_ENV, "").strip()
    if not raw:
        return None
    try:
        limit = float(raw)
    except ValueError:
        raise pytest.UsageError(f"{FAST_LIMIT_ENV} must be seconds (a number), got {raw!r}") from None
    if not limit > 0:
        raise pytest.UsageError(f"{FAST_LIMIT_ENV} must be > 0 seconds, got {raw!r}")
    return limit


_FAST_LIMIT = pytest.StashKey[float | None]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_FAST_LIMIT] = fast_limit_s()  # read once: a bad value stops the run before any test


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """In the fast tier, a passing setup or call that took longer than its limit is reported failed, so a
    slow test cannot join the tier unseen (teardown is not held to it: a module's shared servers end
    there)."""
    outcome = yield
    limit = item.config.stash.get(_FAST_LIMIT, None)
    report = outcome.get_result()  # type: ignore[attr-defined]
    if limit is None or report.when not in ("setup", "call") or not report.passed or report.duration <= limit:
        return
    report.outcome = "failed"
    report.longrepr = (f"{item.nodeid}: its {report.when} took {report.duration:.1f} s of wall time, more than the "
                       f"fast tier's {limit:g} s ({FAST_LIMIT_ENV}, set by make test-fast). Make it faster, or mark it "
                       "real (it starts nodes, instances, the CLI, compilers or child interpreters) or slow.")


def _has_gpu() -> bool:
    from gpuprims.backend import cuda_available

    return cuda_available()


def _module_rank(items: list[pytest.Item]) -> int:
    """0 for a module with a ``heavy`` test, 1 with a ``slow`` or ``real`` one, else 2."""
    if any("heavy" in i.keywords for i in items):
        return 0
    return 1 if any("slow" in i.keywords or "real" in i.keywords for i in items) else 2


def _longest_modules_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: the modules with heavy tests first, then those with slow or real ones,
    then the rest; each module's tests stay together and in their order. pytest-xdist's ``loadscope``
    hands modules to its workers in this order, so the longest start first and none is left to run
    alone at the end (make test on two workers: the zoo's engine comparisons are one module of minutes)."""
    by_module: dict[object, list[pytest.Item]] = {}
    for item in items:
        by_module.setdefault(item.module if isinstance(item, pytest.Function) else item.parent, []).append(item)
    groups = sorted(by_module.values(), key=_module_rank)  # stable: collection order within a rank
    items[:] = [item for group in groups for item in group]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _longest_modules_first(items)
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
    """The nodes of this session share this process's fork servers (orchestrator.node.launcher.ForkLauncher);
    they end, and are reaped, with the session."""
    yield
    from orchestrator.node.launcher import ForkLauncher

    ForkLauncher.close_all()


#: How long a module's last node may take to have its instances reported reaped by the fork servers.
FORKED_REAP_S = 30.0


@pytest.fixture(scope="module", autouse=True)
def _no_forked_instance_outlives_its_module(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every node a test module starts is stopped by the module's end: no instance forked by this
    process's fork servers is still alive then (a node left running keeps its instances, and the next
    module's count of them, or its CPU, is off). The module's last test errors, naming it, if one is."""
    yield
    from orchestrator.node.launcher import ForkLauncher

    deadline = time.monotonic() + FORKED_REAP_S
    live = sum(s["children"] for s in ForkLauncher.describe())
    while live and time.monotonic() < deadline:
        time.sleep(0.1)
        live = sum(s["children"] for s in ForkLauncher.describe())
    if live:
        pytest.fail(f"{request.module.__name__} left {live} forked instance(s) alive {FORKED_REAP_S:g} s after "
                    "its last test: a node it started was never stopped")


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> object:
    """This process on the fake CUDA runtime (gpuprims.testing.fake) for one test; a fresh runtime whose
    ledger the test may inspect. Afterwards its streams are drained."""
    from gpuprims.testing import fake

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
