"""The small base every serving mode of an instance shares: its queue, its statistics and the data path's seams.

An :class:`orchestrator.worker.instance.Instance` (the process) owns one serving loop, chosen from its spec
by :func:`orchestrator.worker.loops.serving_loop`: one class per serving mode (as LitServe's ``loops/``).
This base owns the instance's consumer queue of the packet pool and serves it through the app's runner
(the model): take complete requests from the ring into a local queue (:meth:`ServingLoop._pull`), answer
those that can no longer meet their deadline with DEADLINE_MISSED (:meth:`ServingLoop._expire`), and send a
batch through one seam per step of the data path: :meth:`ServingLoop.gather`, :meth:`ServingLoop.run`,
:meth:`ServingLoop._answer` (errors through :meth:`ServingLoop.fail`). :meth:`ServingLoop._serve_batch`
serves the local queue's oldest requests as one batch; :meth:`ServingLoop.drain` serves what is queued
before the instance ends (Finish, Shutdown).

A mode adds how batches are chosen: :class:`orchestrator.worker.loops.adaptive.AdaptiveLoop` batches on
its own (:meth:`ServingLoop.step`), :class:`orchestrator.worker.loops.dispatched.DispatchedLoop` serves what
the node's scheduler names (:meth:`ServingLoop.run_batch`), :class:`orchestrator.worker.loops.tensors.TensorLoop`
serves a model file's named tensors. A mode refuses the entry point it does not serve.

Exactly once: a record stays held until its answer is published to the answer ring, and the ingest is
the only sender; if this process dies first, the ingest requeues the request or answers it
INSTANCE_FAILED.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from gpuprims.batching import BatchPolicy
from gpuprims.cuda.errors import CudaError
from gpuprims.gather import Gatherer, HostGatherer, keep_rows
from gpuprims.pool import RECORD_DTYPE, LocalQueue, PacketPool
from gpuprims.stats import DURATION_BOUNDS_S
from gpuprims.wire import FLAG_MORE, DType, Status
from orchestrator.control.messages import BatchDone, RunBatch
from orchestrator.control.spec import InstanceSpec
from orchestrator.worker.launch import exit_now
from orchestrator.worker.loops.stats import LatencyStats
from orchestrator.worker.loops.trace import StageTrace, TracedRequest

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
#: The most requests one poll of the ring takes into the local queue.
PULL_MAX = 64
#: How long an answer may wait for room in the answer ring before the ingest counts as gone (us).
ANSWER_TIMEOUT_US = 5_000_000

log = logging.getLogger("gpuprims.instance")
#: The exit status of an instance whose CUDA context a sticky error lost (:meth:`ServingLoop._context_lost`).
CONTEXT_LOST_EXIT = 70


class ServingLoop:
    """What every serving mode shares (see the module docstring): the queue, the batching policy, the
    statistics and the gather / run / answer seams. The model is the runner's."""

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
        self._last_error: str | None = None
        self.gatherer: Gatherer | None = None
        self.trace = StageTrace.from_env(spec.name)  # None unless TRACE_ENV asks for it

    def attach(self, gatherer: Gatherer) -> None:
        """Take the gather step the runner made for the device (at init_compute)."""
        self.gatherer = gatherer
        gatherer.clock = self.stats.stages

    def held(self) -> int:
        """Requests taken off the ring and not answered yet (the local queue; a mode adds what it holds)."""
        return len(self.queue)

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
            if isinstance(e, CudaError) and e.is_sticky:
                self._context_lost(e, what, recs)
            log.error("%s failed on a batch of %d: %s", what, recs.size, e)
            self.fail(recs, info() if callable(info) else info, Status.INTERNAL)
            self._last_error = str(e)
            return None
        model_ms = (time.perf_counter() - t0) * 1e3
        self.stats.model_ms.add(model_ms)
        self.stats.busy_ms += model_ms
        self.stats.batch_sizes[int(recs.size)] += 1
        return out, model_ms

    def _context_lost(self, e: CudaError, what: str, recs: np.ndarray) -> None:
        """A sticky CUDA error (an illegal address: the weights this instance maps died with their holder;
        a launch failure) lost this process's context: no later call runs, so the batch is not answered
        here. The process leaves at once (:data:`CONTEXT_LOST_EXIT`) with every request it holds
        unanswered, and the supervisor replaces it and requeues them to a live instance, as after a crash:
        each is answered once, by an instance that can run the model, instead of INTERNAL."""
        log.critical("%s lost its CUDA context on a batch of %d (%s): leaving so the node requeues the %d "
                     "request(s) this instance holds", what, recs.size, e, self.held() + int(recs.size))
        exit_now(CONTEXT_LOST_EXIT)

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
        self._drain_held()
        return self.stats.counts["ok"] + self.stats.counts["deadline_missed"] + self.stats.counts["error"] - served_before

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

    def _drain_held(self) -> None:
        """Serve what the mode holds beyond the local queue (:meth:`drain`); the base holds nothing more."""

    # -- the entry points of the serving modes: each mode serves one, and refuses the other ---------------
    def step(self, max_wait_ms: float = 50.0) -> None:
        """One iteration of the instance's own batching (:class:`AdaptiveLoop`)."""
        raise ValueError(f"{self.spec.name}: a dispatched instance serves only what RunBatch names")

    def run_batch(self, msg: RunBatch) -> BatchDone:
        """Serve one RunBatch of the node's scheduler (:class:`DispatchedLoop`)."""
        raise ValueError(f"{self.spec.name}: not served in dispatched mode (spec.dispatched is off)")

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
        if self.gatherer is not None:
            self.gatherer.close()  # before the pool it registered goes
            self.gatherer = None
