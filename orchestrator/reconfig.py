"""Changing an app's GPU% while it serves: Overlapped-Execution, and kill-and-restart as the baseline.

Overlapped-Execution (paper V-C), per active instance of the app, one at a time so the app never
loses capacity:

1. take the app's shadow (already started, CPU side initialised, GPU side deferred), or start one;
2. ``InitGpu(new_pct)``: the shadow applies the new share, loads the model and warms up, then
   reports Ready;
3. the ingest's route for the app switches to the shadow (now the active) and the old active is told
   ``<2, Finish>``; it serves what it already holds and reports ``<3, Ended>``. The paper switches
   traffic only after Ended; switching at Finish instead means the new instance serves while the
   old one drains, so there is no gap — and since each request sits in exactly one consumer queue,
   none is lost or answered twice;
4. a fresh shadow is prepared for the next change.

Failures: a shadow that fails to initialise (error, exit, or no Ready within ``timeout_s``) is
removed and the change is reported failed; the active keeps serving at the old share. An active that
dies while draining has what it held handed to the new active by the ingest. A second change of the
same app while one runs is refused with a message saying so.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from orchestrator.messages import Finish, InitGpu

if TYPE_CHECKING:
    from orchestrator.node import InstanceState, Node

log = logging.getLogger("gpuprims.reconfig")


class ChangeError(RuntimeError):
    """A change of GPU% could not be made; the app keeps its previous share."""


def check_share(node: Node, app_name: str, new_pct: int) -> None:
    """Raise ChangeError if the app is unknown, the % is out of range, or the GPU would be oversubscribed."""
    if app_name not in node.apps:
        raise ChangeError(f"no app named {app_name!r}; apps: {', '.join(sorted(node.apps))}")
    if isinstance(new_pct, bool) or not isinstance(new_pct, int) or not 1 <= new_pct <= 100:
        raise ChangeError(f"gpu_pct must be an integer in 1..100, got {new_pct!r}")
    app = node.apps[app_name]
    gpu = node.cfg.gpu_of(app.cfg)
    others = sum(a.gpu_pct * a.instances for name, a in node.apps.items()
                 if name != app_name and node.cfg.gpu_of(a.cfg) == gpu)
    total = others + new_pct * app.instances
    if total > 100 and not node.cfg.node.allow_oversubscribe:
        raise ChangeError(f"refused: {app_name} at {new_pct}% x {app.instances} instance(s) would put GPU {gpu} "
                          f"at {total}% (other apps hold {others}%); the sum must stay <= 100 unless "
                          "node.allow_oversubscribe is true")


def _settings_for(node: Node, app_name: str, new_pct: int, index: int) -> dict[str, Any]:
    """Backend placement for the replacement of instance `index` of the app at `new_pct`."""
    if node.backend != "cpu":
        return {}
    from gpuprims.cpushare import plan_cpu_shares

    reqs = []
    for name, a in node.apps.items():
        pct = new_pct if name == app_name else a.gpu_pct
        reqs += [(f"{name}-{i}", pct) for i in range(a.instances)]
    share = plan_cpu_shares(reqs, allow_oversubscribe=node.cfg.node.allow_oversubscribe)[f"{app_name}-{index}"]
    return {"cores": list(share.cores), "threads": share.threads}


def _wait(node: Node, done: Any, timeout_s: float, what: str, setting: str) -> float:
    """Run the node's control loop until done() is true; return the seconds it took."""
    t0 = time.monotonic()
    while not done():
        if time.monotonic() - t0 > timeout_s:
            raise ChangeError(f"{what} did not happen within {timeout_s:.0f} s; raise {setting} if needed")
        node.step(5)
    return time.monotonic() - t0


def _ready_shadow(node: Node, app_name: str, timeout_s: float) -> InstanceState:
    shadow = node.shadow_of(app_name) or node.spawn_shadow(app_name)

    def up() -> bool:
        if shadow.error is not None or shadow.name not in node.instances:
            raise ChangeError(f"shadow {shadow.name} failed before it was ready: {shadow.error}")
        return shadow.ready

    _wait(node, up, timeout_s, f"shadow {shadow.name} start", "the change timeout")
    return shadow


def change_gpu_pct(node: Node, app_name: str, new_pct: int, *, timeout_s: float = 180.0) -> tuple[bool, str]:
    """Move every instance of the app to ``new_pct`` with Overlapped-Execution. Returns (ok, message)."""
    try:
        check_share(node, app_name, new_pct)
    except ChangeError as e:
        return False, str(e)
    if app_name in node.changing:
        return False, f"a change of {app_name} is already in progress; try again when it completes"
    app = node.apps[app_name]
    if new_pct == app.gpu_pct:
        return True, f"{app_name} already runs at {new_pct}%"
    node.changing.add(app_name)
    t_start = time.monotonic()
    switched: list[dict[str, Any]] = []
    try:
        actives = sorted((st for st in node.instances.values() if st.app == app_name and st.role == "active"),
                         key=lambda st: st.name)
        for index, old in enumerate(actives):
            shadow = _ready_shadow(node, app_name, timeout_s)
            t_init = time.monotonic()
            settings = _settings_for(node, app_name, new_pct, index)
            node.server.send(shadow.name, InitGpu(instance=shadow.name, gpu_pct=new_pct,  # type: ignore[union-attr]
                                                  settings=settings))
            if "cores" in settings:
                shadow.spec.cores, shadow.spec.threads = settings["cores"], settings["threads"]

            def initialised(sh: InstanceState = shadow) -> bool:
                if sh.error is not None or sh.name not in node.instances:
                    raise ChangeError(f"shadow {sh.name} failed to initialise at {new_pct}%: {sh.error}; "
                                      f"{app_name} keeps serving at {app.gpu_pct}%")
                return sh.initialized

            try:
                _wait(node, initialised, timeout_s, f"shadow {shadow.name} initialisation", "the change timeout")
            except ChangeError:
                _discard(node, shadow)
                raise
            init_s = time.monotonic() - t_init
            # The switch: new requests go to the new active from the next received batch on.
            t_switch = time.monotonic()
            shadow.role = "active"
            shadow.spec.gpu_pct = new_pct
            if old.name in node.instances:
                old.role = "finishing"
            node._update_route(app_name)
            switch_ms = (time.monotonic() - t_switch) * 1e3
            node.events.append({"t": t_switch, "event": "switch", "app": app_name, "from": old.name,
                                "to": shadow.name, "gpu_pct": new_pct})
            drained = None
            if old.name in node.instances:
                node.server.send(old.name, Finish(instance=old.name))  # type: ignore[union-attr]
                try:
                    _wait(node, lambda o=old: o.ended or o.name not in node.instances, timeout_s,
                          f"{old.name} drain", "the change timeout")
                except ChangeError:
                    log.error("%s did not report Ended; terminating it", old.name)
                    old.proc.terminate()
                drained = old.stats.get("ok")
            switched.append({"from": old.name, "to": shadow.name, "init_ms": round(init_s * 1e3, 1),
                             "route_switch_ms": round(switch_ms, 3), "old_served": drained})
        app.gpu_pct = new_pct
        if app.cfg.shadow:
            node.spawn_shadow(app_name)
    except ChangeError as e:
        node.events.append({"t": time.monotonic(), "event": "change_failed", "app": app_name, "reason": str(e)})
        return False, str(e)
    finally:
        node.changing.discard(app_name)
    total_ms = (time.monotonic() - t_start) * 1e3
    node.events.append({"t": time.monotonic(), "event": "changed", "app": app_name, "gpu_pct": new_pct,
                        "switched": switched, "total_ms": round(total_ms, 1)})
    log.info("%s now at %d%%: %s", app_name, new_pct, switched)
    return True, (f"{app_name} now at {new_pct}%: {len(switched)} instance(s) switched with Overlapped-Execution "
                  f"in {total_ms:.0f} ms (route switch {max((s['route_switch_ms'] for s in switched), default=0):.3f} ms)")


def _discard(node: Node, st: InstanceState) -> None:
    if st.name in node.instances and st.proc.poll() is None:
        st.proc.kill()
        st.proc.wait()
    node.step(1)


def restart_gpu_pct(node: Node, app_name: str, new_pct: int, *, timeout_s: float = 180.0) -> tuple[bool, str]:
    """Baseline: kill each active instance and start a new one at ``new_pct`` (the downtime Overlapped-
    Execution avoids). Requests arriving meanwhile wait in the new instance's queue; those the killed
    instance held are answered INSTANCE_FAILED."""
    try:
        check_share(node, app_name, new_pct)
    except ChangeError as e:
        return False, str(e)
    app = node.apps[app_name]
    actives = [st for st in node.instances.values() if st.app == app_name and st.role == "active"]
    t0 = time.monotonic()
    for index, old in enumerate(actives):
        old.role = "stopping"
        old.proc.kill()
        old.proc.wait()
        node.step(1)  # reclaims what it held
        settings = _settings_for(node, app_name, new_pct, index)
        share = None
        if settings:
            from gpuprims.cpushare import CpuShare

            share = CpuShare(cores=settings["cores"], threads=settings["threads"], gpu_pct=new_pct)
        new = node._spawn(app.cfg, f"{app_name}-k{index}-{int(t0 * 1000) % 100000}", share, gpu_pct=new_pct)
        node._update_route(app_name)
        try:
            _wait(node, lambda n=new: n.ready, timeout_s, f"{new.name} start", "the change timeout")
        except ChangeError as e:
            return False, str(e)
    app.gpu_pct = new_pct
    total_ms = (time.monotonic() - t0) * 1e3
    node.events.append({"t": time.monotonic(), "event": "restarted", "app": app_name, "gpu_pct": new_pct,
                        "total_ms": round(total_ms, 1)})
    return True, f"{app_name} restarted at {new_pct}% in {total_ms:.0f} ms"
