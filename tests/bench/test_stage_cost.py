"""bench/stage_cost's heartbeat comparison: both ways give the same figures, so the bench times equal work."""

from __future__ import annotations

import numpy as np

from bench.stage_cost import full_stats, heartbeat_cost, numpy_snapshot


def test_the_heartbeat_snapshot_gives_numpys_figures_on_full_statistics() -> None:
    stats = full_stats(seed=4)
    assert len(stats.latencies_ms) == stats.latencies_ms.size and stats.stages.batches == stats.stages.window
    ours = stats.snapshot(queue_len=0, held=0)
    ref = numpy_snapshot(stats, stats.latencies_ms.values(), stats.model_ms.values())
    for key in ("p50_ms", "p99_ms", "model_p50_ms"):
        np.testing.assert_allclose(ours[key], ref[key], rtol=1e-12)
    assert {s: ours["stages"][s] for s in ref["stages"]} == ref["stages"]
    assert ours["hist"] == ref["hist"]


def test_heartbeat_cost_times_each_way_every_round() -> None:
    got = heartbeat_cost(3)
    assert set(got) == {"gpuprims", "numpy"}
    assert all(len(v) == 3 and all(x >= 0 for x in v) for v in got.values())
