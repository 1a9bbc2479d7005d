"""An instance's latency statistics: counters and bounded reservoirs, read by the heartbeat."""

from __future__ import annotations

import collections
import time
from typing import Any

from gpuprims.stats import RequestHistograms, Reservoir, StageClock


class LatencyStats:
    """Counters and a bounded reservoir of recent latencies for the heartbeat."""

    def __init__(self, slo_ms: float, window: int = 4096) -> None:
        self.slo_ms = slo_ms
        self.latencies_ms = Reservoir(window)
        self.model_ms = Reservoir(512)
        self.counts: collections.Counter[str] = collections.Counter()
        self.batch_sizes: collections.Counter[int] = collections.Counter()
        self.busy_ms = 0.0  # time spent running the model
        self.hist = RequestHistograms()  # request, queue and compute durations (Prometheus histograms)
        self.stages = StageClock()  # per-batch stage breakdown (gpuprims.stats.STAGES)
        self.started = time.monotonic()
        # The data path's view of a switch (CLOCK_MONOTONIC ns, the same clock in every process):
        # when the first request this instance took had arrived, when it answered first and last, and
        # the model time of that first answered batch.
        self.first_request_ns = 0
        self.first_ok_ns = 0
        self.last_ok_ns = 0
        self.first_model_ms: float | None = None
        self._pct_key: tuple[int, int, int] | None = None  # what _pct was computed from
        self._pct: tuple[Any, ...] = ()

    def mark_answered(self, model_ms: float) -> None:
        """Note a batch just answered OK (and the model's run time for it)."""
        now = time.monotonic_ns()
        if not self.first_ok_ns:
            self.first_ok_ns = now
            self.first_model_ms = round(model_ms, 3)
        self.last_ok_ns = now

    def snapshot(self, queue_len: int, held: int) -> dict[str, Any]:
        """The heartbeat's view. Taken on the serving thread between batches, so its percentiles are
        partitions of numpy rings (``gpuprims.stats``), recomputed only when something was answered
        since the last snapshot (bench/stage_cost ``heartbeat``)."""
        key = (self.latencies_ms.added, self.model_ms.added, self.stages.batches)
        if key != self._pct_key:
            p50, p99 = self.latencies_ms.percentiles((50, 99)) or (None, None)
            model = self.model_ms.percentiles((50,))
            self._pct = (p50, p99, model[0] if model else None, self.stages.snapshot())
            self._pct_key = key
        p50, p99, model_p50, stages = self._pct
        elapsed = max(time.monotonic() - self.started, 1e-9)
        ok = self.counts["ok"]
        within = self.counts["within_slo"]
        served = ok + self.counts["deadline_missed"] + self.counts["error"]
        return {
            "received": self.counts["received"],
            "ok": ok,
            "deadline_missed": self.counts["deadline_missed"],
            "early_dropped": self.counts["early_dropped"],  # of deadline_missed: given up on under a backlog
            "errors": self.counts["error"],
            "within_slo": within,
            "slo_attainment": (within / served) if served else None,
            "p50_ms": p50,
            "p99_ms": p99,
            "model_p50_ms": model_p50,
            "arrival_rps": self.counts["received"] / elapsed,
            "service_rps": served / elapsed,
            "queue_len": queue_len,
            "held": held,
            "busy_ms": self.busy_ms,
            "batches": sum(self.batch_sizes.values()),
            "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
            "hist": self.hist.to_wire(),
            "stages": stages,
            "first_request_ns": self.first_request_ns,
            "first_ok_ns": self.first_ok_ns,
            "last_ok_ns": self.last_ok_ns,
            "first_model_ms": self.first_model_ms,
            "uptime_s": elapsed,
        }
