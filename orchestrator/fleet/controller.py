"""The fleet controller: one detached, restartable Ray actor that owns the desired state.

It keeps, in Ray's GCS key-value store (where a restarted controller finds it), every app's
assignment (primary (node, GPU, share), standby on another machine), the apps' fleet-wide wire app
ids and the routing table's version. Its loop, every ``ping_interval_s``:

1. **Membership**: Ray's node table; every live machine with the fleet's custom resource gets an
   agent (a detached named actor pinned to that machine, ``orchestrator.fleet.agent.Agent``).
2. **Pings**: the controller's own pings of every agent. No answer for ``suspect_after_s`` (or an
   agent that died): the machine is *suspected*, and the routing table flips its apps to their
   standbys at once (a new version, pushed to every agent, which serve it to clients).
3. **Confirmation**: Ray marks the machine dead (its own health checks). Only then is the
   machine's work *re-placed*: the planner (``orchestrator.fleet.plan``) promotes standbys and places
   new standbys and lost apps on the machines left. A suspected machine that answers again is
   routed to again; nothing moved.
4. **Apply**: each agent gets its machine's desired app set (``Agent.apply``: repository loads and
   unloads). Apps under steady load are never moved: the plan starts from the current assignments.

Requests never cross Ray: a dead head stops re-placement, not serving (clients hold the table and
any agent serves it). Every decision is kept with its reason for ``gpuprims-fleet status``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray
from ray.experimental import internal_kv
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from gpuprims.profile import ProfileError, load_profile
from orchestrator.fleet.agent import Agent
from orchestrator.fleet.config import FleetConfig
from orchestrator.fleet.plan import AppDemand, Assignment, NodeView, Planner, reshare, route_table
from orchestrator.frontdoor.forward import route_model
from orchestrator.node.placement import model_key

log = logging.getLogger("gpuprims.fleet")

NAMESPACE = "gpuprims-fleet"
CONTROLLER_NAME = "gpuprims-fleet-controller"
AGENT_PREFIX = "gpuprims-agent-"
STATE_KEY = b"gpuprims-fleet/state"
DECISIONS_KEPT = 200
HEAD_RESOURCE = "node:__internal_head__"  # the resource Ray gives its head node only
#: Decisions about machines (not apps), kept in their own list too.
NODE_EVENTS = frozenset({"suspect", "unsuspect", "confirm_dead", "agent", "agent_failed", "drain", "restart"})


def agent_name(node_id: str) -> str:
    return AGENT_PREFIX + node_id[:16]


class Controller:
    """The controller's logic (see the module docstring); :func:`controller_actor` makes it an actor."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        self.cfg = FleetConfig.model_validate(dict(cfg))
        profiles = {}
        if self.cfg.profiles:
            for p in sorted(Path(self.cfg.profiles).glob("*.json")):
                try:
                    prof = load_profile(p)
                except ProfileError as e:
                    log.error("profiles: %s", e)
                    continue
                profiles[model_key(prof.model)] = prof
        self.planner = Planner(profiles, default_pct=self.cfg.default_gpu_pct)
        self.demands = {a["name"]: AppDemand(a["name"], self.cfg.node_entry(a), a.get("rate_rps"))
                        for a in self.cfg.apps}
        self.wants_standby = {a["name"]: bool(a.get("standby", True)) for a in self.cfg.apps}
        # What any node's front door needs to take an app's requests and forward them (routing table).
        self.models = {name: route_model(d.entry) for name, d in self.demands.items()}
        self.assignments: dict[str, Assignment] = {}
        self.app_ids: dict[str, int] = {}
        self.shares: dict[str, int] = {}  # app -> gpu_pct an operator set (set_share)
        self.version = 0
        self.draining: set[str] = set()
        self.decisions: list[dict[str, Any]] = []
        self.node_events: list[dict[str, Any]] = []
        self._load_state()
        for name in sorted(self.demands):  # fleet-wide wire app ids: the same on every node
            if name not in self.app_ids:
                self.app_ids[name] = max([0, *self.app_ids.values()]) + 1
        self.agents: dict[str, Any] = {}  # node id -> actor handle
        self.info: dict[str, dict[str, Any]] = {}  # node id -> Agent.info()
        self.pending_info: dict[str, Any] = {}  # node id -> ObjectRef of info()
        self.alive: dict[str, bool] = {}  # Ray's view
        self.last_ok: dict[str, float] = {}
        self.pings: dict[str, tuple[Any, float]] = {}  # node id -> (ref, sent)
        self.suspects: dict[str, float] = {}  # node id -> when suspected
        self.applies: dict[str, Any] = {}  # node id -> ObjectRef of apply()
        self.dirty: set[str] = set()
        self.reapply: set[str] = set()  # nodes whose desired set changed while an apply was running
        self.pushed = -1
        self._stop = threading.Event()
        self._lock = threading.RLock()
        self._thread = threading.Thread(target=self._run, name="gpuprims-fleet-controller", daemon=True)
        self._thread.start()

    # -- state that survives a restart ---------------------------------------------------------------------
    def _load_state(self) -> None:
        raw = internal_kv._internal_kv_get(STATE_KEY)
        if not raw:
            return
        d = json.loads(raw)
        self.assignments = {k: Assignment.from_dict(v) for k, v in d.get("assignments", {}).items()
                            if k in self.demands}
        self.app_ids = {k: int(v) for k, v in d.get("app_ids", {}).items()}
        self.version = int(d.get("version", 0)) + 1
        self.draining = set(d.get("draining", []))
        self.decisions = list(d.get("decisions", []))
        for name, pct in d.get("shares", {}).items():  # operators' changes of share outlive a restart
            if name in self.demands:
                self._override_share(name, int(pct))
        self._decide("restart", "", f"controller restarted; {len(self.assignments)} assignment(s) recovered")

    def _save_state(self) -> None:
        d = {"assignments": {k: a.to_dict() for k, a in self.assignments.items()}, "app_ids": self.app_ids,
             "version": self.version, "draining": sorted(self.draining), "decisions": self.decisions[-50:],
             "shares": self.shares}
        internal_kv._internal_kv_put(STATE_KEY, json.dumps(d).encode(), overwrite=True)

    def _decide(self, action: str, app: str, reason: str, **extra: Any) -> None:
        d = {"t": time.time(), "action": action, "app": app, "reason": reason, **extra}
        self.decisions = [*self.decisions[-(DECISIONS_KEPT - 1):], d]
        if action in NODE_EVENTS:  # kept apart: app decisions must not push them out of status
            self.node_events = [*self.node_events[-(DECISIONS_KEPT - 1):], d]
        log.info("fleet: %s %s: %s", action, app, reason)

    # -- the loop ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        next_membership = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                with self._lock:
                    if now >= next_membership:
                        next_membership = now + max(0.5, 2 * self.cfg.ping_interval_s)
                        self._membership()
                    self._collect_infos()
                    self._ping(now)
                    self._reconcile()
                    self._push_routes()
                    self._collect_applies()
            except Exception:  # the loop must outlive any one bad step; it is logged
                log.exception("fleet controller step failed; carrying on")
            self._stop.wait(self.cfg.ping_interval_s / 2)

    def _membership(self) -> None:
        res = self.cfg.ray.resource
        seen: dict[str, bool] = {}
        for n in ray.nodes():
            nid = str(n["NodeID"])
            # A dead node's resources read empty: it counts if it had an agent.
            if res in (n.get("Resources") or {}) or nid in self.agents:
                seen[nid] = bool(n.get("Alive"))
        for nid, alive in seen.items():
            was = self.alive.get(nid)
            self.alive[nid] = alive
            if alive and nid not in self.agents:
                self._start_agent(nid)
            if not alive and was:
                self._decide("confirm_dead", "", f"Ray reports node {nid[:12]} dead", node=nid)
                self.agents.pop(nid, None)
                self.info.pop(nid, None)
                self.pings.pop(nid, None)
                self.applies.pop(nid, None)
                self.suspects.pop(nid, None)
                self.dirty.add("*")

    def _start_agent(self, nid: str) -> None:
        name = agent_name(nid)
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
            why = "found (controller restart)"
        except ValueError:
            handle = ray.remote(Agent).options(
                name=name, namespace=NAMESPACE, lifetime="detached", num_cpus=0, max_concurrency=4,
                resources={self.cfg.ray.resource: 1},
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=nid, soft=False),
            ).remote(nid, dict(self.cfg.node), host=self.cfg.host, gpus=self.cfg.gpus_per_node)
            why = "started"
        self.agents[nid] = handle
        self.pending_info[nid] = handle.info.remote()
        self._decide("agent", "", f"agent on node {nid[:12]} {why}", node=nid)

    def _collect_infos(self) -> None:
        for nid, ref in list(self.pending_info.items()):
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                continue
            del self.pending_info[nid]
            try:
                self.info[nid] = ray.get(ref)
            except Exception as e:
                self._decide("agent_failed", "", f"agent on node {nid[:12]} could not start: {e}", node=nid)
                self.agents.pop(nid, None)
                continue
            self.last_ok[nid] = time.monotonic()
            self.dirty.add("*")
            if self.pushed >= 0:
                # A machine that joins after the table's last change (nothing placed on it moves a
                # version) gets the table now: its front door forwards by it, clients may seed from it.
                self.agents[nid].set_routes.remote(self.routes())

    def _ping(self, now: float) -> None:
        for nid, handle in list(self.agents.items()):
            if nid not in self.info:
                continue
            out = self.pings.get(nid)
            if out is not None:
                ready, _ = ray.wait([out[0]], timeout=0)
                if ready:
                    del self.pings[nid]
                    try:
                        ok = bool(ray.get(out[0]).get("orchestrator"))
                    except Exception:
                        ok = False
                    if ok:
                        self.last_ok[nid] = now
                        if nid in self.suspects:
                            del self.suspects[nid]
                            self._decide("unsuspect", "", f"node {nid[:12]} answers again", node=nid)
                            self.version += 1
            if nid not in self.pings:
                self.pings[nid] = (handle.ping.remote(), now)
            if nid not in self.suspects and now - self.last_ok.get(nid, now) > self.cfg.suspect_after_s:
                self.suspects[nid] = now
                self.version += 1
                self._decide("suspect", "", f"node {nid[:12]} did not answer pings for "
                                            f"{now - self.last_ok[nid]:.2f} s; its apps' routes flip to standby",
                             node=nid)

    def _reconcile(self) -> None:
        if not self.dirty:
            return
        self.dirty.clear()
        nodes = [NodeView(nid, int(self.info[nid].get("gpus", 1)), alive=self.alive.get(nid, False),
                          draining=nid in self.draining) for nid in self.info]
        plan = self.planner.plan(self.demands.values(), nodes, self.assignments)
        changed = plan.assignments != self.assignments
        said = {(d["action"], d["app"], d["reason"]) for d in self.decisions[-50:]}
        for r in plan.reasons:  # a reason already given (nothing changed since) is not repeated
            if changed or (r["action"], r["app"], r["reason"]) not in said:
                self._decide(r["action"], r["app"], r["reason"], to=r.get("to"))
        for app, why in plan.unplaced.items():
            if ("unplaced", app, why) not in said:
                self._decide("unplaced", app, why)
        self.assignments = plan.assignments
        if changed:
            self.version += 1
        self._save_state()
        for nid in self.info:
            self._apply(nid)

    def desired(self, nid: str) -> dict[str, dict[str, Any]]:
        """The app entries node ``nid`` should serve (its primaries and standbys)."""
        out: dict[str, dict[str, Any]] = {}
        for name, a in self.assignments.items():
            for s in (a.primary, a.standby):
                if s is not None and s.node == nid:
                    out[name] = {**self.demands[name].entry, "gpu": s.gpu, "gpu_pct": s.gpu_pct,
                                 "instances": s.instances, "app_id": self.app_ids[name]}
        return out

    def _apply(self, nid: str) -> None:
        if nid not in self.agents:
            return
        if nid in self.applies:
            self.reapply.add(nid)  # again once this one is back, with the desired set of then
            return
        self.applies[nid] = self.agents[nid].apply.remote(self.desired(nid))

    def _collect_applies(self) -> None:
        for nid, ref in list(self.applies.items()):
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                continue
            del self.applies[nid]
            try:
                res = ray.get(ref)
            except Exception as e:  # the agent died: its machine's pings say so; nothing to apply there
                self._decide("apply_failed", "", f"node {nid[:12]}: {e}", node=nid)
                res = {}
            for app, outcome in res.items():
                self._decide("applied" if outcome == "ok" else "apply_failed", app, outcome, node=nid)
            if nid in self.reapply:
                self.reapply.discard(nid)
                self._apply(nid)

    def routes(self) -> dict[str, Any]:
        """The routing table (see ``plan.route_table``)."""
        addresses = {nid: {"host": i["host"], "udp_port": i["udp_port"], "http_port": i["http_port"]}
                     for nid, i in self.info.items() if self.alive.get(nid)}
        return route_table(self.version, self.assignments, self.demands, self.app_ids, addresses,
                           suspects=self.suspects, models=self.models)

    def _push_routes(self) -> None:
        if self.pushed == self.version:
            return
        table = self.routes()
        for nid, handle in self.agents.items():
            if nid in self.info and nid not in self.suspects:
                handle.set_routes.remote(table)
        self.pushed = self.version
        self._decide("routes", "", f"routing table version {self.version} pushed", version=self.version)

    # -- what the CLI calls ---------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        with self._lock:
            nodes = {nid: {**{k: v for k, v in i.items() if k != "node"}, "alive": self.alive.get(nid),
                           "suspected": nid in self.suspects, "draining": nid in self.draining}
                     for nid, i in self.info.items()}
            return {"nodes": nodes, "apps": {k: a.to_dict() for k, a in self.assignments.items()},
                    "routes": self.routes(), "decisions": self.decisions[-50:],
                    "node_events": self.node_events[-50:],
                    "pending": sorted(set(self.demands) - set(self.assignments)),
                    "controller_node": ray.get_runtime_context().get_node_id()}

    def drain(self, node: str) -> str:
        """Move every app off ``node`` (a node id or its prefix); returns the node id drained."""
        with self._lock:
            match = [nid for nid in self.info if nid.startswith(node)]
            if len(match) != 1:
                raise ValueError(f"node {node!r} matches {len(match)} node(s); known: "
                                 f"{', '.join(n[:12] for n in self.info)}")
            self.draining.add(match[0])
            self._decide("drain", "", f"node {match[0][:12]} drained by the operator", node=match[0])
            self.dirty.add("*")
            return match[0]

    def set_share(self, app: str, gpu_pct: int) -> dict[str, Any]:
        """An operator's change of ``app``'s share: its primary and its standby keep their (node, GPU)
        and get ``gpu_pct`` per instance, each node applying it as an Overlapped-Execution change (the
        app serves throughout); a later re-placement sizes it at that share too. Refused (ValueError)
        when it does not fit beside the other apps. Returns the new assignment; the ``applied``
        decisions (``status``) say when each node has it."""
        with self._lock:
            new = reshare(self.assignments, app, int(gpu_pct))
            old = self.assignments[app]
            self.assignments[app] = new
            self._override_share(app, new.primary.gpu_pct)
            self._decide("share", app, f"{old.primary.instances} x {old.primary.gpu_pct}% -> "
                                       f"{new.primary.gpu_pct}% by the operator")
            self._save_state()
            for s in (new.primary, new.standby):
                if s is not None:
                    self._apply(s.node)
            return new.to_dict()

    def _override_share(self, app: str, gpu_pct: int) -> None:
        d = self.demands[app]
        self.demands[app] = AppDemand(app, {**d.entry, "gpu_pct": gpu_pct}, d.rate_rps)
        self.shares[app] = gpu_pct

    def ping(self) -> bool:
        return True

    def shutdown(self) -> None:
        """Stop every agent (each stops its orchestrator) and the loop; forget the state."""
        self._stop.set()
        self._thread.join(timeout=10)
        refs = [h.stop.remote() for h in self.agents.values()]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=60)
        for h in self.agents.values():
            ray.kill(h)
        internal_kv._internal_kv_del(STATE_KEY)


def controller_actor(cfg: FleetConfig) -> Any:
    """Start (or find) the detached, restartable controller actor."""
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    except ValueError:
        pass
    # On the head, never on a gpuprims machine whose failure it must survive and report: a sliver of the
    # resource only the head has (as Ray Serve pins its own controller). Not a soft node affinity: Ray
    # places an actor that asks for no resource on a random node whatever its soft affinity says, and
    # on a one-machine cluster the starting driver's node may be any of them.
    return ray.remote(Controller).options(
        name=CONTROLLER_NAME, namespace=NAMESPACE, lifetime="detached", max_restarts=-1, num_cpus=0,
        resources={HEAD_RESOURCE: 0.001}, max_concurrency=4, get_if_exists=True,
    ).remote(cfg.model_dump())


def find_controller() -> Any:
    """The running controller's handle; ValueError when no fleet runs on this Ray cluster."""
    return ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
