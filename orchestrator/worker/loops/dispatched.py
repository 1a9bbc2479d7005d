"""The dispatched serving mode: the instance serves exactly what the node's scheduler names.

Under the node's spatio-temporal or temporal scheduler (``spec.dispatched``) an instance does not batch on
its own: each ``RunBatch`` names a stage, a batch size and a GPU%; :meth:`DispatchedLoop.run_batch` takes
exactly that many requests from the front of the stage's queue (the ring for the entry stage; for a DAG
app's later stages, the requests an earlier stage routed there, which this loop holds), runs them and
returns the ``BatchDone`` with the model time and where the requests went. What the stages still hold
when the instance ends is served by :meth:`ServingLoop.drain` (:meth:`DispatchedLoop._drain_held`).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from gpuprims.pool import RECORD_DTYPE, PacketPool
from gpuprims.wire import Status
from orchestrator.control.messages import BatchDone, RunBatch
from orchestrator.control.spec import InstanceSpec
from orchestrator.worker.loops.base import ServingLoop

if TYPE_CHECKING:  # the zoo's runner imports torch
    from orchestrator.worker.zoo_runner import AppRunner

log = logging.getLogger("gpuprims.instance")


class DispatchedLoop(ServingLoop):
    """Serves the RunBatch messages of the node's scheduler (see the module docstring)."""

    def __init__(self, spec: InstanceSpec, pool: PacketPool, runner: AppRunner) -> None:
        super().__init__(spec, pool, runner)
        # Requests routed to a later DAG stage, held until a RunBatch for it.
        self.stage_queues: dict[str, collections.deque[tuple[int, np.ndarray]]] = {}

    def held(self) -> int:
        """Requests taken off the ring and not answered yet (local queue and later DAG stages)."""
        return len(self.queue) + sum(len(q) for q in self.stage_queues.values())

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

    def _drain_held(self) -> None:
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
