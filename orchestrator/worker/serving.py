"""The serving loop of one instance: its queue, the batching decision and the data path's seams.

An :class:`orchestrator.worker.instance.Instance` (the process) owns one :class:`ServingLoop`, which owns the
instance's consumer queue of the packet pool and serves it through the app's
:class:`orchestrator.worker.zoo_runner.AppRunner` (the model): take complete requests from the ring into a local
queue, answer those that can no longer meet their deadline with DEADLINE_MISSED (:meth:`ServingLoop._expire`),
give up the head of a backlog that would hold the instance to small batches (:meth:`ServingLoop._early_drop`),
form a batch as large as the deadline allows (``gpuprims.batching``), and send it through one seam per
step of the data path: :meth:`ServingLoop.gather`, :meth:`ServingLoop.run`, :meth:`ServingLoop._answer`
(errors through :meth:`ServingLoop.fail`).

Under the node's scheduler (dispatched mode) the loop does not batch on its own: :meth:`ServingLoop.run_batch`
serves exactly what a ``RunBatch`` names. :meth:`ServingLoop.drain` serves what is queued before the
instance ends (Finish, Shutdown).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from gpuprims.batching import BatchPolicy
from gpuprims.gather import Gatherer, HostGatherer, keep_rows
from gpuprims.pool import RECORD_DTYPE, LocalQueue, PacketPool
from gpuprims.stats import DURATION_BOUNDS_S, RequestHistograms, Reservoir, StageClock
from gpuprims.wire import FLAG_MORE, DType, Status
from orchestrator.control.messages import BatchDone, RunBatch
from orchestrator.control.spec import InstanceSpec

if TYPE_CHECKING:  # the zoo's runner imports torch: a model file's instance never imports it
    from orchestrator.worker.zoo_runner import AppRunner

#: After this long without running a batch, a request is served even if the latency model predicts
#: it will miss (see ServingLoop._expire).
PROBE_AFTER_S = 1.0
#: The latency model forgets batch times older than this: a spell of slow batches (a shadow starting
#: beside the instance, a neighbour's burst) stops predicting misses seconds after it ends, instead of
#: after a whole window of new measurements of each size, which at one probe a second took half a
#: minute of DEADLINE_MISSED answers (measured in bench/overlap).
LATENCY_MEMORY_S = 5.0
#: How many batches deep (x max_batch) an instance looks for a backlog's early drop.
EARLY_DROP_SCAN = 4
#: The most requests one poll of the ring takes into the local queue.
PULL_MAX = 64
#: How long an answer may wait for room in the answer ring before the ingest counts as gone (us).
ANSWER_TIMEOUT_US = 5_000_000

#: Opt-in trace of every request an instance answers on its fast path: the directory named by this
#: environment variable (of the instance's process) gets one JSON line per request (`TracedRequest`) in
#: ``<instance>-<pid>.trace.jsonl``. Unset (the default): nothing is timed or written beyond one check
#: per batch. bench/single_stream ``--trace`` joins it with the client's side (gpuprims.client ``trace``).
TRACE_ENV = "GPUPRIMS_TRACE_DIR"

log = logging.getLogger("gpuprims.instance")


@dataclass(frozen=True, slots=True)
class TracedRequest:
    """One request's way through the node, CLOCK_MONOTONIC ns (one clock for every process on a host,
    ``time.monotonic_ns``): ``client_ts_ns`` the client's clock when it built the request (the wire
    header's), ``first_ns`` its first datagram in at the ingest, ``complete_ns`` reassembly complete and
    pushed to the instance's ring, ``woke_ns`` the instance took its batch's first request off the ring,
    ``take_ns`` the batch started (after the batching wait), ``gathered_ns`` the batch gathered,
    ``model_ns`` the engine done, ``answered_ns`` the answers published to the answer ring (the ingest
    sends them); ``batch`` its batch's size."""

    instance: str
    request_id: int
    client_ts_ns: int
    first_ns: int
    complete_ns: int
    woke_ns: int
    take_ns: int
    gathered_ns: int
    model_ns: int
    answered_ns: int
    batch: int


class StageTrace:
    """Where an instance writes `TracedRequest` lines when `TRACE_ENV` names a directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = path.open("a", buffering=1)  # a line each: readable while running

    @classmethod
    def from_env(cls, instance: str) -> StageTrace | None:
        """The trace `TRACE_ENV` asks for, or None. A directory that cannot be written is logged and the
        instance serves untraced (a trace is a measurement aid, never a reason not to serve)."""
        where = os.environ.get(TRACE_ENV)
        if not where:
            return None
        try:
            d = Path(where)
            d.mkdir(parents=True, exist_ok=True)
            return cls(d / f"{instance}-{os.getpid()}.trace.jsonl")
        except OSError as e:
            log.warning("%s: %s=%r cannot be written (%s): serving untraced", instance, TRACE_ENV, where, e)
            return None

    def write(self, rows: list[TracedRequest]) -> None:
        if self._file is not None:
            self._file.write("".join(json.dumps(asdict(r)) + "\n" for r in rows))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_trace(directory: Path) -> list[TracedRequest]:
    """Every `TracedRequest` the instances wrote under `directory` (`TRACE_ENV`); a line cut short by an
    instance that ended mid-write is skipped."""
    out = []
    for path in sorted(directory.glob("*.trace.jsonl")):
        for line in path.read_text().splitlines():
            try:
                out.append(TracedRequest(**json.loads(line)))
            except (ValueError, TypeError):
                continue
    return out


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

class ServingLoop:
    """The serving loop of one instance (see the module docstring): the queue, the batching policy,
    the statistics and the gather / run / answer seams. The model is the runner's."""

    def __init__(self, spec: InstanceSpec, pool: PacketPool, runner: AppRunner) -> None:
        self.spec = spec
        self.pool = pool
        self.runner = runner
        self.consumer = pool.consumer(spec.consumer)
        self.policy = BatchPolicy(spec.max_batch, spec.max_wait_ms, spec.slo_ms, margin_ms=0.3)
        self.stats = LatencyStats(spec.slo_ms)
        # The local queue: copies of the records taken off the ring, oldest first, and the per-batch
        # bookkeeping (expiry, the batch's records, answers and latencies) in one native call per step.
        self.queue = LocalQueue(self.consumer)
        self.row_bytes = int(np.prod(spec.input_shape)) * (1 if spec.dtype == "uint8" else 4)
        self.wire_dtype = int(DType.UINT8 if spec.dtype == "uint8" else DType.FLOAT32)
        # Wire dtypes a body may name (by code): the app's, or untyped BYTES.
        self._dtype_ok = np.zeros(256, dtype=bool)
        self._dtype_ok[[self.wire_dtype, int(DType.BYTES)]] = True
        self._dtype_ok_u8 = self._dtype_ok.astype(np.uint8)
        self._lat_ms = np.empty(pool.layout["record_count"], dtype=np.float64)  # a batch's latencies
        self._recs = np.empty(pool.layout["record_count"], dtype=np.uint32)  # a batch's record indices
        self._last_served = 0.0
        # Dispatched mode: requests routed to a later DAG stage, held until a RunBatch for it.
        self.stage_queues: dict[str, collections.deque[tuple[int, np.ndarray]]] = {}
        self._last_error: str | None = None
        self.gatherer: Gatherer | None = None
        self.trace = StageTrace.from_env(spec.name)  # None unless TRACE_ENV asks for it

    def attach(self, gatherer: Gatherer) -> None:
        """Take the gather step the runner made for the device (at init_compute)."""
        self.gatherer = gatherer
        gatherer.clock = self.stats.stages

    def held(self) -> int:
        """Requests taken off the ring and not answered yet (local queue and later DAG stages)."""
        return len(self.queue) + sum(len(q) for q in self.stage_queues.values())

    def busy(self) -> bool:
        """Whether a request waits to be served (held here or in the ring)."""
        return bool(self.queue) or self.held() > 0 or self.consumer.depth() > 0

    def snapshot(self) -> dict[str, Any]:
        """The loop's statistics for a heartbeat: the ring's depth plus what it holds."""
        held = self.held()
        return self.stats.snapshot(self.consumer.depth() + held, held)


    # -- the queue -----------------------------------------------------------------------------------
    def _pull(self, timeout_ms: float) -> int:
        """Take up to PULL_MAX complete requests into the local queue; returns how many."""
        arrivals = self.queue.pull(PULL_MAX, int(timeout_ms * 1000))
        n = len(arrivals)
        if n:
            if not self.stats.stages.running:
                self.stats.stages.start()  # the next batch's clock starts when its first request is taken
            q = len(self.queue)
            flags = self.queue.flags
            if any(flags(i) & FLAG_MORE for i in range(q - n, q)):  # samples of a MultiStream query
                ends = [t for i, t in zip(range(q - n, q), arrivals) if not flags(i) & FLAG_MORE]
                self.policy.note_arrivals(arrivals, queries_ms=ends)  # whether waiting will pay
            else:
                self.policy.note_arrivals(arrivals)
            self.stats.counts["received"] += n
            if not self.stats.first_request_ns:
                q = len(self.queue)
                self.stats.first_request_ns = min(self.queue.first_ns(i) for i in range(q - n, q))
        return n

    def _deadline_ms(self, row: np.ndarray) -> float:
        d = int(row["deadline_us"])
        return d / 1e3 if d else self.spec.slo_ms

    def _expire(self, now_ns: int) -> None:
        """Answer queued requests that cannot meet their deadline any more, oldest first.

        A request past its deadline always expires. One that the latency model predicts will miss
        expires only while that prediction is fresh (a batch ran within ``PROBE_AFTER_S``): otherwise
        one slow measurement could make every later request look hopeless, nothing would run, and
        the model would never learn that the instance is fast again. After that long without serving,
        the next request is let through as a probe. Batch times older than ``LATENCY_MEMORY_S`` are
        forgotten first.
        """
        now_s = time.monotonic()
        self.policy.model.forget(now_s - LATENCY_MEMORY_S)
        predictive = now_s - self._last_served < PROBE_AFTER_S
        # BatchPolicy.expired's rule: past its deadline, or (while the prediction is fresh) its age plus
        # a batch of one's predicted time past it.
        need_ms = self.policy.predict(1) if predictive and self.policy.model.known else -1.0
        n = self.queue.expire(now_ns, self.spec.slo_ms, need_ms, ANSWER_TIMEOUT_US)
        if n:
            self.stats.counts["deadline_missed"] += n

    def _early_drop(self, now_ns: int) -> None:
        """Under a backlog, answer DEADLINE_MISSED the head requests whose deadline would hold the
        instance to small batches while a full batch behind them can still be served in time
        (`BatchPolicy.early_drop`). Looks at most ``EARLY_DROP_SCAN`` batches deep."""
        q, slo = self.queue, self.spec.slo_ms
        if len(q) <= self.spec.max_batch or not self.policy.model.known:
            return
        if (now_ns - q.first_ns(0)) / 1e6 + self.policy.predict(self.spec.max_batch) <= q.deadline_ms(0, slo):
            return  # a full batch fits the oldest request: no backlog to cut (the common case, kept cheap)
        m = min(len(q), EARLY_DROP_SCAN * self.spec.max_batch)
        ages = [max(0.0, (now_ns - q.first_ns(i)) / 1e6) for i in range(m)]
        k = self.policy.early_drop(ages, [q.deadline_ms(i, slo) for i in range(m)])
        if k:
            k = q.fail_head(k, int(Status.DEADLINE_MISSED), ANSWER_TIMEOUT_US)
            self.stats.counts["early_dropped"] += k
            self.stats.counts["deadline_missed"] += k

    # -- the data path: one seam per step (gather, run, answer) ---------------------------------------------
    def gather(self, items: list[tuple[int, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, Any] | None:
        """The seam every serving mode gathers through: ``(records, rows, batch)`` for the requests in
        ``items``, the batch model-ready on the instance's device; requests whose body is not the app's
        input size are answered BAD_REQUEST here. None when nothing is left to run.

        A record stays held until its answer is published to the answer ring, and the ingest is the only
        sender: if this process dies first, the ingest requeues the request or answers it
        INSTANCE_FAILED, so every request is answered exactly once.
        """
        recs = np.array([r for r, _ in items], np.uint32)
        info = np.array([row for _, row in items], dtype=RECORD_DTYPE)
        # The body must be the app's input: its size, and its wire dtype when it names one (a uint8 body of
        # a float32 app's byte size is not a float32 image; untyped BYTES bodies are taken as the app's).
        bad = (info["total_len"] != self.row_bytes) | ~self._dtype_ok[info["dtype"]]
        if bad.any():
            self.fail(recs[bad], info[bad], Status.BAD_REQUEST)
            recs, info = recs[~bad], info[~bad]
        if not recs.size:
            return None
        assert self.gatherer is not None
        x = self.gatherer.gather(recs)  # valid until the next gather
        if self.gatherer.statuses.any():  # the GPU-DMA kernel's verdicts on the records it read
            ok = self.gatherer.statuses == 0
            self.fail(recs[~ok], info[~ok], Status.BAD_REQUEST)
            recs, info, x = recs[ok], info[ok], keep_rows(x, ok)
            if not recs.size:
                return None
        return recs, info, x

    def run(self, fn: Any, x: Any) -> Any:
        """The seam every serving mode runs a model through: ``fn(x)`` without autograd; on CUDA its
        completion is awaited with Sync-lite (event polling with the GIL released)."""
        return self.runner.run(fn, x)

    def fail(self, recs: np.ndarray, info: np.ndarray, status: Status) -> None:
        """Answer requests with an error status (published to the answer ring; the ingest sends it)."""
        if not recs.size:
            return
        self.consumer.answer_status(recs, info, status)
        key = "deadline_missed" if status == Status.DEADLINE_MISSED else "error"
        self.stats.counts[key] += int(recs.size)

    def _timed_run(self, fn: Any, x: Any, what: str, recs: np.ndarray,
                   info: np.ndarray | Callable[[], np.ndarray]) -> tuple[Any, float] | None:
        """:meth:`run` with its model time; a failing model answers its batch INTERNAL (None is returned)
        and the instance carries on. ``info`` is the batch's records, or what returns them (made only if
        the model fails)."""
        t0 = time.perf_counter()
        try:
            out = self.run(fn, x)
        except Exception as e:
            log.error("%s failed on a batch of %d: %s", what, recs.size, e)
            self.fail(recs, info() if callable(info) else info, Status.INTERNAL)
            self._last_error = str(e)
            return None
        model_ms = (time.perf_counter() - t0) * 1e3
        self.stats.model_ms.add(model_ms)
        self.stats.busy_ms += model_ms
        self.stats.batch_sizes[int(recs.size)] += 1
        return out, model_ms

    @staticmethod
    def _groups(out: Any, n: int) -> list[tuple[np.ndarray, Any]]:
        """A model's output as ``[(rows, output)]``: DagModel returns groups already."""
        return out if isinstance(out, list) else [(np.arange(n), out)]

    def _serve_batch(self, take: int) -> None:
        """Serve the oldest ``take`` queued requests as one batch: the local queue's native calls take
        them (answering bodies that are not the app's input BAD_REQUEST) and answer them with their
        results; only a batch the gather refuses rows of, or a DAG app's groups, answer through
        :meth:`_answer` (a numpy copy of the batch's records)."""
        clock = self.stats.stages
        if not clock.running:
            clock.start()
        clock.lap("wait")
        trace = self.trace
        take_ns = time.monotonic_ns() if trace is not None else 0
        q, g = self.queue, self.gatherer
        assert g is not None
        host = isinstance(g, HostGatherer)  # then take copies the payloads into its batch buffer too
        n = q.take(take, self.row_bytes, self._dtype_ok_u8, ANSWER_TIMEOUT_US, self._recs, g.rows if host else None)
        if n < take:
            self.stats.counts["error"] += take - n  # answered BAD_REQUEST by take
        if not n:
            self.policy.note_answered(time.monotonic_ns() / 1e6, len(self.queue))
            clock.cancel()
            return
        recs = self._recs[:n]
        info: np.ndarray | None = None  # the batch's records as numpy, once a path needs them
        x = g.gathered(n) if host else g.gather(recs)  # valid until the next gather
        if g.statuses.any():  # the GPU-DMA kernel's verdicts on the records it read
            ok = g.statuses == 0
            info = q.batch_info()
            self.fail(recs[~ok], info[~ok], Status.BAD_REQUEST)
            recs, info, x = recs[ok], info[ok], keep_rows(x, ok)  # copies
            q.clear_batch()
            if not recs.size:
                self.policy.note_answered(time.monotonic_ns() / 1e6, len(self.queue))
                clock.cancel()
                return
        clock.lap("gather")  # the seam's own bookkeeping (the host gatherer laps its copy itself)
        gathered_ns = time.monotonic_ns() if trace is not None else 0
        done = self._timed_run(self.runner.model, x, "model", recs, info if info is not None else q.batch_info)
        if done is None:
            q.clear_batch()
            self.policy.note_answered(time.monotonic_ns() / 1e6, len(self.queue))
            clock.cancel()
            return
        clock.lap("model")
        out, model_ms = done
        self.policy.model.observe(recs.size, model_ms, at_s=time.monotonic())
        # Timed before the answers go out, so a closed-loop client's next request always arrives after it.
        self.policy.note_answered(time.monotonic_ns() / 1e6, len(self.queue))
        if isinstance(out, list) or info is not None:  # a DAG app's groups of rows, or a batch with rows refused
            if info is None:
                info = q.batch_info().copy()
                recs = recs.copy()
                q.clear_batch()
            for rows, group in self._groups(out, recs.size):
                self._answer(recs[rows], info[rows], group.float().cpu().numpy().reshape(len(rows), -1),
                             compute_s=model_ms / 1e3)
            oldest = info[int(np.argmin(info["first_ns"]))]
            first, complete = int(oldest["first_ns"]), int(oldest["complete_ns"])
        else:  # one model, the whole batch: one native call answers it and measures its latencies
            traced = q.batch_info().copy() if trace is not None else None
            model_ns = time.monotonic_ns() if trace is not None else 0
            first, complete = self._answer_batch(out.float().cpu().numpy().reshape(n, -1), model_ms)
            if trace is not None and traced is not None:
                self._write_trace(trace, traced, take_ns, gathered_ns, model_ns)
        self.stats.mark_answered(model_ms)
        clock.lap("respond")
        self._clock_ingest(first, complete)
        clock.end()
        if self.queue:
            clock.start()  # requests left in the local queue: the next batch's wait starts now

    def _write_trace(self, trace: StageTrace, info: np.ndarray, take_ns: int, gathered_ns: int,
                     model_ns: int) -> None:
        """Write the batch just answered (``info``: its records) to the trace (`TRACE_ENV`)."""
        answered_ns = time.monotonic_ns()
        woke_ns = self.stats.stages.start_ns
        n = len(info)
        trace.write([TracedRequest(self.spec.name, int(r["request_id"]), int(r["client_ts_ns"]), int(r["first_ns"]),
                                   int(r["complete_ns"]), woke_ns, take_ns, gathered_ns, model_ns, answered_ns, n)
                     for r in info])

    def _answer_batch(self, body: np.ndarray, model_ms: float) -> tuple[int, int]:
        """Answer the local queue's current batch OK with ``body`` (one row each) and count it; returns
        the oldest request's (first_ns, complete_ns). A row the answer ring cannot take answers the batch
        INTERNAL (a config problem, logged)."""
        q, h = self.queue, self.stats.hist
        n = len(body)
        try:
            within, _, first, complete, request_s, queue_s, compute_s = q.answer_batch(
                np.ascontiguousarray(body, np.float32).view(np.uint8), int(DType.FLOAT32), self.spec.slo_ms,
                ANSWER_TIMEOUT_US, self._lat_ms, model_ms / 1e3, DURATION_BOUNDS_S, h.request.counts,
                h.queue.counts, h.compute.counts)
        except ValueError as e:
            log.error("%s: cannot answer %d requests: %s", self.spec.name, n, e)
            info = q.batch_info()
            self.fail(self._recs[:n], info, Status.INTERNAL)
            oldest = info[int(np.argmin(info["first_ns"]))]
            q.clear_batch()
            return int(oldest["first_ns"]), int(oldest["complete_ns"])
        h.request.sum_s += request_s
        h.queue.sum_s += queue_s
        h.compute.sum_s += compute_s
        self.stats.latencies_ms.extend(self._lat_ms[:n])
        self.stats.counts["ok"] += n
        self.stats.counts["within_slo"] += within
        return first, complete

    def _clock_ingest(self, first: int, complete: int) -> None:
        """The ingest-side stages of the batch's oldest request (its first and last datagram in):
        reassembly (first datagram to complete) and delivery (complete to taken off the ring by this
        instance)."""
        if complete >= first > 0:
            self.stats.stages.observe("reassembly", complete - first)
            self.stats.stages.observe("delivery", self.stats.stages.start_ns - complete)

    def _more(self) -> bool:
        """Whether the newest queued request says more of its query follow (wire FLAG_MORE: a MultiStream
        query of several samples, `Client.infer_many` or an OIP request of several rows), so the batcher
        holds the query's first samples for the rest (``BatchPolicy.decide``, ``more``)."""
        return bool(self.queue.flags(len(self.queue) - 1) & FLAG_MORE)

    def step(self, max_wait_ms: float = 50.0) -> None:
        """One iteration: pull, expire, decide, maybe serve."""
        now = time.monotonic_ns()
        pulled = 0
        if self.queue:
            oldest_age = max(0.0, (now - self.queue.first_ns(0)) / 1e6)
            decision = self.policy.decide(len(self.queue), oldest_age, now_ms=now / 1e6, more=self._more())
            if decision.take == 0:
                pulled = self._pull(min(max_wait_ms, max(0.0, decision.wait_ms)))
        else:
            pulled = self._pull(max_wait_ms)
        if not self.queue:
            return
        if pulled in (0, PULL_MAX):  # a pull that just returned took all there was (unless it was full)
            self._pull(0)
        self._expire(time.monotonic_ns())  # after the pull: a request just taken has age >= 0
        if not self.queue:
            self.policy.note_answered(time.monotonic_ns() / 1e6, 0)
            self.stats.stages.cancel()  # all of it expired: no batch runs, the next one's clock starts afresh
            return
        self._early_drop(time.monotonic_ns())
        now = time.monotonic_ns()
        oldest_age = max(0.0, (now - self.queue.first_ns(0)) / 1e6)
        decision = self.policy.decide(len(self.queue), oldest_age, now_ms=now / 1e6, more=self._more())
        if decision.take:
            self._serve_batch(min(decision.take, len(self.queue)))
            self._last_served = time.monotonic()

    def drain(self) -> int:
        """Serve everything already queued for this instance (its ring and local queue). Returns count."""
        served_before = self.stats.counts["ok"] + self.stats.counts["deadline_missed"] + self.stats.counts["error"]
        idle_since = time.monotonic()
        # New requests are already routed elsewhere; requests completing reassembly just before the
        # switch can still land here for a moment, so wait for a short quiet period.
        while time.monotonic() - idle_since < 0.05:
            self._pull(5)
            if self.queue:
                self._expire(time.monotonic_ns())
                while self.queue:
                    self._serve_batch(min(len(self.queue), self.spec.max_batch))
                idle_since = time.monotonic()
        self._drain_stages()
        return self.stats.counts["ok"] + self.stats.counts["deadline_missed"] + self.stats.counts["error"] - served_before

    # -- dispatched mode ----------------------------------------------------------------------------
    def _take_from_ring(self, n: int, timeout_s: float = 0.2) -> list[tuple[int, np.ndarray]]:
        """Exactly ``n`` requests from the ring (the scheduler saw them there), waiting briefly."""
        got: list[tuple[int, np.ndarray]] = []
        end = time.monotonic() + timeout_s
        while len(got) < n:
            recs = self.consumer.poll(n - len(got), max(0.0, (end - time.monotonic()) * 1e3))
            if recs.size:
                got += zip(recs.tolist(), self.pool.requests(recs))
            elif time.monotonic() >= end:
                log.warning("RunBatch asked for %d request(s) but only %d were queued", n, len(got))
                break
        self.stats.counts["received"] += len(got)
        return got

    def run_batch(self, msg: RunBatch) -> BatchDone:
        """Serve one RunBatch (see the module docstring) and return its BatchDone."""
        stage = msg.stage
        if stage == self.runner.entry_stage:
            items = self._take_from_ring(msg.batch)
        else:
            q = self.stage_queues.get(stage)
            if q is None:
                try:
                    self.runner.stage_model(stage)
                except KeyError:
                    return BatchDone(instance=self.spec.name, id=msg.id, taken=0, measured_ms=0.0,
                                     error=f"unknown stage {stage!r}")
                q = self.stage_queues.setdefault(stage, collections.deque())
            items = [q.popleft() for _ in range(min(msg.batch, len(q)))]
        taken = len(items)
        if not items:
            return BatchDone(instance=self.spec.name, id=msg.id, taken=0, measured_ms=0.0)
        if msg.action == "reject":
            self.fail(np.array([r for r, _ in items], np.uint32), np.array([row for _, row in items],
                                                                            dtype=RECORD_DTYPE), Status.DEADLINE_MISSED)
            return BatchDone(instance=self.spec.name, id=msg.id, taken=taken, measured_ms=0.0)
        by_rec = dict(items)
        gathered = self.gather(items)
        if gathered is None:
            return BatchDone(instance=self.spec.name, id=msg.id, taken=taken, measured_ms=0.0)
        recs, info, x = gathered
        n = recs.size
        self.runner.set_threads(msg.gpu_pct)
        targets = (self.runner.routes.get(stage) or []) if self.spec.stages else []
        self._last_error = None
        done = self._timed_run(self.runner.stage_model(stage), x, f"stage {stage}", recs, info)
        if done is None:
            return BatchDone(instance=self.spec.name, id=msg.id, taken=taken, measured_ms=0.0,
                             error=self._last_error)
        out, model_ms = done
        cls = out.argmax(dim=1).cpu().numpy() if targets else None
        logits = out.float().cpu().numpy().reshape(n, -1)
        routed: dict[str, list[float]] = {}
        finished = np.ones(n, dtype=bool)
        if cls is not None:
            for i, target in enumerate(targets):
                sel = np.flatnonzero(cls == i)
                if not sel.size:
                    continue
                finished[sel] = False
                q = self.stage_queues.setdefault(target, collections.deque())
                for k in sel.tolist():
                    q.append((int(recs[k]), by_rec[int(recs[k])]))
                routed[target] = [self._abs_deadline_ms(info[k]) for k in sel.tolist()]
        if finished.any():
            self._answer(recs[finished], info[finished], logits[finished], compute_s=model_ms / 1e3)
        return BatchDone(instance=self.spec.name, id=msg.id, taken=taken, measured_ms=model_ms, routed=routed)

    def _abs_deadline_ms(self, row: np.ndarray) -> float:
        """A request's deadline in ms on CLOCK_MONOTONIC (the clock the scheduler plans on)."""
        return int(row["first_ns"]) / 1e6 + self._deadline_ms(row)

    def _answer(self, recs: np.ndarray, info: np.ndarray, logits: np.ndarray, compute_s: float = 0.0,
                dtype: DType | None = None) -> None:
        """The seam every serving mode answers through: OK with the results, published in one store each
        to the answer ring (the ingest sends them). ``dtype`` names the body's wire dtype where the rows'
        numpy dtype does not (a multi-tensor body is TENSORS, not UINT8)."""
        try:
            self.consumer.answer(recs, info, Status.OK, logits, dtype=dtype)
        except ValueError as e:  # a result row larger than the answer ring takes: a config problem
            log.error("%s: cannot answer %d requests: %s", self.spec.name, recs.size, e)
            self.fail(recs, info, Status.INTERNAL)
            return
        done_ns = time.monotonic_ns()
        self.stats.hist.observe_answered(info["first_ns"], compute_s=compute_s, done_ns=done_ns)
        lat_ms = (done_ns - info["first_ns"].astype(np.int64)) / 1e6
        deadlines = np.where(info["deadline_us"] > 0, info["deadline_us"] / 1e3, self.spec.slo_ms)
        self.stats.latencies_ms.extend(lat_ms)
        self.stats.counts["ok"] += int(recs.size)
        self.stats.counts["within_slo"] += int((lat_ms <= deadlines).sum())

    def _drain_stages(self) -> None:
        """Serve what earlier stages routed to later ones and no RunBatch took (drain, shutdown)."""
        for _ in range(len(self.stage_queues) + 1):
            pending = [(st, q) for st, q in self.stage_queues.items() if q]
            if not pending:
                return
            for stage, q in pending:
                while q:
                    gathered = self.gather([q.popleft() for _ in range(min(len(q), self.spec.max_batch))])
                    if gathered is None:
                        continue
                    recs, info, x = gathered
                    dag = self.runner.dag(stage)
                    done = self._timed_run(dag, x, f"stage {stage} (draining)", recs, info)
                    if done is None:
                        continue
                    for rows, group in self._groups(done[0], recs.size):
                        self._answer(recs[rows], info[rows], group.float().cpu().numpy().reshape(len(rows), -1),
                                     compute_s=done[1] / 1e3)


    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
        if self.gatherer is not None:
            self.gatherer.close()  # before the pool it registered goes
            self.gatherer = None
