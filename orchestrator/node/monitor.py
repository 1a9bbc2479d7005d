"""Monitoring and detection: when an app is overloaded or under-uses its share, change its GPU%.

Every ``interval_s`` the node's view (`orchestrator.control.records.NodeView`) is sampled. Per app, over the last ``window_s``:
arrival rate, service rate (answered per second), queue length, SLO attainment of what was answered,
and utilisation (fraction of wall time its instances spent running the model, per instance).

- **Overloaded**: attainment below ``slo_target``, or arrivals exceed service by ``overload_ratio``
  while the queue grows. The app's share goes up: to what its profile says is needed for the arrival
  rate when a profile is given (``needed_pct``), else one ``step_pct``; never above what the other
  apps leave free on the device.
- **Under-using**: utilisation below ``underuse_util`` with attainment at target and no queue. The
  share goes down by ``step_pct`` (not below ``min_pct``, nor below what the profile says is needed).

A verdict must hold for ``confirm`` consecutive samples, and an app is not changed again within
``dwell_s`` of its last change, so it does not flap. The node tells the monitor of every change of an
app's share (:meth:`Monitor.changed`, whoever asked for it): the window then starts afresh, so it never
mixes samples from before and after, and the dwell counts from when the change ended. The node makes
only changes that change what the instance gets (on the CPU backend whole cores: see
``Placement.effective_target``), and a step down only if the instance's utilisation, scaled to its
smaller capacity, stays within ``max_util_after`` (hysteresis between ``underuse_util`` and that).
Every decision carries its reason; :meth:`Monitor.autoscale` (the node's monitor duty) logs it, keeps
it in ``status()["decisions"]`` (made or not, and why), puts it on the change it asks for (``reason``
in ``status()["changes"]``) and counts it in the metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from orchestrator.config.schema import NodeConfig
from orchestrator.control.errors import ChangeError
from orchestrator.control.records import AppView, NodeView
from orchestrator.node.placement import Placement
from orchestrator.node.reconfig import Change, Changes
from orchestrator.node.state import AppState

log = logging.getLogger("gpuprims.monitor")


@dataclass(frozen=True)
class MonitorPolicy:
    """Thresholds of the detector (see the module docstring)."""

    interval_s: float = 1.0
    window_s: float = 5.0
    slo_target: float = 0.99
    overload_ratio: float = 1.05
    underuse_util: float = 0.3
    step_pct: int = 10
    min_pct: int = 5
    confirm: int = 3
    dwell_s: float = 15.0
    min_served: int = 20  # answered requests in the window before attainment counts
    max_util_after: float = 0.7  # a step down is made only if the projected utilisation stays below this

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.window_s < self.interval_s:
            raise ValueError(f"need 0 < interval_s <= window_s, got {self.interval_s}, {self.window_s}")
        if not 0 < self.slo_target <= 1:
            raise ValueError(f"slo_target must be in (0, 1], got {self.slo_target}")
        if self.overload_ratio < 1:
            raise ValueError(f"overload_ratio must be >= 1, got {self.overload_ratio}")
        if not 1 <= self.step_pct <= 100 or not 1 <= self.min_pct <= 100:
            raise ValueError("step_pct and min_pct must be in 1..100")
        if self.confirm < 1 or self.dwell_s < 0:
            raise ValueError("confirm must be >= 1 and dwell_s >= 0")
        if not self.underuse_util <= self.max_util_after <= 1:
            raise ValueError(f"need underuse_util <= max_util_after <= 1, got {self.underuse_util}, "
                             f"{self.max_util_after}")


@dataclass
class AppWindow:
    """Rates of one app over the sampling window."""

    arrival_rps: float
    service_rps: float
    queue: int
    queue_delta: int
    attainment: float | None
    served: int
    utilisation: float


@dataclass
class Decision:
    """A change the monitor asks for, with its reason and the figures behind it."""

    t: float
    app: str
    from_pct: int
    to_pct: int
    verdict: str  # "overloaded" | "underused"
    reason: str
    window: dict[str, Any] = field(default_factory=dict)


@dataclass
class _AppTrack:
    samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    streak_verdict: str = ""
    streak: int = 0
    last_change: float = -1e18


NeededPct = Callable[[str, float], int | None]


class AutoscaleHost(Protocol):
    """What the monitor's duty reads and asks of the node (`orchestrator.node.node.Node` has it)."""

    cfg: NodeConfig
    apps: dict[str, AppState]
    changes: Changes
    placement: Placement

    def view(self) -> NodeView: ...

    def set_gpu(self, app: str, gpu_pct: int, *, origin: str = ..., method: str = ...,
                reason: str | None = ...) -> Change: ...

    def record(self, event: dict[str, Any]) -> None: ...


class Monitor:
    """Samples a node's status and proposes GPU% changes (pure: the caller applies them)."""

    def __init__(self, policy: MonitorPolicy | None = None, *, needed_pct: NeededPct | None = None) -> None:
        self.policy = policy or MonitorPolicy()
        self.needed_pct = needed_pct
        self._apps: dict[str, _AppTrack] = {}
        self.decisions: list[Decision] = []
        self._told: set[int] = set()  # finished changes already told to `changed`

    @staticmethod
    def _totals(app: AppView) -> dict[str, float]:
        t, active = app.totals, app.active
        return {
            "received": float(t.received),
            "served": float(t.answered),
            "within": float(t.within_slo),
            "queue": float(sum(i.queue_len for i in active)),
            "busy_ms": float(t.busy_ms),  # the app's total over its live and gone instances
            "instances": float(max(1, len(active))),
        }

    def changed(self, app: str, now: float) -> None:
        """The app's share changed (or is changing) at ``now``: forget the samples from before, start
        the confirmation over, and count the dwell time from here."""
        tr = self._apps.setdefault(app, _AppTrack())
        tr.samples.clear()
        tr.streak_verdict, tr.streak = "", 0
        tr.last_change = max(tr.last_change, now)

    def window(self, app: str) -> AppWindow | None:
        """The app's rates over the current window, or None before two samples exist."""
        tr = self._apps.get(app)
        if tr is None or len(tr.samples) < 2:
            return None
        (t0, a), (t1, b) = tr.samples[0], tr.samples[-1]
        dt = max(t1 - t0, 1e-9)
        served = int(b["served"] - a["served"])
        return AppWindow(
            arrival_rps=(b["received"] - a["received"]) / dt,
            service_rps=served / dt,
            queue=int(b["queue"]),
            queue_delta=int(b["queue"] - a["queue"]),
            attainment=(b["within"] - a["within"]) / served if served >= max(1, self.policy.min_served) else None,
            served=served,
            utilisation=max(0.0, (b["busy_ms"] - a["busy_ms"]) / 1e3 / dt / b["instances"]),
        )

    def sample(self, now: float, view: NodeView) -> list[Decision]:
        """Feed one view of the node taken at ``now`` (seconds); return the changes to make now."""
        p = self.policy
        out: list[Decision] = []
        apps: Mapping[str, AppView] = view.apps
        used = {name: a.gpu_pct * max(1, len(a.active)) for name, a in apps.items()}
        for name, a in apps.items():
            tr = self._apps.setdefault(name, _AppTrack())
            tr.samples.append((now, self._totals(a)))
            while len(tr.samples) > 2 and now - tr.samples[1][0] >= p.window_s:
                tr.samples.pop(0)
            w = self.window(name)
            if w is None:
                continue
            verdict, reason = self._verdict(w)
            if verdict != tr.streak_verdict:
                tr.streak_verdict, tr.streak = verdict, 0
            tr.streak += 1 if verdict else 0
            if not verdict or tr.streak < p.confirm or now - tr.last_change < p.dwell_s:
                continue
            pct = a.gpu_pct
            n = max(1, len(a.active))
            # Only the apps on the same device compete for its share.
            free = 100 - sum(v for k, v in used.items() if k != name and apps[k].gpu == a.gpu)
            need = self.needed_pct(name, w.arrival_rps) if self.needed_pct else None
            if verdict == "overloaded":
                target = need if need is not None and need > pct else pct + p.step_pct
                target = min(target, free // n, 100)
            else:
                target = max(pct - p.step_pct, p.min_pct, need or 0)
            if target == pct or target < 1:
                continue
            d = Decision(now, name, pct, int(target), verdict, reason, dict(vars(w)))
            tr.last_change, tr.streak = now, 0
            self.decisions.append(d)
            out.append(d)
        return out

    def _verdict(self, w: AppWindow) -> tuple[str, str]:
        p = self.policy
        if w.attainment is not None and w.attainment < p.slo_target:
            return "overloaded", f"SLO attainment {w.attainment:.1%} < {p.slo_target:.0%}"
        if w.arrival_rps > w.service_rps * p.overload_ratio and w.queue_delta > 0:
            return "overloaded", (f"arrivals {w.arrival_rps:.0f}/s exceed service {w.service_rps:.0f}/s "
                                  f"and the queue grew by {w.queue_delta}")
        if (w.utilisation < p.underuse_util and w.queue == 0 and w.served > 0
                and (w.attainment is None or w.attainment >= p.slo_target)):
            return "underused", f"busy {w.utilisation:.0%} of the time < {p.underuse_util:.0%}, no queue"
        return "", ""

    # -- the node's monitor duty ----------------------------------------------------------------------
    def autoscale(self, host: AutoscaleHost, now: float) -> None:
        """Sample ``host``'s view and make the changes it calls for, each as a change of share of
        origin ``monitor``; every decision, made or not, is recorded with its reason."""
        # A window must not mix samples from before and after a change (of any origin), and the
        # dwell counts from when the change ended.
        for ch in host.changes:
            if not ch.phase.terminal:
                self.changed(ch.app, now)
            elif ch.id not in self._told and ch.ended is not None:
                self._told.add(ch.id)
                self.changed(ch.app, ch.ended)
        for d in self.sample(now, host.view()):
            if d.app in host.changes.running:
                continue  # its change is still running; the monitor asks again if it still holds
            self._apply(host, d)

    def _apply(self, host: AutoscaleHost, d: Decision) -> None:
        # A change that does not change what the instances get (on the CPU backend: whole cores)
        # costs a shadow start and buys nothing: take the next share that does, or none.
        placement, p = host.placement, self.policy
        others = placement.held_beside(d.app)  # on the app's own device
        n = max(1, host.apps[d.app].instances)
        hi = 100 if host.cfg.node.allow_oversubscribe else (100 - others) // n
        target = placement.effective_target(d.from_pct, d.to_pct, p.min_pct, hi)
        base = {"event": "decision", "app": d.app, "verdict": d.verdict, "reason": d.reason,
                "from_pct": d.from_pct}
        if target is None:
            host.record({**base, "to_pct": d.to_pct, "ok": False, "automatic": True,
                         "result": f"not made: no share toward {d.to_pct}% changes what {d.app} gets "
                                   f"({placement.capacity(d.from_pct)} at {d.from_pct}%)"})
            return
        if d.verdict == "underused":
            # Hysteresis: down only if the instance would still be comfortably below busy after it
            # (its utilisation scaled by what it has now over what it would get).
            after = d.window.get("utilisation", 0.0) * (placement.capacity(d.from_pct)
                                                        / max(1, placement.capacity(target)))
            if after > p.max_util_after:
                host.record({**base, "to_pct": target, "ok": False, "automatic": True,
                             "result": f"not made: at {target}% it would be busy {after:.0%} of the time "
                                       f"(> max_util_after {p.max_util_after:.0%})"})
                return
        log.info("monitor: %s %s -> change %d%% to %d%% (%s)", d.app, d.verdict, d.from_pct, target, d.reason)
        try:
            ch = host.set_gpu(d.app, target, origin="monitor", reason=f"{d.verdict}: {d.reason}")
            ok, text = True, f"change {ch.id} accepted"
        except ChangeError as e:
            ok, text = False, str(e)
            log.warning("monitor: change of %s refused: %s", d.app, text)
        host.record({**base, "to_pct": target, "asked_pct": d.to_pct, "ok": ok, "automatic": True, "result": text})
