"""The front door's shared core: how long one row waits for the node's answer."""

from __future__ import annotations

from gpuprims.client import DEFAULT_TIMEOUT_S
from orchestrator.frontdoor.core import Core
from orchestrator.frontdoor.models import ModelInfo


def test_a_row_waits_for_the_deadline_the_request_carries() -> None:
    """A request's own deadline (the OIP 'timeout' parameter) longer than the SLO is waited for."""
    info = ModelInfo(name="m", app_id=1, input_shape=(3,), dtype="float32", output_dim=2, max_batch=4,
                     max_wait_ms=1.0, slo_ms=100.0, instances=1)
    core = Core([info], client=None)  # type: ignore[arg-type]  # the timeout needs no client
    assert core.row_timeout_s(info) == DEFAULT_TIMEOUT_S  # 3 x 100 ms is below the floor
    assert core.row_timeout_s(info, 10_000_000) == 30.0  # three of its own 10 s deadlines
    assert Core([info], client=None, timeout_s=0.5).row_timeout_s(info, 10_000_000) == 0.5  # type: ignore[arg-type]
