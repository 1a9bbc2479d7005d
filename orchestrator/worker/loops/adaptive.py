"""The adaptive serving mode: the instance batches on its own, as large a batch as the deadline allows.

Each :meth:`AdaptiveLoop.step` takes complete requests from the ring into the local queue, answers those
that can no longer meet their deadline with DEADLINE_MISSED (:meth:`ServingLoop._expire`), gives up the
head of a backlog that would hold the instance to small batches (:meth:`AdaptiveLoop._early_drop`), and
forms a batch by the app's ``BatchPolicy`` (``gpuprims.batching``): it holds a MultiStream query's first
samples for the rest (wire FLAG_MORE) and serves a closed loop's single request at once. This is the mode
of every instance under the node's spatial scheduler (``spec.dispatched`` off).
"""

from __future__ import annotations

import time

from gpuprims.wire import FLAG_MORE, Status
from orchestrator.worker.loops.base import ANSWER_TIMEOUT_US, PULL_MAX, ServingLoop

#: How many batches deep (x max_batch) an instance looks for a backlog's early drop.
EARLY_DROP_SCAN = 4


class AdaptiveLoop(ServingLoop):
    """The instance's own batching (see the module docstring)."""

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


    def _more(self) -> bool:
        """Whether the newest queued request says more of its query follow (wire FLAG_MORE: a MultiStream
        query of several samples, `Client.infer_many` or an OIP request of several rows), so the batcher
        holds the query's first samples for the rest (``BatchPolicy.decide``, ``more``)."""
        return bool(self.queue.flags(len(self.queue) - 1) & FLAG_MORE)

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

