"""The per-app statistics record every part of the node updates and reads: :class:`AppStatistics`
(the instances' heartbeats, the banking of a gone instance, the front door's inferences), the front
door's counts and the node's load. Readers: the node's ``status``, Prometheus
(:mod:`orchestrator.node.metrics`) and the front door's statistics extension.

Counters are cumulative since an instance started, so a lost heartbeat loses nothing; an app's
counters add the banked counts of its gone instances to its live ones', so they never go backwards.
Durations are the instances' fixed-bucket histograms (`gpuprims.stats.RequestHistograms`), which add
up exactly across instances.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuprims.stats import RequestHistograms, add_wire
from orchestrator.control.records import SERVING_ROLES, AppTotals, InstanceStats, Role

#: Status rates are over about this many seconds of heartbeats (not since the instance started).
RATE_WINDOW_S = 5.0
#: Cumulative counters of an instance's heartbeat that its app adds up (and banks when it goes).
COUNTERS = ("received", "ok", "deadline_missed", "errors", "within_slo", "busy_ms")
__all__ = ["COUNTERS", "RATE_WINDOW_S", "SERVING_ROLES", "AppStatistics", "Duration", "FrontDoorCounts",
           "NodeLoad", "merged_histograms"]


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


@dataclass
class Duration:
    """A Triton ``StatisticDuration``: how many, and their total in ns."""

    count: int = 0
    ns: int = 0

    def add(self, ns: int) -> None:
        self.count += 1
        self.ns += max(0, int(ns))

    def as_dict(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class FrontDoorCounts:
    """What the front door counts of an app's inferences (one inference = N rows = N wire requests)."""

    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    node: Duration = field(default_factory=Duration)  # successful inferences' round trips through the node
    inference_count: int = 0  # rows answered OK
    execution_count: int = 0  # inferences answered OK
    last_inference_ms: int = 0  # Unix time of the last inference answered OK
    statuses: dict[str, int] = field(default_factory=dict)  # row answers by wire status name (LOST: none)
    admitted: dict[int, int] = field(default_factory=dict)  # inferences admitted, by priority level
    refused: dict[tuple[int, str], int] = field(default_factory=dict)  # refused, by (level, reason)

    def as_dict(self) -> dict[str, Any]:
        refused: dict[str, dict[str, int]] = {}
        for (level, reason), n in sorted(self.refused.items()):
            refused.setdefault(str(level), {})[reason] = n
        return {"success": self.success.as_dict(), "fail": self.fail.as_dict(), "node": self.node.as_dict(),
                "inference_count": self.inference_count, "execution_count": self.execution_count,
                "last_inference_ms": self.last_inference_ms, "statuses": dict(self.statuses),
                "admission": {"admitted": {str(k): n for k, n in sorted(self.admitted.items())}, "refused": refused}}


@dataclass(frozen=True)
class NodeLoad:
    """What an app's live instances said in their last heartbeats, summed: the front door's admission
    reads it (orchestrator/frontdoor/admission.py). Cumulative counters since each instance started."""

    held: int = 0  # requests queued or running at the instances
    batches: int = 0
    rows_run: int = 0  # requests run through the model (answered OK or with a model error)
    busy_ms: float = 0.0  # time spent running the model
    instances: int = 0  # live instances that heartbeat


@dataclass
class _Live:
    stats: InstanceStats
    history: list[tuple[float, float, float]]  # (t, received, answered) of recent heartbeats


class AppStatistics:
    """The one statistics record of an app; thread-safe (the front door counts from its own thread).

    It keeps the last heartbeat of each live instance (with rates over the last `RATE_WINDOW_S`), the
    banked counters, batch sizes and duration histograms of the instances that have gone, and the
    front door's counts. `totals` is the app's part of ``status`` (and so of Prometheus);
    `model_statistics` is the OIP statistics extension's answer for the app.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, _Live] = {}
        self._retired: dict[str, Any] = {}
        self._retired_sizes: dict[str, int] = {}
        self._retired_hist: dict[str, Any] = {}
        self._door = FrontDoorCounts()

    def beat(self, instance: str, stats: InstanceStats, now_s: float) -> InstanceStats:
        """Record an instance's heartbeat ``stats`` received at ``now_s`` (monotonic seconds).

        Returns the record kept (``stats`` with ``arrival_rps`` / ``service_rps`` over the last few
        seconds of heartbeats rather than since the instance started).
        """
        rec = stats
        with self._lock:
            live = self._live.get(instance)
            if live is None:
                live = self._live[instance] = _Live(rec, [])
            hist = live.history
            hist.append((now_s, float(rec.received), float(rec.answered)))
            while len(hist) > 2 and now_s - hist[1][0] >= RATE_WINDOW_S:
                hist.pop(0)
            (t0, r0, s0), (t1, r1, s1) = hist[0], hist[-1]
            if t1 - t0 > 0.2:
                rec = dataclasses.replace(rec, arrival_rps=(r1 - r0) / (t1 - t0), service_rps=(s1 - s0) / (t1 - t0))
            live.stats = rec
        return rec

    def retire(self, instance: str) -> None:
        """Bank what a gone instance counted (its last heartbeat), so the app's counters, batch counts
        and duration histograms never go back when an instance is replaced (Overlapped-Execution, a
        crash restart). Unknown names and malformed histograms are ignored."""
        with self._lock:
            live = self._live.pop(instance, None)
            if live is None:
                return
            s = live.stats
            for k in COUNTERS:
                self._retired[k] = self._retired.get(k, 0) + getattr(s, k)
            _add_sizes(self._retired_sizes, s.batch_sizes)
            with contextlib.suppress(ValueError):
                self._retired_hist = add_wire(self._retired_hist, s.hist)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the records of instances not in ``keep`` without banking them (shadows that exited:
        they served nothing)."""
        names = set(keep)
        with self._lock:
            for gone in [n for n in self._live if n not in names]:
                del self._live[gone]

    def record_inference(self, *, rows: int, duration_ns: int, ok: bool, statuses: Mapping[str, int],
                         node_ns: int | None = None) -> None:
        """One front-door inference of ``rows`` rows took ``duration_ns`` (``node_ns`` of it in the node:
        from its rows' submit to their answers, default the whole); ``statuses`` counts its rows'
        answers by wire status name (``LOST`` for a row that got none)."""
        with self._lock:
            d = self._door
            (d.success if ok else d.fail).add(duration_ns)
            if ok:
                d.node.add(duration_ns if node_ns is None else node_ns)
                d.inference_count += rows
                d.execution_count += 1
                d.last_inference_ms = int(time.time() * 1e3)
            for k, n in statuses.items():
                d.statuses[k] = d.statuses.get(k, 0) + int(n)

    def record_admission(self, level: int, reason: str | None) -> None:
        """One inference at the front door's admission: admitted at priority ``level`` (``reason``
        None), or refused for ``reason`` (``queue_full``, ``predicted_late``)."""
        with self._lock:
            d = self._door
            if reason is None:
                d.admitted[level] = d.admitted.get(level, 0) + 1
            else:
                d.refused[(level, reason)] = d.refused.get((level, reason), 0) + 1

    def node_load(self) -> NodeLoad:
        """The live instances' last heartbeats, summed (cheap: no histograms)."""
        with self._lock:
            lives = [lv.stats for lv in self._live.values()]
        return NodeLoad(held=sum(s.held for s in lives), batches=sum(s.batches for s in lives),
                        rows_run=sum(s.ok + s.errors for s in lives),
                        busy_ms=sum(s.busy_ms for s in lives), instances=len(lives))

    def _merged(self) -> tuple[dict[str, Any], dict[str, int], RequestHistograms]:
        totals: dict[str, Any] = dict.fromkeys(COUNTERS, 0)
        for k, v in self._retired.items():
            totals[k] += v
        sizes = dict(self._retired_sizes)
        hist = merged_histograms(self._retired_hist)
        for live in self._live.values():
            s = live.stats
            for k in COUNTERS:
                totals[k] += getattr(s, k)
            _add_sizes(sizes, s.batch_sizes)
            with contextlib.suppress(ValueError):
                if s.hist:
                    hist.merge(RequestHistograms.from_wire(s.hist))
        return totals, sizes, hist

    def totals(self, roles: Mapping[str, Role] | None = None) -> AppTotals:
        """The app's statistics for ``status``: cumulative counters (live plus gone instances),
        ``batch_sizes`` and ``hist`` (the duration histograms Prometheus exports), rates, queue and
        held requests (of instances that serve), p50/p99 of the recent window, SLO attainment, and
        the front door's counts (``oip``).

        ``roles`` maps each instance the node has to its role; records of other instances are
        dropped first (`forget`). p50 is the serving instances' p50 weighted by what each served,
        p99 the worst serving instance's (an upper bound of the app's).
        """
        if roles is not None:
            self.forget(roles)
        roles = roles or {}
        with self._lock:
            totals, sizes, hist = self._merged()
            lives = [(n, lv.stats) for n, lv in self._live.items()]
            door = self._door.as_dict()
        serving = [(n, s) for n, s in lives if roles.get(n, Role.ACTIVE) in SERVING_ROLES]
        live = [s for _, s in serving if s.p50_ms is not None]
        weight = sum(max(1, s.ok) for s in live)
        answered = totals["ok"] + totals["deadline_missed"] + totals["errors"]
        not_shadow = [s for n, s in lives if roles.get(n, Role.ACTIVE) != Role.SHADOW]
        return AppTotals(
            **totals,
            p50_ms=sum(float(s.p50_ms or 0.0) * max(1, s.ok) for s in live) / weight if live else None,
            p99_ms=max((float(s.p99_ms) for s in live if s.p99_ms is not None), default=None),
            arrival_rps=sum(s.arrival_rps for _, s in lives),
            service_rps=sum(s.service_rps for _, s in lives),
            queue_len=sum(s.queue_len for s in not_shadow),
            held=sum(s.held for s in not_shadow),
            slo_attainment=totals["within_slo"] / answered if answered else None,
            batch_sizes={str(k): n for k, n in sorted(sizes.items())},
            hist=hist.to_wire(),
            oip=door,
        )

    def model_statistics(self, name: str) -> dict[str, Any]:
        """The Triton ``ModelStatistics`` of the app as model ``name``, version ``1``: success/fail,
        inference and execution counts and the last inference as the front door counted them.

        As Triton's, ``queue`` and the three ``compute_*`` entries count one per successful inference
        (perf_analyzer run without ``-x`` picks the model version whose ``queue`` count grew during its
        measurement, and refuses compute counts that differ). The front door sees an inference's time in
        the node as one span, reported as ``compute_infer``; ``queue``, ``compute_input`` and
        ``compute_output`` carry 0 ns. The node's own queue and compute durations (every request of the
        app, from any client) are in the same record's ``hist``: ``status`` and
        ``gpuprims_queue_duration_seconds`` / ``gpuprims_compute_duration_seconds``."""
        with self._lock:
            d = self._door
            door = (d.success.as_dict(), d.fail.as_dict(), d.node.as_dict(), d.inference_count,
                    d.execution_count, d.last_inference_ms)
        zero = Duration().as_dict()
        success, fail, node, inferences, executions, last_ms = door
        counted = {"count": success["count"], "ns": 0}
        return {
            "name": name, "version": "1", "last_inference": last_ms,
            "inference_count": inferences, "execution_count": executions,
            "inference_stats": {"success": success, "fail": fail,
                                "queue": counted, "compute_input": counted,
                                "compute_infer": node, "compute_output": counted,
                                "cache_hit": zero, "cache_miss": zero},
            "batch_stats": [],
        }


def merged_histograms(*sources: Any) -> RequestHistograms:
    h = RequestHistograms()
    for raw in sources:
        if raw:
            with contextlib.suppress(ValueError):
                h.merge(RequestHistograms.from_wire(raw))
    return h


def _add_sizes(into: dict[str, int], raw: Any) -> None:
    if isinstance(raw, Mapping):
        for size, n in raw.items():
            if _is_count(n):
                into[str(size)] = into.get(str(size), 0) + int(n)
