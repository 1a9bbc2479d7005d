"""Changing an app's GPU% while it serves, as an object the node's loop advances.

A :class:`Change` moves through named phases::

    pending -> initialising -> switched -> draining -> (next instance: pending ...) -> done
            \\-> failed (at any phase before the switch: the old instances keep serving at the old share)

Overlapped-Execution (paper V-C), per active instance of the app, one at a time so the app never
loses capacity:

- ``pending``: a shadow (already started, CPU side initialised, GPU side deferred) is taken, or started,
  and waited for (an app with ``shadow: cold`` keeps none, so its change starts one here and waits for
  its start while the old active serves);
- ``initialising``: the shadow was told ``InitGpu(new_pct)``: it applies the new share, loads the model
  (sharing parameters where possible) and warms up;
- ``switched``: the ingest's route moves to the shadow, now an active; the old active is told
  ``<2, Finish>``. (The paper switches traffic after ``<3, Ended>``; switching at Finish lets the new
  instance serve while the old one drains, so there is no gap, and since each request sits in exactly
  one consumer queue none is lost or answered twice);
- ``draining``: the old instance serves what it holds and reports Ended (or is terminated after the
  timeout, and what it held is requeued to the new active);
- ``done`` once every active runs at the new share; a fresh shadow is then prepared by the supervisor.

The kill-and-restart baseline is the same object with ``method="restart"``: a replacement is started
at the new share and routed to, the old active is killed (what it held is requeued to the
replacement), and ``initialising`` waits for the replacement's Ready.

A change never blocks: :meth:`Change.advance` looks at the instance table, acts, and returns. The node
owns one :class:`Changes` table with at most one change per app; changes of different apps are
independent. An exception inside one change fails that change (logged and counted) and never the loop.
The change reaches the node only through the small :class:`ChangeHost` interface below.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpuprims.cpushare import CpuShare
from orchestrator.control.errors import ChangeError
from orchestrator.control.records import InstanceStats
from orchestrator.control.spec import InstanceSpec
from orchestrator.node.state import AppState, InstanceState, Role

log = logging.getLogger("gpuprims.reconfig")

#: How long after a switch the change waits for the new instance's first answer (its heartbeat) to
#: compute the switch's downtime from the data path; after that the downtime stays unknown (None).
DATA_PATH_WAIT_S = 30.0



def model_key(spec: InstanceSpec) -> str:
    """What tells two instances' models apart in a change of model: a model file's path, version and
    content fingerprint (a zoo model's name)."""
    if spec.model_path is None:
        return spec.model
    return f"{spec.model_path}|{spec.model_version}|{spec.model_fingerprint}"


class Phase(str, enum.Enum):
    PENDING = "pending"
    INITIALISING = "initialising"
    SWITCHED = "switched"
    DRAINING = "draining"
    DONE = "done"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (Phase.DONE, Phase.FAILED)


class ChangeHost(Protocol):
    """What a change needs from the node: its tables and a few public actions (the node's
    :class:`~orchestrator.node.supervisor.Supervisor` implements it)."""

    apps: dict[str, AppState]
    instances: dict[str, InstanceState]

    def shadow_of(self, app_name: str) -> InstanceState | None: ...
    def spawn_shadow(self, app_name: str) -> InstanceState: ...
    def spawn_active(self, app_name: str, gpu_pct: int, share: CpuShare | None) -> InstanceState: ...
    def init_shadow(self, st: InstanceState, gpu_pct: int, share: CpuShare | None) -> None: ...
    def share_for(self, app_name: str, gpu_pct: int, index: int) -> CpuShare | None: ...
    def route(self, app_name: str) -> None: ...
    def finish(self, st: InstanceState) -> None: ...
    def kill(self, st: InstanceState, role: Role = Role.STOPPING) -> None: ...
    def record(self, event: dict[str, Any]) -> None: ...


@dataclass
class Change:
    """One change of one app's share (see the module docstring)."""

    id: int
    app: str
    from_pct: int
    to_pct: int
    method: str = "overlap"  # overlap | restart
    origin: str = "set-gpu"  # set-gpu | monitor | api
    reason: str | None = None  # why it was asked for (the monitor's verdict and figures)
    timeout_s: float = 180.0
    #: A change of model (a model file's new version or file, :func:`model_key`): every active that does not
    #: serve it is replaced, at the same share too, and only a shadow of it takes over. None: a change of share.
    model: str | None = None
    phase: Phase = Phase.PENDING
    error: str | None = None
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    phases: list[tuple[str, float]] = field(default_factory=list)  # (phase, seconds since start)
    switched: list[dict[str, Any]] = field(default_factory=list)
    _old: str | None = None
    _new: str | None = None
    _index: int = 0
    _done_with: set[str] = field(default_factory=set)
    _phase_deadline: float = 0.0
    _t_init: float = 0.0

    def __post_init__(self) -> None:
        if self.method not in ("overlap", "restart"):
            raise ValueError(f"method must be 'overlap' or 'restart', got {self.method!r}")
        self._enter(Phase.PENDING)

    # -- the machine ------------------------------------------------------------------------------------
    def advance(self, host: ChangeHost) -> None:
        """Move as far as the instance table allows now, without waiting."""
        for _ in range(16):  # bounded: each pass either changes phase or returns
            if self.phase.terminal:
                return
            before = self.phase, self._old
            if self.method == "overlap":
                self._overlap(host)
            else:
                self._restart(host)
            if (self.phase, self._old) == before:
                return

    def fail(self, host: ChangeHost, reason: str) -> None:
        """End the change as failed: a shadow it was initialising is discarded; the old instances keep
        serving at their share."""
        if self.phase.terminal:
            return
        if self.method == "overlap" and self._new is not None and self.phase in (Phase.PENDING, Phase.INITIALISING):
            # (A restart's replacement is already the app's active: the supervisor looks after it.)
            st = host.instances.get(self._new)
            if st is not None and st.role == Role.SHADOW:
                st.error = st.error or "discarded by a failed change"
                host.kill(st, role=Role.SHADOW)
        self.error = reason
        self._enter(Phase.FAILED)
        log.error("change %d of %s to %d%% failed: %s", self.id, self.app, self.to_pct, reason)
        host.record({"event": "change_failed", "app": self.app, "change": self.id, "reason": reason})

    def _enter(self, phase: Phase) -> None:
        self.phase = phase
        now = time.monotonic()
        self.phases.append((phase.value, round(now - self.started, 4)))
        self._phase_deadline = now + self.timeout_s
        if phase.terminal:
            self.ended = now

    def _timed_out(self) -> bool:
        return time.monotonic() > self._phase_deadline

    def _current_old(self, host: ChangeHost) -> InstanceState | None:
        """The instance this step replaces: the one picked, or, if it died meanwhile, the replacement the
        supervisor started for it (and so on). Without this the replacement would outlive the change
        beside the new instance: each active killed during a change would add one to the app."""
        for _ in range(64):  # bounded: each pass follows one replacement
            st = host.instances.get(self._old or "")
            if st is not None:
                return st
            nxt = next((o for o in host.instances.values() if o.replaces == self._old and o.app == self.app), None)
            if nxt is None:
                return None
            log.info("change %d of %s: %s died; its replacement %s is replaced instead", self.id, self.app,
                     self._old, nxt.name)
            self._done_with.add(self._old or "")
            self._old = nxt.name
        return None

    def _next_old(self, host: ChangeHost) -> InstanceState | None:
        """The next active instance still at another share (replacements started meanwhile included)."""
        cands = sorted((st for st in host.instances.values()
                        if st.app == self.app and st.role == Role.ACTIVE and st.name not in self._done_with
                        and (st.spec.gpu_pct != self.to_pct or self._other_model(st))), key=lambda st: st.name)
        return cands[0] if cands else None

    def _other_model(self, st: InstanceState) -> bool:
        """Whether ``st`` serves another model than a change of model brings."""
        return self.model is not None and model_key(st.spec) != self.model

    def _complete(self, host: ChangeHost) -> None:
        host.apps[self.app].gpu_pct = self.to_pct
        self._enter(Phase.DONE)
        total_ms = (self.ended or time.monotonic()) - self.started
        host.record({"event": "changed" if self.method == "overlap" else "restarted", "app": self.app,
                     "change": self.id, "gpu_pct": self.to_pct, "switched": self.switched,
                     "total_ms": round(total_ms * 1e3, 1)})
        log.info("%s now at %d%% (%s, change %d): %s", self.app, self.to_pct, self.method, self.id, self.switched)

    def _overlap(self, host: ChangeHost) -> None:
        if self.phase is Phase.PENDING:
            if self._old is None:
                old = self._next_old(host)
                if old is None:
                    self._complete(host)
                    return
                self._old = old.name
            if self._new is None:
                shadow = host.shadow_of(self.app)
                if shadow is not None and self._other_model(shadow):  # a shadow of the model being replaced
                    host.kill(shadow, role=Role.STOPPING)
                    shadow = None
                shadow = shadow or host.spawn_shadow(self.app)
                self._new = shadow.name
            shadow = host.instances.get(self._new)
            if shadow is None or shadow.error is not None:
                why = shadow.error if shadow is not None else "it exited"
                self.fail(host, f"shadow {self._new} failed before it was ready: {why}")
                return
            if shadow.ready:
                self._t_init = time.monotonic()
                host.init_shadow(shadow, self.to_pct, host.share_for(self.app, self.to_pct, self._index))
                self._enter(Phase.INITIALISING)
            elif self._timed_out():
                self.fail(host, f"shadow {self._new} start did not happen within {self.timeout_s:.0f} s; raise "
                                "node.change_timeout_s if needed")
        elif self.phase is Phase.INITIALISING:
            shadow = host.instances.get(self._new or "")
            if shadow is None or shadow.error is not None:
                why = shadow.error if shadow is not None else "it exited"
                self.fail(host, f"shadow {self._new} failed to initialise at {self.to_pct}%: {why}; "
                                f"{self.app} keeps serving at {self.from_pct}%")
            elif shadow.initialized:
                self._switch(host, shadow)
            elif self._timed_out():
                self.fail(host, f"shadow {self._new} initialisation did not happen within {self.timeout_s:.0f} s; "
                                f"raise node.change_timeout_s if needed; {self.app} keeps serving at "
                                f"{self.from_pct}%")
        elif self.phase is Phase.SWITCHED:
            old = self._current_old(host)
            if old is not None and old.role == Role.FINISHING:
                if old.ready:
                    host.finish(old)
                else:  # a replacement still starting has served nothing: what its queue holds is requeued
                    host.kill(old, role=Role.FINISHING)
            self._enter(Phase.DRAINING)
        elif self.phase is Phase.DRAINING:
            old = host.instances.get(self._old or "")
            if old is not None and not old.ended and self._timed_out():
                log.error("%s did not report Ended within %.0f s; killing it (what it holds is requeued)",
                          old.name, self.timeout_s)
                host.kill(old, role=Role.FINISHING)
                old = None
            if old is None or old.ended:
                self.switched[-1]["old_served"] = _served(old)
                self.switched[-1]["old_last_answer_ns"] = _last_answer(old)
                self._next_instance(host)

    def _switch(self, host: ChangeHost, shadow: InstanceState) -> None:
        init_ms = (time.monotonic() - self._t_init) * 1e3
        t = time.monotonic()
        shadow.role = Role.ACTIVE
        shadow.spec.gpu_pct = self.to_pct
        old = self._current_old(host)
        if old is not None and old.role == Role.ACTIVE:
            old.role = Role.FINISHING  # off the route from here on; Finish follows
        host.route(self.app)
        switch_ns = time.monotonic_ns()
        switch_ms = (time.monotonic() - t) * 1e3
        self.switched.append({"from": self._old, "to": shadow.name, "init_ms": round(init_ms, 1),
                              "route_switch_ms": round(switch_ms, 3), "old_served": None,
                              "prewarmed": shadow.info.get("prewarm") == "used", "switch_ns": switch_ns,
                              **_pending_data_path()})
        host.record({"event": "switch", "app": self.app, "change": self.id, "from": self._old, "to": shadow.name,
                     "gpu_pct": self.to_pct})
        self._enter(Phase.SWITCHED)

    def _next_instance(self, host: ChangeHost) -> None:
        """On to the next active instance still at another share, or done when there is none."""
        if self._old is not None:
            self._done_with.add(self._old)
        if self._new is not None:
            self._done_with.add(self._new)
        self._old = self._new = None
        self._index += 1
        if self._next_old(host) is None:
            self._complete(host)
        else:
            self._enter(Phase.PENDING)

    def _restart(self, host: ChangeHost) -> None:
        if self.phase is Phase.PENDING:
            old = self._next_old(host)
            if old is None:
                self._complete(host)
                return
            self._old = old.name
            self._t_init = time.monotonic()
            new = host.spawn_active(self.app, self.to_pct, host.share_for(self.app, self.to_pct, self._index))
            self._new = new.name
            # The replacement takes the route before the old one dies, so what the old one held is
            # requeued into its queue and no request meets an app without one.
            host.kill(old)
            host.route(self.app)
            self.switched.append({"from": old.name, "to": new.name, "init_ms": None, "old_served": _served(old),
                                  "switch_ns": time.monotonic_ns(), **_pending_data_path(),
                                  # Killed: its last heartbeat's last answer (up to heartbeat_ms stale).
                                  "old_last_answer_ns": _last_answer(old)})
            self._enter(Phase.INITIALISING)
        elif self.phase is Phase.INITIALISING:
            new = host.instances.get(self._new or "")
            if new is None or new.error is not None:
                self.fail(host, f"{self._new} failed to start at {self.to_pct}%")
            elif new.ready:
                self.switched[-1]["init_ms"] = round((time.monotonic() - self._t_init) * 1e3, 1)
                self._next_instance(host)
            elif self._timed_out():
                self.fail(host, f"{self._new} start did not happen within {self.timeout_s:.0f} s; raise "
                                "node.change_timeout_s if needed")

    def observe_data_path(self, host: ChangeHost) -> bool:
        """Fill each switch's downtime from the data path once the new instance has answered (its
        heartbeat says when). Returns True while some switch still waits for it.

        For each switch: ``answer_gap_ms`` = the new instance's first OK answer - the old one's last
        (negative: they overlapped, the old one still draining when the new one answered);
        ``new_first_wait_ms`` = that first answer - when the first request the new instance took had
        arrived (or the switch, if later: a request requeued from a killed instance waited there
        first), less the model time of that batch: how long the new instance kept requests waiting
        before it served; ``downtime_ms`` = max(0, min(answer_gap_ms, new_first_wait_ms)): the part of
        the pause in answers the new instance caused by not serving at once (a pause with no requests
        arriving is not downtime)."""
        waiting = False
        for sw in self.switched:
            if sw.get("data_path") != "waiting":
                continue
            new = host.instances.get(sw["to"])
            stats = new.stats if new is not None and new.stats is not None else InstanceStats()
            first = stats.first_ok_ns
            old_last = sw.get("old_last_answer_ns")
            if first and (old_last is not None or self.phase.terminal):
                sw["new_first_answer_ns"] = first
                took = max(stats.first_request_ns, int(sw["switch_ns"]))
                sw["new_first_wait_ms"] = round(max(0.0, (first - took) / 1e6 - (stats.first_model_ms or 0.0)), 3)
                gap = (first - old_last) / 1e6 if old_last else None
                sw["answer_gap_ms"] = round(gap, 3) if gap is not None else None
                wait = sw["new_first_wait_ms"]
                sw["downtime_ms"] = (round(max(0.0, min(gap, wait)), 3) if gap is not None and wait is not None
                                     else wait)
                sw["data_path"] = "measured"
                host.record({"event": "switch_measured", "app": self.app, "change": self.id, "from": sw["from"],
                             "to": sw["to"], "downtime_ms": sw["downtime_ms"], "answer_gap_ms": sw["answer_gap_ms"],
                             "new_first_wait_ms": sw["new_first_wait_ms"]})
            elif new is None or time.monotonic_ns() - sw["switch_ns"] > DATA_PATH_WAIT_S * 1e9:
                sw["data_path"] = "unknown (the new instance answered nothing it reported)"
            else:
                waiting = True
        return waiting

    # -- reporting --------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-able view for status and the CLI."""
        return {"id": self.id, "app": self.app, "from_pct": self.from_pct, "to_pct": self.to_pct,
                "method": self.method, "origin": self.origin, "reason": self.reason, "phase": self.phase.value,
                "error": self.error, "model": self.model,
                "phases": [list(p) for p in self.phases], "switched": self.switched,
                "elapsed_s": round((self.ended or time.monotonic()) - self.started, 3)}

    def message(self) -> str:
        """One line saying how the change ended (or where it is)."""
        if self.phase is Phase.FAILED:
            return str(self.error)
        if self.phase is not Phase.DONE:
            return f"change {self.id} of {self.app} to {self.to_pct}% is {self.phase.value}"
        total_ms = ((self.ended or time.monotonic()) - self.started) * 1e3
        if self.method == "restart":
            return f"{self.app} restarted at {self.to_pct}% in {total_ms:.0f} ms"
        worst = max((s["route_switch_ms"] for s in self.switched), default=0.0)
        return (f"{self.app} now at {self.to_pct}%: {len(self.switched)} instance(s) switched with "
                f"Overlapped-Execution in {total_ms:.0f} ms (route switch {worst:.3f} ms)")


def _pending_data_path() -> dict[str, Any]:
    return {"data_path": "waiting", "old_last_answer_ns": None, "new_first_answer_ns": None,
            "new_first_wait_ms": None, "answer_gap_ms": None, "downtime_ms": None}


def _last_answer(st: InstanceState | None) -> int | None:
    """When the instance last answered (ns, CLOCK_MONOTONIC) by its last heartbeat; None if never."""
    return st.stats.last_ok_ns or None if st is not None and st.stats is not None else None


def _served(st: InstanceState | None) -> int | None:
    """What the instance answered OK by its last heartbeat; None with no heartbeat."""
    return st.stats.ok if st is not None and st.stats is not None else None


class Changes:
    """The node's changes: at most one running per app, the finished ones kept for ``status``."""

    def __init__(self, host: ChangeHost | None, check: Callable[[str, int], None], *,
                 apps: Mapping[str, AppState] | None = None, record: Callable[[dict[str, Any]], None] | None = None,
                 timeout_s: float = 180.0, keep: int = 50) -> None:
        #: what the changes act through (the node's supervisor, set once it is up); None: accepted ones wait
        self.host = host
        if host is not None:
            apps = host.apps if apps is None else apps
            record = host.record if record is None else record
        if apps is None or record is None:
            raise ValueError("Changes without a host takes the node's apps and record")
        self.apps: Mapping[str, AppState] = apps  # submit reads and records through these, before the host too
        self._record = record
        self.check = check
        self.timeout_s = timeout_s
        self.running: dict[str, Change] = {}
        self.finished: list[Change] = []
        self.keep = keep
        self.counts: dict[str, int] = {"submitted": 0, "done": 0, "failed": 0, "refused": 0}
        self._ids = itertools.count(1)
        #: Apps no new change may start on (their change is running); tests may hold one directly.
        self.changing: set[str] = set()
        self._measuring: list[Change] = []  # finished, a switch still waiting for its data-path downtime

    def submit(self, app: str, to_pct: int, *, method: str = "overlap", origin: str = "set-gpu",
               reason: str | None = None, model: str | None = None) -> Change:
        """Accept a change (it starts on the next advance) or raise ChangeError saying why not. With
        ``model`` (:func:`model_key` of the app's new model file, already its config) it is a change of model:
        every active is replaced by an instance of the new model, through a shadow, even at the same share."""
        try:
            self.check(app, to_pct)
        except (KeyError, ValueError) as e:
            self.counts["refused"] += 1
            raise ChangeError(e.args[0] if e.args else str(e)) from e
        if app in self.changing or app in self.running:
            self.counts["refused"] += 1
            raise ChangeError(f"a change of {app} is already in progress; try again when it completes")
        state = self.apps[app]
        if model is not None and method != "overlap":
            self.counts["refused"] += 1
            raise ChangeError("a change of model is made by Overlapped-Execution only")
        ch = Change(id=next(self._ids), app=app, from_pct=state.gpu_pct, to_pct=to_pct, method=method,
                    origin=origin, reason=reason, timeout_s=self.timeout_s, model=model)
        self.counts["submitted"] += 1
        if to_pct == state.gpu_pct and method == "overlap" and model is None:
            ch.switched = []
            ch._enter(Phase.DONE)
            self._finish(ch)
            return ch
        self.running[app] = ch
        self.changing.add(app)
        self._record({"event": "change_accepted", "app": app, "change": ch.id, "from_pct": ch.from_pct,
                          "to_pct": to_pct, "method": method, "origin": origin, "reason": reason})
        return ch

    def advance(self) -> None:
        """Advance every running change; one that raises fails alone. Finished changes whose switches
        still wait for the new instance's first answer get their data-path downtime filled in."""
        if self.host is None:
            return
        host = self.host
        self._measuring = [ch for ch in self._measuring if self._observe(ch, host)]
        for app, ch in list(self.running.items()):
            try:
                ch.advance(host)
            except Exception as e:
                log.exception("change %d of %s raised", ch.id, app)
                ch.fail(host, f"internal error: {type(e).__name__}: {e}")
            if ch.phase.terminal:
                del self.running[app]
                self.changing.discard(app)
                self._finish(ch)

    def cancel_all(self, reason: str) -> None:
        """Fail every running change (the node is stopping)."""
        if self.host is None:  # (nothing runs before there is a host)
            return
        for app, ch in list(self.running.items()):
            ch.fail(self.host, reason)
            del self.running[app]
            self.changing.discard(app)
            self._finish(ch)

    def settling(self, now: float, settle_s: float) -> set[str]:
        """Apps whose last change switched (done) less than ``settle_s`` before ``now``."""
        last: dict[str, Change] = {}
        for ch in self.finished:
            last[ch.app] = ch
        return {app for app, ch in last.items()
                if ch.phase is Phase.DONE and ch.ended is not None and now - ch.ended < settle_s}

    @property
    def measuring(self) -> bool:
        """True while a finished change still waits for a switch's data-path downtime."""
        return bool(self._measuring)

    def get(self, change_id: int) -> Change | None:
        for ch in self:
            if ch.id == change_id:
                return ch
        return None

    def __iter__(self) -> Iterator[Change]:
        yield from self.running.values()
        yield from self.finished

    def _observe(self, ch: Change, host: ChangeHost) -> bool:
        try:
            return ch.observe_data_path(host)
        except Exception:
            log.exception("change %d: measuring the switch from the data path failed", ch.id)
            return False

    def _finish(self, ch: Change) -> None:
        if self.host is not None and self._observe(ch, self.host):
            self._measuring.append(ch)
        self.counts["done" if ch.phase is Phase.DONE else "failed"] += 1
        self.finished.append(ch)
        del self.finished[: -self.keep]


class Steppable(Protocol):
    changes: Changes

    def step(self, timeout_ms: float = 100.0) -> None: ...


def run_change(node: Steppable, app_name: str, new_pct: int, *, method: str, timeout_s: float | None) -> tuple[bool, str]:
    """Submit a change and run the node's loop until it ends (for callers that own the loop: tests,
    benchmarks, scripts). Returns (ok, message)."""
    try:
        ch = node.changes.submit(app_name, new_pct, method=method, origin="api")
    except ChangeError as e:
        return False, str(e)
    limit = None if timeout_s is None else time.monotonic() + 4 * timeout_s
    while not ch.phase.terminal:
        node.step(5)
        if limit is not None and time.monotonic() > limit and not ch.phase.terminal:
            ch.fail(node.changes.host, "gave up waiting for the change")
    return ch.phase is Phase.DONE, ch.message()


def change_gpu_pct(node: Steppable, app_name: str, new_pct: int, *, timeout_s: float | None = None) -> tuple[bool, str]:
    """Move every instance of the app to ``new_pct`` with Overlapped-Execution, driving the node's loop
    until the change ends. Returns (ok, message)."""
    return run_change(node, app_name, new_pct, method="overlap", timeout_s=timeout_s)


def restart_gpu_pct(node: Steppable, app_name: str, new_pct: int, *, timeout_s: float | None = None) -> tuple[bool, str]:
    """Baseline: kill each active instance and start a new one at ``new_pct`` (the downtime Overlapped-
    Execution avoids), driving the node's loop until done. Returns (ok, message)."""
    return run_change(node, app_name, new_pct, method="restart", timeout_s=timeout_s)
