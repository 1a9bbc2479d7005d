"""The node's loop as a list of duties, each counted and timed (vLLM's ``EngineCore.step`` apart from its wiring).

A :class:`Duty` is one thing the loop does every pass (reap instances, advance changes, sample the
monitor, ...). :meth:`Duty.call` runs it, times it (``time.perf_counter_ns``) and counts it; a duty that
raises is logged and counted in the node's ``errors`` under the duty's ``counted_as`` key, and the loop
carries on. :class:`Duties` runs the list in order and reports what each took for ``status`` (the node
section's ``duties``).

Two duties of the node's own that hold state between passes live here too: :class:`RepositoryPolling`
(what a poll of the model repository found, submitted as operations) and :class:`ThreadPinning` (the
node's threads kept off the instances' cores).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from gpuprims.cpushare import available_cores, pin_own_threads
from orchestrator.node.cpu_overflow import NodeOverflow
from orchestrator.node.repository import PollAction, Repository, RepositoryPoller
from orchestrator.node.state import AppState, InstanceState

log = logging.getLogger("gpuprims.node")


@dataclass
class Duty:
    """One duty of the node's loop, with what it has cost so far."""

    name: str
    fn: Callable[..., Any]
    #: the key its failures are counted under in the node's ``errors`` (several duties may share one)
    counted_as: str
    #: run by :meth:`Duties.run` each pass (False: called for each message or tick by the loop itself)
    each_pass: bool = True
    #: at most once per this many seconds (None: every pass)
    interval_s: float | None = None
    next_at: float = 0.0
    runs: int = 0
    failures: int = 0
    total_ns: int = 0
    max_ns: int = 0

    def call(self, errors: dict[str, int], *args: Any) -> Any:
        """Run the duty once, timed and counted; a failure is logged and counted, never raised."""
        t0 = time.perf_counter_ns()
        try:
            return self.fn(*args)
        except Exception:
            self.failures += 1
            errors[self.counted_as] = errors.get(self.counted_as, 0) + 1
            log.exception("node loop: %s failed (counted in status errors.%s); the node carries on", self.name,
                          self.counted_as)
            return None
        finally:
            took = time.perf_counter_ns() - t0
            self.runs += 1
            self.total_ns += took
            self.max_ns = max(self.max_ns, took)

    def status(self) -> dict[str, Any]:
        """Runs, failures, and the time taken in all (ms), per run on average and at most (µs)."""
        return {"runs": self.runs, "failures": self.failures, "total_ms": round(self.total_ns / 1e6, 3),
                "mean_us": round(self.total_ns / self.runs / 1e3, 1) if self.runs else 0.0,
                "max_us": round(self.max_ns / 1e3, 1)}


class Duties:
    """The node's duties in the order the loop runs them; ``errors`` is the node's count of failures."""

    def __init__(self, errors: dict[str, int]) -> None:
        self.errors = errors
        self._duties: dict[str, Duty] = {}

    def add(self, name: str, fn: Callable[..., Any], counted_as: str | None = None, *, each_pass: bool = True,
            interval_s: float | None = None) -> Duty:
        """Append a duty (``counted_as``: its failures' key in ``errors``, its name by default). One that
        runs each pass is called with the pass's ``time.monotonic()``."""
        if name in self._duties:
            raise ValueError(f"duty {name!r} is already in the loop")
        if interval_s is not None and interval_s <= 0:
            raise ValueError(f"duty {name!r}: interval_s must be positive, got {interval_s}")
        duty = self._duties[name] = Duty(name, fn, counted_as or name, each_pass, interval_s)
        return duty

    def __getitem__(self, name: str) -> Duty:
        return self._duties[name]

    def __iter__(self) -> Iterator[Duty]:
        return iter(self._duties.values())

    def call(self, name: str, *args: Any) -> Any:
        """Run the duty ``name`` once (timed, counted, guarded)."""
        return self._duties[name].call(self.errors, *args)

    def run(self, now: float) -> None:
        """One pass: every duty that runs each pass, in order (one with ``interval_s`` when it is due)."""
        for d in self._duties.values():
            if not d.each_pass:
                continue
            if d.interval_s is not None:
                if now < d.next_at:
                    continue
                d.next_at = now + d.interval_s
            d.call(self.errors, now)

    def status(self) -> dict[str, dict[str, Any]]:
        """Every duty's :meth:`Duty.status`, by name, in loop order."""
        return {d.name: d.status() for d in self._duties.values()}


class RepositoryPolling:
    """``model_control_mode: poll``: what the last read of the model repository found (new models, new
    versions, models gone) submitted as repository operations, one per model at a time; an operation
    that failed is not tried again until its files change again."""

    def __init__(self, poller: RepositoryPoller, repository: Repository, apps: Mapping[str, AppState],
                 record: Callable[[dict[str, Any]], None]) -> None:
        self.poller = poller
        self.repository = repository
        self.apps = apps
        self.record = record
        self.ops: dict[str, tuple[PollAction, concurrent.futures.Future[dict[str, Any]]]] = {}

    def __call__(self, now: float) -> None:
        for name, (act, fut) in list(self.ops.items()):
            if fut.done():
                del self.ops[name]
                if fut.exception() is not None:
                    self.poller.give_up(act)
        for act in self.poller.due({n: a.cfg for n, a in self.apps.items()}, self.repository.busy | set(self.ops)):
            log.info("repository poll: %s %s (%s)", act.kind, act.name, act.why)
            self.record({"event": "repository_poll", "kind": act.kind, "app": act.name, "why": act.why})
            self.ops[act.name] = (act, self.repository.submit(act.kind, act.name, act.entry))


class ThreadPinning:
    """CPU backend, ``node.pin_node_threads``: keep this process's threads on the usable cores no
    instance (nor overflow pool) holds, re-done whenever that set changes (a share change, a restart);
    anywhere when every core is held. A shadow or a replacement inherits the node's set at spawn and
    takes its own share before it loads anything."""

    def __init__(self, instances: Mapping[str, InstanceState], overflow: NodeOverflow | None) -> None:
        self.instances = instances
        self.overflow = overflow
        self.wish: tuple[int, ...] | None = None
        #: where the threads are kept now (None: anywhere, the process's original set)
        self.cores: list[int] | None = None

    def __call__(self, now: float) -> None:
        held: set[int] = set()
        for st in self.instances.values():
            held.update(st.spec.cores or ())
        if self.overflow is not None:
            for pool in self.overflow.pools.values():
                held.update(pool.cores)
        free = tuple(c for c in available_cores() if c not in held)
        if free == self.wish:
            return
        self.wish = free
        self.cores = pin_own_threads(self, free if free else None)

    def release(self) -> None:
        """Withdraw the wish: the threads go back to the process's original set."""
        if self.wish is not None:
            pin_own_threads(self, None)
            self.wish = None
            self.cores = None
