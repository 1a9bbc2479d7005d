"""The fleet's placement: which (node, GPU) runs each app, at what share, and where its standby waits.

Pure bookkeeping (no Ray, no processes), so the controller's decisions are testable on their own:

- **Sizing** (:func:`size_app`): an app with a fixed ``gpu_pct`` keeps it; one with ``gpu_pct: auto``
  and a profile of its model gets the smallest share that serves its expected rate within its SLO
  (the node's own rule, ``Placement.needed_pct``), then the instance count Multi-Model finds best at
  that share; without a profile it gets ``default_pct``.
- **Bins** are (node, GPU) pairs with 100 % each. The primary and the (warm) standby both hold their
  share: a standby is a loaded copy, so a route flip needs no start.
- **Packing**: best fit (the fullest bin it still fits), apps taken largest first (and, when that
  leaves apps out, smallest first and by expected load per percent too, keeping whichever places the
  most expected load); Param-Share
  partners (same model, seed, classes and input shape) prefer a bin that already holds their model,
  so they map one copy of the weights; a standby never goes on its primary's machine.
- **Scoring**: with profiles, each candidate bin is run in the project's simulator
  (``gpuprims.sched.sim``) with the apps it would hold at their expected rates; a bin whose apps'
  goodput within the SLO falls below ``min_goodput`` is passed over while another fits.
- **Stability**: an app whose primary is alive and not draining is never moved (the plan starts
  from the current assignments); only apps whose node died or is drained, or that are new, move.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuprims.profile import Profile
from gpuprims.sched import multi_model
from gpuprims.sched.dag import single
from gpuprims.sched.scheduler import make_scheduler
from gpuprims.sched.sim import Arrival, Workload, simulate

#: Simulated time a candidate bin is scored over (ms) and the goodput it must keep.
SCORE_MS = 2000.0
MIN_GOODPUT = 0.99


@dataclass(frozen=True)
class Slot:
    """Where one copy of an app runs: a node, a GPU of it, the share per instance and the instance count."""

    node: str
    gpu: int
    gpu_pct: int
    instances: int = 1

    @property
    def bin(self) -> tuple[str, int]:
        return (self.node, self.gpu)

    @property
    def held(self) -> int:
        return self.gpu_pct * self.instances

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "gpu": self.gpu, "gpu_pct": self.gpu_pct, "instances": self.instances}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Slot:
        return cls(str(d["node"]), int(d["gpu"]), int(d["gpu_pct"]), int(d.get("instances", 1)))


@dataclass(frozen=True)
class Assignment:
    """An app's primary (routed to) and standby (loaded, routed to when the primary's node fails)."""

    app: str
    primary: Slot
    standby: Slot | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"app": self.app, "primary": self.primary.to_dict(),
                "standby": self.standby.to_dict() if self.standby else None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Assignment:
        sb = d.get("standby")
        return cls(str(d["app"]), Slot.from_dict(d["primary"]), Slot.from_dict(sb) if sb else None)


@dataclass(frozen=True)
class AppDemand:
    """What the planner needs of one app: its entry (apps.yaml keys), its expected rate, its sizing."""

    name: str
    entry: Mapping[str, Any]
    rate_rps: float | None = None

    @property
    def model(self) -> str:
        return str(self.entry.get("model") or "")

    @property
    def slo_ms(self) -> float:
        return float(self.entry["slo_ms"])

    @property
    def share_key(self) -> tuple[Any, ...]:
        """Apps with the same key can share one copy of the weights (Param-Share partners)."""
        e = self.entry
        return (e.get("model"), e.get("seed", 0), e.get("num_classes"), tuple(e.get("input_shape", (3, 224, 224))))

    @property
    def wants_standby(self) -> bool:
        return bool(self.entry.get("standby", True))


@dataclass(frozen=True)
class NodeView:
    """A machine as the planner sees it: its GPUs, and whether it may take apps."""

    name: str
    gpus: int
    alive: bool = True
    draining: bool = False

    @property
    def usable(self) -> bool:
        return self.alive and not self.draining


@dataclass
class Plan:
    """The planner's answer: every app's assignment, what could not be placed, and why each move was made."""

    assignments: dict[str, Assignment] = field(default_factory=dict)
    unplaced: dict[str, str] = field(default_factory=dict)
    reasons: list[dict[str, Any]] = field(default_factory=list)


def size_app(app: AppDemand, profile: Profile | None, *, default_pct: int) -> tuple[int, int, str]:
    """(instances, gpu_pct each, why) for one app (see the module docstring)."""
    e = app.entry
    n = e.get("instances", 1)
    if isinstance(e.get("gpu_pct"), int):
        return (n if isinstance(n, int) else 1), int(e["gpu_pct"]), "gpu_pct from its entry"
    if profile is None:
        return (n if isinstance(n, int) else 1), default_pct, f"no profile of {app.model}: default {default_pct}%"
    max_batch = int(e.get("max_batch", 8))
    batches = [b for b in profile.batch_sizes if b <= max_batch] or [min(profile.batch_sizes)]
    need = None
    if app.rate_rps:
        for pct in sorted(profile.gpu_pcts):
            b = max(batches)
            ms = profile.latency_ms(b, pct, stat="p99")
            if ms <= app.slo_ms and b * 1000.0 / ms >= 1.2 * app.rate_rps:
                need = int(pct)
                break
    budget = need if need is not None else default_pct
    count, pct = multi_model(profile, max(1, min(100, budget)), app.slo_ms, batch_size=max(batches))
    if count < 1:
        return 1, budget, f"no instance count meets {app.slo_ms:g} ms at {budget}% by its profile: 1 x {budget}%"
    why = f"Multi-Model at {budget}% ({'serves ' + format(app.rate_rps, 'g') + ' req/s' if need else 'default'})"
    return count, pct, why


class Planner:
    """Places apps on (node, GPU) bins (see the module docstring)."""

    def __init__(self, profiles: Mapping[str, Profile] | None = None, *, default_pct: int = 25,
                 min_goodput: float = MIN_GOODPUT, simulate_ms: float = SCORE_MS) -> None:
        if not 1 <= default_pct <= 100:
            raise ValueError(f"default_pct must be in 1..100, got {default_pct}")
        self.profiles = dict(profiles or {})
        self.default_pct = default_pct
        self.min_goodput = min_goodput
        self.simulate_ms = simulate_ms

    def plan(self, apps: Iterable[AppDemand], nodes: Iterable[NodeView],
             current: Mapping[str, Assignment] | None = None) -> Plan:
        """A plan for ``apps`` on ``nodes`` that keeps every current assignment it can."""
        apps = list(apps)
        views = {n.name: n for n in nodes}
        usable = {name for name, v in views.items() if v.usable}
        current = dict(current or {})
        out = Plan()
        load: dict[tuple[str, int], int] = {}
        held: dict[tuple[str, int], list[tuple[AppDemand, Slot]]] = {}

        def take(app: AppDemand, s: Slot) -> None:
            load[s.bin] = load.get(s.bin, 0) + s.held
            held.setdefault(s.bin, []).append((app, s))

        by_name = {a.name: a for a in apps}
        # 1. What stays: a primary on a usable node stays; a standby on a usable node stays.
        todo: list[AppDemand] = []
        for app in apps:
            cur = current.get(app.name)
            if cur is None:
                todo.append(app)
                continue
            primary = cur.primary if cur.primary.node in usable else None
            standby = cur.standby if cur.standby and cur.standby.node in usable else None
            if primary is None and standby is not None:
                primary, standby = standby, None
                out.reasons.append({"app": app.name, "action": "promote", "to": primary.to_dict(),
                                    "reason": f"its node {cur.primary.node} is "
                                              f"{'draining' if cur.primary.node in views else 'gone'}; the "
                                              "standby becomes the primary"})
            if primary is None:
                todo.append(app)
                out.reasons.append({"app": app.name, "action": "lost", "reason": "primary and standby are gone"})
                continue
            take(app, primary)
            if standby is not None:
                take(app, standby)
            out.assignments[app.name] = Assignment(app.name, primary, standby)
        # 2. New or lost apps, largest share first (best-fit decreasing). When that leaves some out,
        #    smallest first and most expected load per percent are tried too, and the packing that
        #    places the most expected load (then the most apps) wins: largest first fills two GPUs with
        #    a 60 % app each where two 50 % apps and one 60 % app would fit.
        sized = {a.name: size_app(a, self.profiles.get(a.model), default_pct=self.default_pct) for a in todo}

        def share(a: AppDemand) -> int:
            return sized[a.name][0] * sized[a.name][1]

        def pack(order: list[AppDemand]) -> dict[str, Slot]:
            trial_load, trial_held = dict(load), {b: list(v) for b, v in held.items()}
            placed: dict[str, Slot] = {}
            for app in order:
                n, pct, _ = sized[app.name]
                slot = self._choose(app, n, pct, views, usable, trial_load, trial_held, avoid=None)
                if slot is not None:
                    trial_load[slot.bin] = trial_load.get(slot.bin, 0) + slot.held
                    trial_held.setdefault(slot.bin, []).append((app, slot))
                    placed[app.name] = slot
            return placed

        order = sorted(todo, key=lambda a: -share(a))
        placed = pack(order)
        if len(placed) < len(todo):
            def value(p: dict[str, Slot]) -> tuple[float, int]:
                return sum(float(a.rate_rps or 0) for a in todo if a.name in p), len(p)

            for other in (sorted(todo, key=share), sorted(todo, key=lambda a: -float(a.rate_rps or 0) / share(a))):
                trial = pack(other)
                if value(trial) > value(placed):
                    order, placed = other, trial
        for app in order:
            n, pct, why = sized[app.name]
            slot = placed.get(app.name)
            if slot is None:
                out.unplaced[app.name] = (f"no GPU has {n * pct}% free ({n} x {pct}%, {why}) on the "
                                          f"{len(usable)} usable node(s)")
                continue
            take(app, slot)
            out.assignments[app.name] = Assignment(app.name, slot)
            out.reasons.append({"app": app.name, "action": "place", "to": slot.to_dict(), "reason": why})
        # 3. Standbys, on another machine than the primary.
        for name, a in list(out.assignments.items()):
            app = by_name[name]
            if a.standby is not None or not app.wants_standby:
                continue
            p = a.primary
            slot = self._choose(app, p.instances, p.gpu_pct, views, usable, load, held, avoid=p.node)
            if slot is None:
                out.reasons.append({"app": name, "action": "no_standby",
                                    "reason": f"no other node has {p.held}% free on a GPU"})
                continue
            take(app, slot)
            out.assignments[name] = Assignment(name, p, slot)
            out.reasons.append({"app": name, "action": "standby", "to": slot.to_dict(),
                                "reason": f"warm copy on another machine than {p.node}"})
        return out

    def _choose(self, app: AppDemand, n: int, pct: int, views: Mapping[str, NodeView], usable: set[str],
                load: Mapping[tuple[str, int], int], held: Mapping[tuple[str, int], list[tuple[AppDemand, Slot]]],
                avoid: str | None) -> Slot | None:
        best: tuple[tuple[Any, ...], Slot] | None = None
        for node in sorted(usable):
            if node == avoid:
                continue
            for gpu in range(views[node].gpus):
                b = (node, gpu)
                if load.get(b, 0) + n * pct > 100:
                    continue
                slot = Slot(node, gpu, pct, n)
                partners = any(o.share_key == app.share_key for o, _ in held.get(b, []))
                score = self.score(app, slot, held.get(b, []))
                good = score is None or score >= self.min_goodput
                # good first, then Param-Share partners, then the fullest bin (best fit), then the name.
                key = (good, partners, load.get(b, 0), -gpu)
                if best is None or key > best[0]:
                    best = (key, slot)
        return None if best is None else best[1]

    def score(self, app: AppDemand, slot: Slot, others: list[tuple[AppDemand, Slot]]) -> float | None:
        """Goodput within the SLO (0-1) of the bin's apps with ``app`` added, in the simulator; None
        when a model has no profile or an app has no expected rate (then only fit decides)."""
        group = [*others, (app, slot)]
        if any(a.model not in self.profiles or not a.rate_rps for a, _ in group):
            return None
        sim_apps, loads = [], []
        for i, (a, s) in enumerate(group):
            for k in range(s.instances):
                sa = single(f"{a.name}.{i}.{k}", a.model, s.gpu_pct, a.slo_ms, gpu=0)
                sim_apps.append(sa)
                loads.append(Workload(sa, Arrival("poisson", float(a.rate_rps or 0) / s.instances)))
        try:
            sched = make_scheduler("spatiotemporal", sim_apps, self.profiles, num_gpus=1)
            rep = simulate(sched, loads, duration_ms=self.simulate_ms, warmup_ms=self.simulate_ms / 10)
        except (ValueError, RuntimeError):
            return 0.0  # the bin cannot run them together (e.g. a share outside a profile's range)
        offered = sum(int(r.get("offered", 0)) for r in rep["apps"].values())
        met = sum(int(r.get("met", 0)) for r in rep["apps"].values())
        return 1.0 if offered == 0 else met / offered


def route_table(version: int, assignments: Mapping[str, Assignment], apps: Mapping[str, AppDemand],
                app_ids: Mapping[str, int], addresses: Mapping[str, Mapping[str, Any]],
                suspects: Iterable[str] = (), models: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The routing table clients fetch: per app its wire app id and where to send (``primary``) and
    where to send again on a timeout (``standby``), each with the node's UDP and HTTP addresses. A
    primary on a suspected node is routed to its standby (the flip). ``models`` (per app: input shape,
    dtype, output size, batch, SLO; ``orchestrator.frontdoor.forward.route_model``) goes into each entry
    as ``model``, so that any node's front door can take the app's requests and forward them."""
    bad = set(suspects)
    out: dict[str, Any] = {}
    for name, a in sorted(assignments.items()):
        targets = [s for s in (a.primary, a.standby) if s is not None]
        live = [s for s in targets if s.node not in bad and s.node in addresses]
        order = live + [s for s in targets if s not in live and s.node in addresses]
        if not order:
            continue
        out[name] = {"app_id": app_ids[name], "slo_ms": apps[name].slo_ms if name in apps else None,
                     "primary": {**addresses[order[0].node], "node": order[0].node, "gpu": order[0].gpu},
                     "standby": ({**addresses[order[1].node], "node": order[1].node, "gpu": order[1].gpu}
                                 if len(order) > 1 else None)}
        if models and name in models:
            out[name]["model"] = dict(models[name])
    return {"version": version, "apps": out}


def reshare(assignments: Mapping[str, Assignment], app: str, gpu_pct: int) -> Assignment:
    """``app``'s assignment with ``gpu_pct`` per instance on its primary and its standby (an operator's
    change of share: the same bins, so nothing moves; each node applies it as an Overlapped-Execution
    change). ValueError when the app is not placed, the share is outside 1..100, or it does not fit
    one of its bins beside what the other apps hold there."""
    if not 1 <= gpu_pct <= 100:
        raise ValueError(f"gpu_pct must be in 1..100, got {gpu_pct}")
    cur = assignments.get(app)
    if cur is None:
        raise ValueError(f"app {app!r} is not placed; placed: {', '.join(sorted(assignments)) or 'none'}")
    held: dict[tuple[str, int], int] = {}
    for name, a in assignments.items():
        if name == app:
            continue
        for s in (a.primary, a.standby):
            if s is not None:
                held[s.bin] = held.get(s.bin, 0) + s.held
    def moved(s: Slot) -> Slot:
        if held.get(s.bin, 0) + s.instances * gpu_pct > 100:
            raise ValueError(f"app {app!r} at {s.instances} x {gpu_pct}% does not fit GPU {s.gpu} of node "
                             f"{s.node[:12]}: the other apps hold {held.get(s.bin, 0)}% of it")
        return Slot(s.node, s.gpu, gpu_pct, s.instances)

    return Assignment(app, moved(cur.primary), moved(cur.standby) if cur.standby else None)


def free_pct(assignments: Iterable[Assignment], nodes: Iterable[NodeView]) -> dict[str, dict[int, int]]:
    """GPU% left on each (node, GPU) once the assignments hold their shares."""
    out = {n.name: dict.fromkeys(range(n.gpus), 100) for n in nodes}
    for a in assignments:
        for s in (a.primary, a.standby):
            if s is not None and s.node in out and s.gpu in out[s.node]:
                out[s.node][s.gpu] -= s.held
    return out

