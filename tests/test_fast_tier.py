"""The fast tier's time limit (tests/conftest.py): a test slower than GPUPRIMS_FAST_TEST_LIMIT_S fails."""

from __future__ import annotations

import pytest

from tests.conftest import FAST_LIMIT_ENV

pytest_plugins = ["pytester"]

#: The inner runs load no plugin they do not need (each is a whole pytest session in this process).
QUIET = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:timeout")
INNER = """
import time

def test_quick():
    pass

def test_slow():
    time.sleep(0.5)  # the slow test the limit is about (not a wait for a condition)
"""


@pytest.fixture
def inner(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest("from tests.conftest import pytest_configure, pytest_runtest_makereport  # noqa: F401\n")
    pytester.makepyfile(test_inner=INNER)
    return pytester


def test_a_test_over_the_limit_fails_and_names_the_way_out(inner: pytest.Pytester,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAST_LIMIT_ENV, "0.2")
    result = inner.runpytest(*QUIET)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_slow: its call took * s of wall time, more than the fast tier's 0.2 s*"
                                 "mark it real*"])


def test_without_the_limit_nothing_is_timed(inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAST_LIMIT_ENV, raising=False)
    inner.runpytest(*QUIET).assert_outcomes(passed=2)


@pytest.mark.parametrize("bad", ["ten", "0", "-1"])
def test_a_bad_limit_stops_the_run(inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv(FAST_LIMIT_ENV, bad)
    result = inner.runpytest(*QUIET)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{FAST_LIMIT_ENV} must be*"])
