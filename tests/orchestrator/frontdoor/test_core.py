"""The front door's shared core: how long one row waits for the node's answer."""

from __future__ import annotations

import asyncio
import time

import pytest

from gpuprims.client import DEFAULT_TIMEOUT_S
from orchestrator.frontdoor.core import Core, OipError
from orchestrator.frontdoor.models import ModelInfo


def test_a_row_waits_for_the_deadline_the_request_carries() -> None:
    """A request's own deadline (the OIP 'timeout' parameter) longer than the SLO is waited for."""
    info = ModelInfo(name="m", app_id=1, input_shape=(3,), dtype="float32", output_dim=2, max_batch=4,
                     max_wait_ms=1.0, slo_ms=100.0, instances=1)
    core = Core([info], client=None)  # type: ignore[arg-type]  # the timeout needs no client
    assert core.row_timeout_s(info) == DEFAULT_TIMEOUT_S  # 3 x 100 ms is below the floor
    assert core.row_timeout_s(info, 10_000_000) == 30.0  # three of its own 10 s deadlines
    assert Core([info], client=None, timeout_s=0.5).row_timeout_s(info, 10_000_000) == 0.5  # type: ignore[arg-type]


@pytest.mark.slow
def test_admit_sheds_only_while_the_loop_runs_behind_and_the_watch_sleeps_when_idle() -> None:
    info = ModelInfo(name="m", app_id=1, input_shape=(3,), dtype="float32", output_dim=2, max_batch=4,
                     max_wait_ms=1.0, slo_ms=100.0, instances=1)
    core = Core([info], client=None)  # type: ignore[arg-type]  # admission needs no transport
    assert core.shed_limit_ms(info) == 100.0 and core._tick_s() == 0.05  # the SLO; a tick of half that

    async def run() -> None:
        core.lag_idle_after_s = 0.05
        watch = asyncio.create_task(core.watch_lag(tick_s=0.005))
        try:
            core.admit(info)  # nothing watched yet: no lag
            deadline = time.monotonic() + 30
            while core._tick_due is not None:  # idle: the watch stops ticking
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            assert core.lag_s() == 0.0
            core.admit(info)  # the first inference after idle is admitted and wakes the watch
            core.lag_idle_after_s = 3600.0  # and it keeps watching from now on
            while core._tick_due is None:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.001)
            # One stall is not overload: the next inference is served.
            time.sleep(0.3)
            await asyncio.sleep(0.001)
            core.admit(info)
            # Every turn of the loop takes 300 ms: once three ticks in a row ran later than the 100 ms SLO,
            # inferences are shed.
            while core.lag_s() <= 0.1:
                assert time.monotonic() < deadline
                time.sleep(0.3)
                await asyncio.sleep(0.001)
            with pytest.raises(OipError) as e:
                core.admit(info)
            assert e.value.kind == "unavailable" and "100 ms SLO" in str(e.value)
            assert core.shed == {"m": 1} and core.stats["m"].totals().oip["statuses"] == {"SHED": 1}
            core.shed_lag_fraction = None  # shedding off: admitted however late
            core.admit(info)
            core.shed_lag_fraction = 1.0
            while core.lag_s() > 0.05:  # caught up once a tick runs on time
                assert time.monotonic() < deadline
                await asyncio.sleep(0.001)
            core.admit(info)
            assert core.shed == {"m": 1}
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
        assert core.lag_s() == 0.0

    asyncio.run(run())
