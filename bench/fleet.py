"""bench/fleet: a fleet losing a machine, and what its clients see.

A Ray cluster on this machine (``ray.cluster_utils.Cluster``, token authentication on: a head and three
gpuprims machines with one CPU each), the fleet controller, one app (MobileNetV2 on 3x32x32 float32
requests, CPU backend, 50 %) placed with a warm standby on another machine; the third machine is
where the fleet restores the standby once a machine is lost (full re-placement). A ``FleetClient``
sends Poisson traffic from a pool of threads; after ``--before`` seconds one fault hits the app's
primary machine:

- ``kill``: SIGKILL of the whole machine (its raylet, the agent, the orchestrator and its instances:
  ``Cluster.remove_node(allow_graceful=False)``);
- ``stop``: SIGSTOP of the same processes (a silent machine), SIGCONT after the run;
- ``share``: an operator's change of the app's share (``set_share``, 50 % -> 40 %: an Overlapped-
  Execution change on both machines), then the ``kill`` of the primary's machine while its node is
  making the change (timed from the kill);
- ``head``: SIGKILL of the head (its GCS, its raylet and the controller on it): serving must go on;
- ``none``: no fault: a soak (run it beside busy loops, ``--after 600``) counting false suspicions.

Per run: seconds from the fault to the controller's suspicion, to the route flip (the first table
version pushed after it), to Ray's confirmation, to full re-placement (the app loaded on the third
machine), to the first OK of a request sent after the fault;
sent / OK / errors / unanswered / duplicates suppressed at the client; p50/p99 latency before and
after the fault. Targets (issue 25): suspicion <= 1.5 s, first OK <= 2 s, 0 unanswered, 0 answered
twice. Reports, never asserts.

With ``--apps 3`` the fleet has three apps (30 % each) and with ``--http-share F`` that fraction of
requests goes over OIP/HTTP to the front door of the machine holding no copy of ``cls``, which
forwards them to their owners; sent / OK / errors / unanswered are also counted per transport.

Run: ``python -m bench.fleet [--quick] [--runs N] [--faults kill,stop,head,share] [--apps 3 --http-share 0.5]``; the soak:
``contended python -m bench.fleet --faults none --runs 1 --after 600 --name fleet-soak``. Needs the ``fleet`` extra.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import importlib.util
import json
import os
import random
import secrets
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import numpy as np
import psutil
import ray
from ray._private.authentication_test_utils import reset_auth_token_state
from ray.cluster_utils import Cluster

from apps.zoo.registry import build_model
from bench.common import load_note, percentiles, write_result
from gpuprims.client import FleetClient, RequestLost
from gpuprims.wire import Status
from orchestrator.fleet.config import parse_fleet_config
from orchestrator.fleet.controller import NAMESPACE, agent_name, controller_actor, find_controller

APP = {"name": "cls", "model": "mobilenet_v2", "input_shape": [3, 32, 32], "num_classes": 10, "seed": 3,
       "slo_ms": 2000, "gpu_pct": 50, "max_batch": 4, "shadow": False}
FLEET = {"ping_interval_s": 0.2, "suspect_after_s": 1.0,
         "node": {"backend": "cpu", "pool": {"slot_count": 4096, "max_chunks": 64, "record_count": 512}},
         "apps": [APP]}
FAST_HEALTH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
               "health_check_timeout_ms": 500, "health_check_failure_threshold": 3}
PLACE_TIMEOUT_S = 300.0
FAULTS = ("kill", "stop", "head", "share", "none")
SHARE_TO = 40  # the ``share`` fault's new share (the app runs at 50, or 30 with --apps > 1)


def fleet_config(apps: int) -> dict[str, Any]:
    """The fleet of ``apps`` apps: ``cls`` (the app whose primary's machine the faults hit) and, beside
    it, copies of it under other names and seeds; with more than one, each at 30 % so that three
    apps with their standbys (180 %) still fit on two machines once one is lost."""
    if apps == 1:
        return FLEET
    entries = [{**APP, "name": "cls" if i == 0 else f"cls{i + 1}", "seed": APP["seed"] + i, "gpu_pct": 30}
               for i in range(apps)]
    return {**FLEET, "apps": entries}


def oip_body(x: np.ndarray) -> bytes:
    """An OIP/HTTP JSON infer request of one row ``x``."""
    return json.dumps({"inputs": [{"name": "input", "shape": [1, *x.shape], "datatype": "FP32",
                                   "data": x.reshape(-1).tolist()}]}).encode()


def _placed(ctl: Any, names: list[str]) -> dict[str, Any] | None:
    try:
        st = ray.get(ctl.status.remote(), timeout=30)
    except (ray.exceptions.RayError, TimeoutError):  # starting, or restarting
        return None
    for name in names:
        a = st["apps"].get(name)
        if a is None or a.get("standby") is None or name not in st["routes"]["apps"]:
            return None
        applied = {d.get("node") for d in st["decisions"] if d["action"] == "applied" and d["app"] == name}
        if not {a["primary"]["node"], a["standby"]["node"]} <= applied:
            return None
    return st


def _pids_of(worker: Any, node_info: dict[str, Any]) -> list[int]:
    pids = [p.process.pid for procs in worker.all_processes.values() for p in procs if p.process is not None]
    return [*pids, int(node_info["pid"])]



def drive(send: Callable[[], None], inject: Callable[[], None] | None, *, rate_rps: float, before_s: float,
          after_s: float, rng: np.random.Generator) -> tuple[float, float, float]:
    """Poisson traffic through ``send`` from a pool of threads, ``inject`` run once after ``before_s``
    on a thread of its own (the traffic goes on while it works); waits for it and every request sent.
    Returns the start, the fault's (when ``inject`` began) and the end's wall times."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=16)
    t_start = time.time()
    t_fault = t_start + before_s
    t_end = t_fault + after_s
    faulted = inject is None
    injector: threading.Thread | None = None
    failed: list[BaseException] = []
    futs = []
    nxt = time.time()
    while nxt < t_end:
        now = time.time()
        if not faulted and now >= t_fault:
            t_fault = now
            assert inject is not None
            injector = threading.Thread(target=lambda: _catching(inject, failed), name="fault")
            injector.start()
            faulted = True
        if now >= nxt:
            futs.append(pool.submit(send))
            nxt += rng.exponential(1.0 / rate_rps)
        time.sleep(max(0.0, min(nxt, t_end) - time.time()))
    if injector is not None:
        injector.join()
    concurrent.futures.wait(futs, timeout=60)
    pool.shutdown(wait=True, cancel_futures=True)
    if failed:
        raise RuntimeError(f"the fault could not be made: {failed[0]}") from failed[0]
    return t_start, t_fault, t_end


def _catching(fn: Callable[[], None], errors: list[BaseException]) -> None:
    try:
        fn()
    except Exception as e:  # re-raised by drive once its traffic is done
        errors.append(e)


def start_cluster(system_config: dict[str, Any], machines: int = 3) -> tuple[Cluster, list[Any]]:
    """A fresh Ray cluster on this machine with token authentication on: a head and ``machines``
    gpuprims machines with one CPU each. Returns it and its machines."""
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_USAGE_STATS_ENABLED="0")
    reset_auth_token_state()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                            "_system_config": system_config})
    try:
        workers = [cluster.add_node(num_cpus=1, resources={"gpuprims": 1}) for _ in range(machines)]
        cluster.wait_for_nodes()
    except BaseException:
        cluster.shutdown()
        raise
    return cluster, workers


def one_run(fault: str, *, rate_rps: float, before_s: float, after_s: float, seed: int, apps: int = 1,
            http_share: float = 0.0) -> dict[str, Any]:
    cfg = parse_fleet_config(fleet_config(apps), source="bench")
    names = [a["name"] for a in cfg.apps]
    cluster, workers = start_cluster({**FAST_HEALTH, **cfg.ray.system_config()})
    stopped: list[int] = []
    try:
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
        ctl = controller_actor(cfg)
        deadline = time.monotonic() + PLACE_TIMEOUT_S
        st = None
        while st is None and time.monotonic() < deadline:
            st = _placed(ctl, names)
            time.sleep(0.5)
        if st is None:
            raise RuntimeError(f"the apps were not placed within {PLACE_TIMEOUT_S:g} s")
        primary = st["apps"]["cls"]["primary"]["node"]
        seeds = [f"http://{n['host']}:{n['routes_port']}" for n in st["nodes"].values()]
        # The front door requests go to the machine that holds no copy of cls: it forwards them.
        held = {st["apps"]["cls"]["primary"]["node"], st["apps"]["cls"]["standby"]["node"]}
        door = next(n for nid, n in st["nodes"].items() if nid not in held)
        door_url = f"http://{door['host']}:{door['http_port']}/v2/models/{{}}/infer"
        rng = np.random.default_rng(seed)
        x = rng.random((3, 32, 32), dtype=np.float32)
        body = oip_body(x)
        rows: list[dict[str, Any]] = []
        lock = threading.Lock()
        pick = random.Random(seed)
        with FleetClient(seeds, failover_s=0.5, timeout_s=10.0) as client:
            while client.refresh() <= 0 or not set(names) <= set(client.table["apps"]):
                time.sleep(0.2)
            for name in names if http_share > 0 else ():  # the door's table has every app (a 404 until then)
                deadline = time.monotonic() + 60
                while (got := http_infer(door_url.format(name), body)) != "OK":
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the front door at {door_url.format(name)} did not answer OK within "
                                           f"60 s: {got}")
                    time.sleep(0.2)

            def send() -> None:
                with lock:
                    app, http = pick.choice(names), pick.random() < http_share
                t0 = time.time()
                row: dict[str, Any] = {"sent": t0, "app": app, "transport": "http" if http else "udp"}
                if http:
                    row["status"] = http_infer(door_url.format(app), body)
                    row["done"] = time.time()
                    row["latency_ms"] = (row["done"] - t0) * 1e3
                else:
                    try:
                        r = client.infer(app, x)
                        row.update(done=time.time(), status=Status(r.status).name, latency_ms=r.latency_ms,
                                   attempts=r.attempts)
                    except RequestLost:
                        row.update(done=time.time(), status="UNANSWERED")
                with lock:
                    rows.append(row)

            decisions: list[dict[str, Any]] = []
            if fault == "head":
                # The driver lets go of Ray first: it may be attached to the head's raylet, and a Ray
                # driver whose raylet dies exits. The controller dies with the head; its decisions so
                # far are what is kept.
                decisions = ray.get(ctl.status.remote(), timeout=30)["decisions"]
                ray.shutdown()

            killed_at: list[float] = []
            change_seen: list[dict[str, Any] | None] = []

            def cls_on(node: str) -> dict[str, Any]:
                agent = ray.get_actor(agent_name(node), namespace=NAMESPACE)
                return dict((ray.get(agent.status.remote(), timeout=30).get("apps") or {}).get("cls") or {})

            def under_way() -> bool:
                """The primary's node is making the change (or has made it: then it is too late)."""
                a = cls_on(primary)
                if a.get("change") or a.get("gpu_pct") == SHARE_TO:
                    change_seen.append(a.get("change"))
                    return True
                return False

            def inject() -> None:
                w = next(w for w in workers if w.node_id == primary)
                if fault == "share":
                    ray.get(ctl.set_share.remote("cls", SHARE_TO), timeout=30)
                    deadline = time.monotonic() + 120
                    while not under_way():
                        if time.monotonic() > deadline:
                            raise RuntimeError("the change of share did not begin within 120 s")
                        time.sleep(0.05)
                killed_at.append(time.time())
                if fault == "head":
                    # The head whole (GCS, its raylet, the controller on it), without warning.
                    cluster.head_node.kill_all_processes(check_alive=False, allow_graceful=False)
                elif fault in ("kill", "share"):
                    # The whole machine at once: its orchestrator (and instances, one process group),
                    # the agent, then the raylet and the rest of the Ray node.
                    info = st["nodes"][primary]
                    for fn, pid in ((os.killpg, int(info["node_pid"])), (os.kill, int(info["pid"]))):
                        try:
                            fn(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    cluster.remove_node(w, allow_graceful=False)
                elif fault == "stop":
                    for pid in _pids_of(w, st["nodes"][primary]):
                        try:
                            os.kill(pid, signal.SIGSTOP)
                            stopped.append(pid)
                        except ProcessLookupError:
                            pass
                    try:
                        os.killpg(int(st["nodes"][primary]["node_pid"]), signal.SIGSTOP)
                        stopped.append(-int(st["nodes"][primary]["node_pid"]))
                    except ProcessLookupError:
                        pass

            t_start, t_fault, t_end = drive(send, inject if fault != "none" else None, rate_rps=rate_rps,
                                            before_s=before_s, after_s=after_s, rng=rng)
            if fault != "none":
                if not killed_at:
                    raise RuntimeError(f"the {fault} fault did not happen")
                t_fault = killed_at[0]  # the share fault is timed from its kill, not from the change
            share_after = None
            if fault == "share":  # the promoted standby's node ends at the new share
                deadline = time.monotonic() + 120
                while True:
                    a = cls_on(st["apps"]["cls"]["standby"]["node"])
                    share_after = a.get("gpu_pct")
                    if (share_after == SHARE_TO and not a.get("change")) or time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
            duplicates, failovers = client.duplicates, client.failovers
        if fault != "head":
            decisions = ray.get(find_controller().status.remote(), timeout=30)["decisions"]
    finally:
        for pid in stopped:
            try:
                os.killpg(-pid, signal.SIGCONT) if pid < 0 else os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if ray.is_initialized():
            try:
                c = find_controller()
                ray.get(c.shutdown.remote(), timeout=120)
                ray.kill(c)
            except Exception:
                pass
        ray.shutdown()
        cluster.shutdown()

    def first(action: str, after: float) -> float | None:
        ts = [d["t"] for d in decisions if d["action"] == action and d["t"] >= after]
        return round(min(ts) - t_fault, 3) if ts else None

    t_suspect = first("suspect", t_fault)
    # Full re-placement: the app loaded on a third machine (its new standby) after the fault.
    ab = st["apps"]["cls"]
    old = {ab["primary"]["node"], (ab.get("standby") or {}).get("node")}
    t_replaced = [d["t"] for d in decisions if d["action"] == "applied" and d["app"] == "cls"
                  and d.get("node") not in old and d["t"] >= t_fault]
    faulted_node = primary if fault in ("kill", "stop", "share") else None
    false_suspicions = [d for d in decisions if d["action"] == "suspect" and d.get("node") != faulted_node]
    return {
        "system": "gpuprims", "fault": fault, "time_to_suspect_s": t_suspect,
        "time_to_flip_s": first("routes", t_fault + (t_suspect or 0.0)),
        "time_to_confirm_s": first("confirm_dead", t_fault),
        "time_to_replaced_s": round(min(t_replaced) - t_fault, 3) if t_replaced else None,
        **client_view(rows, t_start, t_fault, t_end),
        "by_transport": {t: {k: v for k, v in client_view([r for r in rows if r.get("transport") == t], t_start,
                                                          t_fault, t_end).items() if k != "requests"}
                         for t in ("udp", "http")},
        "duplicates_suppressed": duplicates, "failovers": failovers,
        "false_suspicions": len(false_suspicions), "decisions": decisions,
        **({"change_at_kill": change_seen[0] if change_seen else None, "share_after": share_after}
           if fault == "share" else {}),
    }


def http_infer(url: str, body: bytes, timeout_s: float = 10.0) -> str:
    """One OIP/HTTP request: "OK", "HTTP_<code>" (an answer: an error status) or "UNANSWERED"."""
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            r.read()
        return "OK"
    except urllib.error.HTTPError as e:
        return f"HTTP_{e.code}"
    except OSError:  # refused, reset or timed out: no answer
        return "UNANSWERED"


def client_view(rows: list[dict[str, Any]], t_start: float, t_fault: float, t_end: float) -> dict[str, Any]:
    """What the clients saw: counts by outcome, the first OK after the fault, latency before and after."""
    after = [r for r in rows if r["sent"] >= t_fault]
    oks_after = [r["done"] for r in after if r["status"] == "OK"]
    before = [r["latency_ms"] for r in rows if r["sent"] < t_fault and r["status"] == "OK"]
    later = [r["latency_ms"] for r in after if r["status"] == "OK"]
    return {
        "time_to_first_ok_s": round(min(oks_after) - t_fault, 3) if oks_after else None,
        "sent": len(rows), "ok": sum(r["status"] == "OK" for r in rows),
        "errors": sum(r["status"] not in ("OK", "UNANSWERED") for r in rows),
        "unanswered": sum(r["status"] == "UNANSWERED" for r in rows),
        "run_s": round(t_end - t_start, 1),
        "p50_ms_before": percentiles(before, (50,)).get("p50") if before else None,
        "p99_ms_before": percentiles(before, (99,)).get("p99") if before else None,
        "p50_ms_after": percentiles(later, (50,)).get("p50") if later else None,
        "p99_ms_after": percentiles(later, (99,)).get("p99") if later else None,
        "requests": rows,
    }


class ServeModel:
    """The app as a Ray Serve deployment (the peer row): the same model, seed and input, no batching."""

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        self.torch = torch
        self.model = build_model(APP["model"], seed=APP["seed"], num_classes=APP["num_classes"],
                                 input_shape=tuple(APP["input_shape"])).eval()
        self.node = ray.get_runtime_context().get_node_id()  # the bench kills a machine that holds one

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import Response

        x = np.frombuffer(await request.body(), np.float32).reshape(1, *APP["input_shape"])
        with self.torch.inference_mode():
            y = self.model(self.torch.from_numpy(x.copy())).numpy()
        return Response(y.tobytes(), media_type="application/octet-stream", headers={"x-node": self.node})


def one_run_rayserve(fault: str, *, rate_rps: float, before_s: float, after_s: float, seed: int) -> dict[str, Any]:
    """The same machine fault on Ray Serve: the app as a deployment with two replicas on the gpuprims
    machines (its way to keep a warm copy; the machine killed holds one), Serve's defaults otherwise, its HTTP proxy on the head, a
    plain HTTP client (timeout 10 s, no retry of its own: Serve's router is what fails over)."""
    from ray import serve  # the peer extra (ray[serve]); the gpuprims rows need only ray core

    cluster, workers = start_cluster(FAST_HEALTH)
    stopped: list[int] = []
    try:
        ray.init(address=cluster.address, namespace="gpuprims-bench-serve", log_to_driver=False)
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        dep = serve.deployment(ServeModel, num_replicas=2,
                               ray_actor_options={"num_cpus": 0, "resources": {"gpuprims": 1}})
        serve.run(dep.bind(), name="cls", route_prefix="/cls")
        url = f"http://127.0.0.1:{port}/cls"
        rng = np.random.default_rng(seed)
        body = rng.random((3, 32, 32), dtype=np.float32).tobytes()
        rows: list[dict[str, Any]] = []
        lock = threading.Lock()

        def send() -> None:
            t0 = time.time()
            row: dict[str, Any] = {"sent": t0}
            try:
                with urllib.request.urlopen(urllib.request.Request(url, data=body, method="POST"), timeout=10.0) as r:
                    r.read()
                row["status"] = "OK"
            except urllib.error.HTTPError as e:  # an answer: an error status
                row["status"] = f"HTTP_{e.code}"
            except OSError:  # refused, reset or timed out: no answer
                row["status"] = "UNANSWERED"
            row["done"] = time.time()
            row["latency_ms"] = (row["done"] - t0) * 1e3
            with lock:
                rows.append(row)

        victim: list[Any] = []

        def inject() -> None:
            if fault == "kill":
                cluster.remove_node(victim[0], allow_graceful=False)
            else:
                # The machine's Ray processes and their children (the replica's worker among them).
                top = [p.process.pid for ps in victim[0].all_processes.values() for p in ps if p.process is not None]
                pids = set(top)
                for pid in top:
                    with contextlib.suppress(psutil.Error):
                        pids.update(c.pid for c in psutil.Process(pid).children(recursive=True))
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGSTOP)
                        stopped.append(pid)

        deadline = time.monotonic() + PLACE_TIMEOUT_S
        while not victim:  # the proxy answers once the replicas are up; the victim is a machine with one
            with contextlib.suppress(OSError):
                req = urllib.request.Request(url, data=body, method="POST")
                with urllib.request.urlopen(req, timeout=10.0) as r:
                    r.read()
                    victim.extend(w for w in workers if w.node_id == r.headers.get("x-node"))
            if time.monotonic() > deadline:
                raise RuntimeError(f"Ray Serve did not answer within {PLACE_TIMEOUT_S:g} s")
            time.sleep(0.2)
        t_start, t_fault, t_end = drive(send, inject, rate_rps=rate_rps, before_s=before_s, after_s=after_s, rng=rng)
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        try:
            serve.shutdown()
        except Exception:
            pass
        ray.shutdown()
        cluster.shutdown()
    return {"system": "rayserve", "fault": fault, **client_view(rows, t_start, t_fault, t_end)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one short run per fault at a low rate")
    ap.add_argument("--runs", type=int, default=10, help="runs per fault (ignored with --quick)")
    ap.add_argument("--faults", default="kill,stop,head,share", help=f"comma-separated: {', '.join(FAULTS)}")
    ap.add_argument("--rate", type=float, default=20.0, help="requests/s (Poisson)")
    ap.add_argument("--before", type=float, help="seconds of traffic before the fault (default 10, quick 3)")
    ap.add_argument("--after", type=float, help="seconds of traffic after it (default 20, quick 8)")
    ap.add_argument("--apps", type=int, default=1, help="apps in the fleet (cls, and cls2.. beside it at 30 %% each)")
    ap.add_argument("--http-share", type=float, default=0.0,
                    help="fraction of requests sent over OIP/HTTP to the front door of the machine holding no "
                         "copy of cls (it forwards them); the rest over UDP by the FleetClient")
    ap.add_argument("--name", default="fleet", help="result name (fleet-soak for a 'none' soak beside busy loops)")
    ap.add_argument("--rayserve", default="kill,stop",
                    help="faults also run on Ray Serve, the peer row (kill, stop; '' for none; needs the peer extra)")
    args = ap.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    serve_faults = [f for f in args.rayserve.split(",") if f]
    bad = sorted(set(faults) - set(FAULTS)) + sorted(set(serve_faults) - {"kill", "stop"})
    if bad:
        ap.error(f"unknown fault(s) {bad}; choose from {', '.join(FAULTS)} (Ray Serve: kill, stop)")
    if not 1 <= args.apps <= 3 or not 0.0 <= args.http_share <= 1.0:
        ap.error(f"need 1 <= --apps <= 3 and 0 <= --http-share <= 1, got {args.apps} and {args.http_share}")
    serve_skipped = None
    if serve_faults and importlib.util.find_spec("ray.serve") is None:
        serve_skipped = "Ray Serve rows skipped: ray[serve] is not installed (pip install -e '.[peer]')"
        print(serve_skipped)
        serve_faults = []
    runs = 1 if args.quick else args.runs
    rate = 5.0 if args.quick else args.rate
    before_s, after_s = (3.0, 8.0) if args.quick else (10.0, 20.0)
    before_s = before_s if args.before is None else args.before
    after_s = after_s if args.after is None else args.after
    load_before = os.getloadavg()
    results: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    gp = functools.partial(one_run, apps=args.apps, http_share=args.http_share)
    plan = [("gpuprims", f, gp) for f in faults] + [("rayserve", f, one_run_rayserve) for f in serve_faults]
    for system, f, run in plan:
        for i in range(runs):
            try:
                results.append(run(f, rate_rps=rate, before_s=before_s, after_s=after_s, seed=i))
                print(f"{system} {f} run {i}: " + ", ".join(
                    f"{k} {v}" for k, v in results[-1].items() if k not in ("requests", "decisions")), flush=True)
            except Exception as e:  # e.g. Ray's head not starting on an overloaded machine: reported, not hidden
                print(f"run {i} of {system} fault {f} could not run: {e}", flush=True)
                failed.append({"system": system, "fault": f, "run": i, "error": str(e)})
    summary: dict[str, Any] = {"rate_rps": rate, "runs_per_fault": runs, "apps": args.apps,
                               "http_share": args.http_share, "runs_failed_to_start": len(failed),
                               "before_s": before_s, "after_s": after_s, "rayserve_skipped": serve_skipped}
    for system, f, _ in plan:
        rs = [r for r in results if r["fault"] == f and r["system"] == system]
        prefix = f if system == "gpuprims" else f"rayserve_{f}"
        for key in ("time_to_suspect_s", "time_to_flip_s", "time_to_confirm_s", "time_to_first_ok_s",
                    "time_to_replaced_s"):
            vals = [r[key] for r in rs if r.get(key) is not None]
            if system == "gpuprims" or key == "time_to_first_ok_s":
                summary[f"{prefix}_{key.removesuffix('_s')}_max_s"] = max(vals) if vals else None
        counted = ("sent", "ok", "errors", "unanswered") + (
            ("duplicates_suppressed", "false_suspicions") if system == "gpuprims" else ())
        for key in counted:
            summary[f"{prefix}_{key}"] = sum(r[key] for r in rs)
        if system == "gpuprims" and args.http_share > 0:
            for key in ("sent", "ok", "errors", "unanswered"):
                summary[f"{prefix}_http_{key}"] = sum(r["by_transport"]["http"][key] for r in rs)
        if system == "gpuprims" and f == "share":  # killed mid-change (not after it); standby at the new share
            summary["share_killed_mid_change"] = sum(r.get("change_at_kill") is not None for r in rs)
            summary["share_standby_at_new_share"] = sum(r.get("share_after") == SHARE_TO for r in rs)
    notes = (f"{args.apps} app(s), {args.http_share:.0%} of requests over OIP/HTTP to the front door of the "
             "machine holding no copy of cls (forwarded), the rest over UDP. "
             "Ray cluster on one machine (head + 3 gpuprims machines, 1 CPU each, token auth), CPU backend, "
             "FleetClient with failover_s 0.5; replaced = the app loaded on the third machine (its new standby). "
             "Ray Serve rows: the app as a deployment with two replicas on the gpuprims machines (the "
             "machine killed holds one), proxy on the head, a plain HTTP client with a 10 s timeout and no retry." + (" QUICK run: a smoke test, not figures." if args.quick else "")
             + load_note(load_before))
    path = write_result(args.name, "cpu", summary, {"runs": results, "failed": failed}, notes=notes, load_avg_before=load_before,
                        large_samples=True)
    print(path)
    for k, v in summary.items():
        print(f"  {k}: {v}")


if __name__ == "__main__":
    main()
