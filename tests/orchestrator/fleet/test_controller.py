"""The fleet end to end on a real Ray cluster on loopback: agents start nodes, the controller places an
app with a standby on the other machine, a fleet client is answered by its owner, and when that
machine is killed (its raylet, agent and orchestrator) the route flips to the standby and every
request is still answered exactly once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
import torch

from tests.orchestrator.fleet.conftest import NO_RAY, RayFleet

pytest.importorskip("ray", reason=NO_RAY)

import ray

from apps.zoo import build_model
from gpuprims.client import FleetClient
from gpuprims.gather import preprocess
from gpuprims.wire import Status
from orchestrator.fleet.config import parse_fleet_config
from orchestrator.fleet.controller import NAMESPACE, Controller, agent_name, controller_actor
from orchestrator.fleet.plan import AppDemand, Assignment, Slot
from orchestrator.frontdoor.forward import route_model
from tests.orchestrator.fleet.helpers import post_until_ok

pytestmark = pytest.mark.slow

APP = {"name": "cls", "model": "mobilenet_v2", "input_shape": [3, 32, 32], "num_classes": 10, "seed": 3,
       "slo_ms": 5000, "gpu_pct": 50, "max_batch": 4, "shadow": False}
# One machine only: any other machine's front door takes its requests by forwarding them there.
SOLO = {**APP, "name": "solo", "standby": False}
FLEET = {"ping_interval_s": 0.2, "suspect_after_s": 1.0,
         "node": {"backend": "cpu", "pool": {"slot_count": 2048, "max_chunks": 64, "record_count": 256}},
         "apps": [APP, SOLO]}


def _wait(what: str, cond: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            v = cond()
        except ray.exceptions.GetTimeoutError:
            # An actor busy past one status call's 30 s (a load on agents, on a busy machine) is asked again:
            # only the wait's own deadline decides.
            v = None
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError(f"{what} not within {timeout_s:g} s")


def _placed_and_applied(ctl: Any) -> dict[str, Any] | None:
    st = ray.get(ctl.status.remote(), timeout=30)
    a = st["apps"].get("cls")
    if a is None or a.get("standby") is None:
        return None
    applied = {d.get("node") for d in st["decisions"] if d["action"] == "applied" and d["app"] == "cls"}
    route = st["routes"]["apps"].get("cls")
    return st if {a["primary"]["node"], a["standby"]["node"]} <= applied and route else None


def _applied(ctl: Any, app: str) -> dict[str, Any] | None:
    st = ray.get(ctl.status.remote(), timeout=30)
    a = st["apps"].get(app)
    done = {d.get("node") for d in st["decisions"] if d["action"] == "applied" and d["app"] == app}
    return st if a is not None and a["primary"]["node"] in done and app in st["routes"]["apps"] else None


def test_a_fleet_places_serves_and_fails_over_when_a_machine_dies(ray_fleet: RayFleet) -> None:
    ctl = controller_actor(parse_fleet_config(FLEET, source="test"))
    st = _wait("cls placed with a standby and loaded on both machines", lambda: _placed_and_applied(ctl), 300)
    primary, standby = st["apps"]["cls"]["primary"], st["apps"]["cls"]["standby"]
    assert primary["node"] != standby["node"]
    assert st["controller_node"] == ray_fleet.cluster.head_node.node_id  # never on a gpuprims machine
    seeds = [f"http://{n['host']}:{n['routes_port']}" for n in st["nodes"].values()]
    model = build_model("mobilenet_v2", seed=3, num_classes=10, input_shape=(3, 32, 32)).eval()
    xs = np.random.default_rng(0).random((6, 3, 32, 32), dtype=np.float32)
    with torch.inference_mode():
        want = model(preprocess(torch.from_numpy(xs), "float32")).numpy()
    with FleetClient(seeds, failover_s=1.0, timeout_s=60.0) as client:
        _wait("the routing table reaches the agents", lambda: client.refresh() > 0 and
              "cls" in client.table["apps"], 30)
        assert client.table["apps"]["cls"]["primary"]["node"] == primary["node"]
        r = client.infer("cls", xs[0])
        assert r.status == Status.OK and client.failovers == 0
        np.testing.assert_allclose(r.output, want[0], rtol=1e-4, atol=1e-4)
        # "solo" runs on one machine; the other machine's front door forwards its requests there.
        solo = _wait("solo placed and loaded", lambda: _applied(ctl, "solo"), 300)
        other = next(n for nid, n in solo["nodes"].items() if nid != solo["apps"]["solo"]["primary"]["node"])
        doc = post_until_ok(f"http://{other['host']}:{other['http_port']}/v2/models/solo/infer",
                             {"inputs": [{"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32",
                                          "data": xs[0].reshape(-1).tolist()}]}, 60)
        np.testing.assert_allclose(np.asarray(doc["outputs"][0]["data"], np.float32), want[0], rtol=1e-4, atol=1e-4)
        # An operator changes cls's share; the primary's machine dies while its node makes the change
        # (or just after it, on a fast machine), the standby's node making it too.
        new = ray.get(ctl.set_share.remote("cls", 40), timeout=30)
        assert (new["primary"]["node"], new["standby"]["node"]) == (primary["node"], standby["node"])
        assert new["primary"]["gpu_pct"] == new["standby"]["gpu_pct"] == 40
        agents = {n: ray.get_actor(agent_name(n), namespace=NAMESPACE) for n in (primary["node"], standby["node"])}

        def cls_on(node: str) -> dict[str, Any]:
            return dict((ray.get(agents[node].status.remote(), timeout=30).get("apps") or {}).get("cls") or {})

        _wait("the primary's change of share under way", lambda: cls_on(primary["node"]).get("change") or
              cls_on(primary["node"]).get("gpu_pct") == 40, 120)
        # The primary's machine dies whole: orchestrator and its instances, agent, raylet.
        info = st["nodes"][primary["node"]]
        os.killpg(int(info["node_pid"]), signal.SIGKILL)
        os.kill(int(info["pid"]), signal.SIGKILL)
        ray_fleet.cluster.remove_node(ray_fleet.node_of(primary["node"]), allow_graceful=False)
        results = [client.infer("cls", x) for x in xs[1:]]
        assert [r.status for r in results] == [Status.OK] * 5  # every request answered, once
        for r, w in zip(results, want[1:]):
            np.testing.assert_allclose(r.output, w, rtol=1e-4, atol=1e-4)
        assert client.failovers >= 1 and client.duplicates <= client.failovers
        # The controller's own pings suspect the machine and flip the route to the standby.
        try:
            _wait("the route flips to the standby", lambda: client.refresh() >= 0 and
                  client.table["apps"]["cls"]["primary"]["node"] == standby["node"], 60)
        except AssertionError:
            raise AssertionError(ray.get(ctl.status.remote(), timeout=30)["decisions"]) from None
    def confirmed() -> dict[str, Any] | None:
        s = ray.get(ctl.status.remote(), timeout=30)
        return s if any(d["action"] == "confirm_dead" for d in s["node_events"]) else None

    st = _wait("Ray confirms the death", confirmed, 120)
    # The controller runs on the head, so the machine's death did not take it along (no restart).
    assert not any(d["action"] == "restart" for d in st["node_events"]), st["node_events"]
    dead = [d for d in st["node_events"] if d.get("node") == primary["node"]]
    actions = [d["action"] for d in dead]
    # The controller's pings normally suspect it first (Ray's checks are slower, conftest); on a very
    # busy machine Ray's confirmation may come first, and then it alone flips the route.
    if "suspect" in actions:
        assert actions.index("suspect") < actions.index("confirm_dead"), dead
    assert st["apps"]["cls"]["primary"]["node"] == standby["node"]  # promoted, not moved back
    assert st["apps"]["cls"]["primary"]["gpu_pct"] == 40  # at the share the operator set
    _wait("the promoted standby's node at the new share", lambda: cls_on(standby["node"]).get("gpu_pct") == 40 and
          not cls_on(standby["node"]).get("change"), 120)
    # The controller is restartable: killed, Ray starts it again and it finds its state in the GCS store.
    ray.kill(ctl, no_restart=False)

    def restarted() -> dict[str, Any] | None:
        try:
            s = ray.get(ctl.status.remote(), timeout=30)
        except Exception:  # still restarting
            return None
        return s if any(d["action"] == "restart" for d in s["node_events"]) else None

    again = _wait("the controller restarts with its state", restarted, 120)
    assert again["apps"]["cls"]["primary"] == st["apps"]["cls"]["primary"]


def test_a_ray_client_without_the_token_is_refused(ray_fleet: RayFleet) -> None:
    probe = ("import ray, sys\n"
             "try:\n"
             f"    ray.init(address={ray_fleet.cluster.address!r})\n"
             "    ray.get(ray.put(1), timeout=20)\n"
             "except Exception as e:\n"
             "    print('REFUSED', type(e).__name__, e); sys.exit(3)\n"
             "print('ADMITTED')\n")
    env_wrong = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64, "PATH": "/usr/bin:/bin",
                 "HOME": "/nonexistent", "RAY_USAGE_STATS_ENABLED": "0"}
    env_none = {k: v for k, v in env_wrong.items() if not k.startswith("RAY_AUTH")}
    # ... and with the token it is admitted (the refusals are the token's doing). The three at once:
    # a refused client retries for a while before it gives up.
    env_ok = {**env_wrong, "RAY_AUTH_TOKEN": ray_fleet.token}
    probes = {name: subprocess.Popen([sys.executable, "-c", probe], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
              for name, env in (("wrong", env_wrong), ("none", env_none), ("ok", env_ok))}
    try:
        out = {name: (p.communicate(timeout=180), p.returncode) for name, p in probes.items()}
    finally:
        for p in probes.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    for name in ("wrong", "none"):
        (stdout, stderr), rc = out[name]
        assert rc != 0 and "ADMITTED" not in stdout, (name, stdout, stderr[-2000:])
    (stdout, stderr), rc = out["ok"]
    assert rc == 0 and "ADMITTED" in stdout, (stdout, stderr[-2000:])


class _Remote:
    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        self.calls = calls

    def remote(self, *args: Any) -> object:
        self.calls.append(args)
        return object()


class _Agent:
    """An agent's handle as the controller uses it: records the tables it is sent."""

    def __init__(self) -> None:
        self.tables: list[tuple[Any, ...]] = []
        self.set_routes = _Remote(self.tables)


def test_a_machine_that_joins_after_the_last_change_gets_the_routing_table(monkeypatch: pytest.MonkeyPatch) -> None:
    # Found by bench/fleet with three machines: the third, on which nothing was placed, joined after the
    # table's last version was pushed, never got it, and its front door answered 404 for every app.
    ctl = object.__new__(Controller)  # its logic only: no loop thread, no Ray state
    agents = {"n1": _Agent(), "n2": _Agent()}
    ctl.agents, ctl.pending_info = dict(agents), {"n2": "ref"}
    ctl.info = {"n1": {"node": "n1", "host": "127.0.0.1", "udp_port": 9001, "http_port": 8001, "gpus": 1}}
    ctl.alive, ctl.suspects, ctl.last_ok, ctl.dirty = {"n1": True, "n2": True}, {}, {}, set()
    ctl.decisions, ctl.node_events = [], []
    ctl.assignments = {"cls": Assignment("cls", Slot("n1", 0, 50))}
    ctl.demands, ctl.app_ids = {"cls": AppDemand("cls", APP)}, {"cls": 1}
    ctl.models = {"cls": route_model(APP)}
    ctl.version = ctl.pushed = 3
    monkeypatch.setattr(ray, "wait", lambda refs, timeout=None: (list(refs), []))
    monkeypatch.setattr(ray, "get", lambda ref: {"node": "n2", "host": "127.0.0.1", "udp_port": 9002,
                                                 "http_port": 8002, "gpus": 1})
    ctl._collect_infos()
    ((table,),) = agents["n2"].tables
    assert table["version"] == 3 and table["apps"]["cls"]["primary"]["udp_port"] == 9001
    assert table["apps"]["cls"]["model"] == route_model(APP)
    assert agents["n1"].tables == []  # it has this version already
    # Before any table is pushed, the first push (to every agent with its info) is the loop's.
    ctl.pending_info, ctl.pushed = {"n2": "ref"}, -1
    ctl._collect_infos()
    assert len(agents["n2"].tables) == 1
