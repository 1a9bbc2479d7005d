"""bench/chaos: exactly-once under faults. A real node under steady Poisson load while faults hit it.

It starts ``gpuprims-orchestrator start`` on a copy of ``examples/apps.yaml`` (a private run dir, a
free UDP port), sends Poisson requests to both apps from its own client, and at random times:

- ``kill``: SIGKILLs an instance (active or shadow; pids from the node's status);
- ``set_gpu``: changes an app's GPU% down or back up (Overlapped-Execution);
- ``bad_control``: sends the node's command socket malformed frames (bad token, unknown tag, bad
  JSON, wrong direction, no envelope, oversized), and well-formed requests with an unknown app or a
  GPU% out of range; the node must drop or refuse each and keep answering ``status``;
- ``flood``: a burst of malformed datagrams to the same UDP port from another socket (random bytes,
  truncated and bit-flipped valid packets, wrong version, unknown app ids, bad chunk indexes).

Its own checker (`Ledger`, not the traffic tool's report) matches every request id sent to its
answers: answered OK, answered with each error status, lost (never answered by the end of the grace
period; target 0), duplicated (answered more than once; target 0), corrupted (an OK answer whose
logits differ from running the app's model directly in torch on the same input: every OK answer is
checked, against a handful of distinct inputs per app computed once at start). Each loss is
attributed to the last fault before it. It also samples the node's memory (RSS of the orchestrator
and its instances) and open fds at start and end. Writes ``bench/results/<machine>/<name>.json``
(``runs.contended`` / ``runs.uncontended``, the other run kept if the file exists).

Run: ``python -m bench.chaos [--duration 600] [--contended] [--quick] [--name reliability]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from bench.common import ROOT, results_dir, write_result
from gpuprims import wire

FAULT_KINDS = ("kill", "set_gpu", "bad_control", "flood")
FAULT_WEIGHTS = (0.35, 0.25, 0.2, 0.2)


# ---- the checker


@dataclass
class _Sent:
    app_id: int
    t_s: float
    variant: int
    answers: int = 0
    statuses: list[int] = field(default_factory=list)
    corrupted: bool = False


class Ledger:
    """Matches every request sent to its answers; thread-safe.

    ``expected[app_id][variant]`` is the logits the app's model gives for that input (None: OK
    bodies are not checked). An OK answer is corrupted when its body is not close to them
    (``rtol``/``atol``; batching changes float sums slightly) or has another length.
    """

    def __init__(self, expected: dict[int, list[np.ndarray]] | None = None, *, rtol: float = 1e-3,
                 atol: float = 1e-4) -> None:
        self.expected = expected or {}
        self.rtol, self.atol = rtol, atol
        self._sent: dict[tuple[int, int], _Sent] = {}
        self.unmatched = 0
        self.invalid = 0
        self.ok_checked = 0
        self.faults: list[tuple[float, str, str]] = []
        self._lock = threading.Lock()

    def sent(self, app_id: int, request_id: int, t_s: float, variant: int = 0) -> None:
        with self._lock:
            key = (app_id, request_id)
            if key in self._sent:
                raise ValueError(f"request {key} sent twice")
            self._sent[key] = _Sent(app_id, t_s, variant)

    def answer(self, app_id: int, request_id: int, status: int, body: bytes = b"") -> None:
        with self._lock:
            s = self._sent.get((app_id, request_id))
            if s is None:
                self.unmatched += 1
                return
            s.answers += 1
            s.statuses.append(status)
            if s.answers == 1 and status == wire.Status.OK:
                exp = self.expected.get(app_id)
                if exp is not None:
                    self.ok_checked += 1
                    got = np.frombuffer(body, dtype=np.float32) if len(body) % 4 == 0 else None
                    want = exp[s.variant]
                    if got is None or got.shape != want.shape or not np.allclose(got, want, rtol=self.rtol,
                                                                                  atol=self.atol):
                        s.corrupted = True

    def datagram_invalid(self) -> None:
        with self._lock:
            self.invalid += 1

    def fault(self, t_s: float, kind: str, detail: str = "") -> None:
        with self._lock:
            self.faults.append((t_s, kind, detail))

    def ok_by_app(self) -> dict[int, int]:
        """Requests whose first answer was OK, per app id."""
        with self._lock:
            out: dict[int, int] = {}
            for (app, _rid), s in self._sent.items():
                if s.statuses and s.statuses[0] == wire.Status.OK:
                    out[app] = out.get(app, 0) + 1
            return out

    def outstanding(self) -> int:
        with self._lock:
            return sum(1 for s in self._sent.values() if s.answers == 0)

    def result(self) -> dict[str, Any]:
        """The figures: sent, ok (first answer OK, corrupted ones included), errors_by_status (by the first
        answer), lost, duplicated (answers beyond the first), corrupted, faults, losses by preceding fault."""
        with self._lock:
            sent = list(self._sent.items())
            faults = sorted(self.faults)
        errors: Counter[str] = Counter()
        ok = lost = duplicated = corrupted = 0
        lost_list = []
        for (app, rid), s in sent:
            if s.answers == 0:
                lost += 1
                lost_list.append((s.t_s, app, rid))
                continue
            duplicated += s.answers - 1
            first = s.statuses[0]
            if first == wire.Status.OK:
                ok += 1
            else:
                errors[_status_name(first)] += 1
            corrupted += s.corrupted
        fault_times = [f[0] for f in faults]
        losses = []
        by_fault: Counter[str] = Counter()
        for t, app, rid in sorted(lost_list):
            i = int(np.searchsorted(fault_times, t, side="right")) - 1
            prev = faults[i] if i >= 0 else None
            by_fault[prev[1] if prev else "none"] += 1
            losses.append({"app_id": app, "request_id": rid, "t_s": round(t, 3),
                           "preceding_fault": prev[1] if prev else None,
                           "preceding_fault_detail": prev[2] if prev else None,
                           "since_fault_s": round(t - prev[0], 3) if prev else None})
        return {"sent": len(sent), "ok": ok, "errors_by_status": dict(errors), "lost": lost,
                "duplicated": duplicated, "corrupted": corrupted, "ok_checked_against_torch": self.ok_checked,
                "unmatched": self.unmatched, "invalid_datagrams": self.invalid,
                "faults_by_kind": dict(Counter(f[1] for f in faults)), "lost_by_preceding_fault": dict(by_fault),
                "losses": losses[:200], "faults": [{"t_s": round(t, 3), "kind": k, "detail": d}
                                                    for t, k, d in faults]}


def _status_name(v: int) -> str:
    try:
        return wire.Status(v).name
    except ValueError:
        return f"STATUS_{v}"


# ---- malformed input


def malformed_datagrams(valid: list[bytes], n: int, rng: random.Random) -> tuple[list[bytes], Counter[str]]:
    """`n` datagrams no node may serve as the request they resemble, by kind (from `valid` ones)."""
    out: list[bytes] = []
    kinds: Counter[str] = Counter()
    for _ in range(n):
        base = bytearray(rng.choice(valid))
        k = rng.choice(("random", "truncated", "bitflip", "version", "unknown_app", "bad_chunk", "oversize",
                        "bad_length"))
        if k == "random":
            d = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 1500)))
        elif k == "truncated":
            d = bytes(base[:rng.randrange(0, len(base))])
        elif k == "bitflip":
            for _ in range(rng.randrange(1, 8)):
                i = rng.randrange(len(base))
                base[i] ^= 1 << rng.randrange(8)
            d = bytes(base)
        elif k == "version":
            base[4] = rng.choice((0, 2, 255))
            d = bytes(base)
        elif k == "unknown_app":
            base[8:10] = rng.randrange(100, 65536).to_bytes(2, "little")
            d = bytes(base)
        elif k == "bad_chunk":
            base[12:16] = rng.randrange(1000, 2**32).to_bytes(4, "little")
            d = bytes(base)
        elif k == "oversize":
            d = bytes(base) + bytes(rng.randrange(2000, 9000))
        else:
            base[20:24] = rng.randrange(0, 2**32).to_bytes(4, "little")
            d = bytes(base)
        kinds[k] += 1
        out.append(d)
    return out, kinds


def bad_control_frames(token: bytes, rng: random.Random) -> tuple[str, list[bytes]]:
    """One malformed or refused command (frames for a DEALER: [b"", token, header, ...])."""
    status_hdr = bytes([11]) + b"{}"
    kind = rng.choice(("bad_token", "unknown_tag", "bad_json", "wrong_direction", "no_envelope", "huge_header",
                       "many_frames", "unknown_app", "pct_zero", "pct_over", "pct_string", "extra_field"))
    frames: list[bytes]
    if kind == "bad_token":
        frames = [b"", b"0" * len(token), status_hdr]
    elif kind == "unknown_tag":
        frames = [b"", token, bytes([200]) + b"{}"]
    elif kind == "bad_json":
        frames = [b"", token, bytes([14]) + b'{"app": "classify", "gpu_pct": 5']
    elif kind == "wrong_direction":
        frames = [b"", token, bytes([9]) + b"{}"]  # Shutdown is the orchestrator's to send
    elif kind == "no_envelope":
        frames = [token, status_hdr]
    elif kind == "huge_header":
        frames = [b"", token, bytes([11]) + b'{"x": "' + b"a" * (2 << 20) + b'"}']
    elif kind == "many_frames":
        frames = [b"", token, status_hdr] + [b"x"] * 100
    elif kind == "unknown_app":
        frames = [b"", token, bytes([14]) + json.dumps({"app": "no-such-app", "gpu_pct": 50}).encode()]
    elif kind == "pct_zero":
        frames = [b"", token, bytes([14]) + json.dumps({"app": "classify", "gpu_pct": 0}).encode()]
    elif kind == "pct_over":
        frames = [b"", token, bytes([14]) + json.dumps({"app": "detect", "gpu_pct": 101}).encode()]
    elif kind == "pct_string":
        frames = [b"", token, bytes([14]) + json.dumps({"app": "detect", "gpu_pct": "fifty"}).encode()]
    else:
        frames = [b"", token, bytes([11]) + json.dumps({"verbose": True}).encode()]
    return kind, frames


# ---- the node and its processes


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def node_pids(status: dict[str, Any]) -> dict[str, int]:
    """{'orchestrator': pid, '<instance>': pid, ...} from a status snapshot."""
    pids = {"orchestrator": int(status["node"]["pid"])}
    for i, fs in enumerate(status["node"].get("fork_servers", [])):
        pids[f"fork_server_{i}"] = int(fs["pid"])
    for app in status["apps"].values():
        for inst in app["instances"]:
            if inst.get("pid"):
                pids[inst["name"]] = int(inst["pid"])
    return pids


def resources(status: dict[str, Any]) -> dict[str, Any]:
    pids = node_pids(status)
    rss = {n: _rss_mb(p) for n, p in pids.items()}
    fds = {n: _fds(p) for n, p in pids.items()}
    return {"rss_mb": round(sum(v for v in rss.values() if v), 1), "fds": sum(v for v in fds.values() if v),
            "per_process": {n: {"pid": pids[n], "rss_mb": rss[n] and round(rss[n], 1), "fds": fds[n]} for n in pids}}


class NodeControl:
    """Talks to the node through its command socket, as the CLI does."""

    def __init__(self, run_dir: Path) -> None:
        from orchestrator.control.channel import control_address, read_token

        self.run_dir = run_dir
        self.token = read_token(run_dir)
        self.address = control_address("zmq", run_dir)

    def request(self, msg: Any, timeout_s: float) -> Any:
        from orchestrator.control.channel import connect_command

        with connect_command(self.address, self.token) as cli:
            return cli.request(msg, timeout_ms=timeout_s * 1000)

    def status(self, timeout_s: float = 10.0) -> dict[str, Any]:
        from orchestrator.control.messages import StatusRequest

        return self.request(StatusRequest(), timeout_s).status

    def raw(self, frames: list[bytes], wait_s: float) -> bool:
        """Send frames from a DEALER; True if anything came back within wait_s."""
        import zmq

        ctx = zmq.Context.instance()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        try:
            s.connect(self.address.commands)
            s.send_multipart(frames)
            return bool(s.poll(int(wait_s * 1000)))
        finally:
            s.close(linger=0)


def wait_ready(run_dir: Path, proc: subprocess.Popen, apps: list[str], timeout_s: float) -> dict[str, Any]:
    """Wait until every app has a ready active instance; raises if the node exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the node exited ({proc.returncode}) before it was ready")
        if (run_dir / "token").exists():
            try:
                st = NodeControl(run_dir).status(5.0)
                if all(any(i.get("role") == "active" and i.get("ready") for i in st["apps"][a]["instances"])
                       for a in apps):
                    return st
            except Exception as e:  # not up yet
                last = e
        time.sleep(0.5)
    raise TimeoutError(f"node not ready within {timeout_s:.0f} s (raise --ready-timeout): {last}")


# ---- the run


@dataclass
class AppLoad:
    name: str
    app_id: int
    variants: list[np.ndarray]
    datagrams: list[list[bytes]] = field(default_factory=list)  # per variant, request id 0


class LoadClient:
    """Poisson requests for every app from one UDP socket, each answer fed to a Ledger.

    ``rates`` are requests/s per app id (changeable while running with `set_rate`); request ids are
    unique across apps. `start()` runs a sender and a receiver thread; the sender stops after
    ``duration_s``, the receiver at `close()`.
    """

    def __init__(self, loads: list[AppLoad], dest: tuple[str, int], ledger: Ledger, rates: dict[int, float], *,
                 seed: int = 1) -> None:
        self.loads, self.dest, self.ledger = loads, dest, ledger
        self.rates = dict(rates)
        self.rng = random.Random(seed)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.t0 = 0.0
        self.rid = 0

    def set_rate(self, app_id: int, rps: float) -> None:
        self.rates[app_id] = rps

    def start(self, t0: float, duration_s: float) -> None:
        self.t0 = t0
        for fn, args in ((self._receive, ()), (self._send, (duration_s,))):
            t = threading.Thread(target=fn, args=args, name=f"load-{fn.__name__}", daemon=True)
            t.start()
            self._threads.append(t)

    def join_sender(self, timeout: float | None = None) -> None:
        self._threads[1].join(timeout)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()
        self.sock.close()

    def _receive(self) -> None:
        asm = wire.ResponseAssembler()
        while not self._stop.is_set():
            try:
                d = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                r = asm.feed(d)
            except wire.WireError:
                self.ledger.datagram_invalid()
                continue
            if r is not None:
                self.ledger.answer(r.app_id, r.request_id, r.status, r.body)

    def _gap(self, app_id: int) -> float:
        rate = self.rates.get(app_id, 0.0)
        return self.rng.expovariate(rate) if rate > 0 else 0.5

    def _send(self, duration_s: float) -> None:
        nxt = [self.t0 + self._gap(a.app_id) for a in self.loads]
        end = self.t0 + duration_s
        while not self._stop.is_set():
            i = min(range(len(self.loads)), key=lambda k: nxt[k])
            due = nxt[i]
            if due >= end:
                return
            delay = due - time.monotonic()
            if delay > 0:
                self._stop.wait(min(delay, 0.5))
                continue
            a = self.loads[i]
            nxt[i] = due + self._gap(a.app_id)
            if self.rates.get(a.app_id, 0.0) <= 0:
                continue
            self.rid += 1
            v = self.rid % len(a.variants)
            self.ledger.sent(a.app_id, self.rid, time.monotonic() - self.t0, v)
            for d in a.datagrams[v]:
                b = bytearray(d)
                b[24:32] = self.rid.to_bytes(8, "little")
                b[40:48] = time.monotonic_ns().to_bytes(8, "little")
                with contextlib.suppress(OSError):
                    self.sock.sendto(b, self.dest)


def expected_outputs(cfg: Any, app_name: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """The oracle: the app's model run directly in torch on each input (as the instance preprocesses)."""
    import torch

    from apps.zoo import load_model
    from gpuprims.gather import preprocess

    app = next(a for a in cfg.apps if a.name == app_name)
    model = load_model(app.model, seed=app.seed, num_classes=app.num_classes,
                       input_shape=tuple(app.input_shape)).eval()
    with torch.no_grad():
        return [model(preprocess(torch.from_numpy(x)[None], app.dtype)).float().numpy().reshape(-1)
                for x in inputs]


def private_config(config: Path, tmp: Path) -> tuple[Path, Any]:
    """A copy of `config` in `tmp` with a private run dir, a free UDP port, no metrics port and no
    HTTP/gRPC front door (fixed ports in the example; this bench drives the UDP path)."""
    from orchestrator.config.schema import load_config

    doc = yaml.safe_load(config.read_text())
    doc["node"]["listen"]["port"] = 0
    doc["node"]["run_dir"] = str(tmp / "run")
    doc["node"]["metrics_port"] = 0
    doc["node"]["http_port"] = doc["node"]["grpc_port"] = 0
    cfg_path = tmp / "apps.yaml"
    cfg_path.write_text(yaml.safe_dump(doc))
    return cfg_path, load_config(cfg_path)


def make_loads(cfg: Any, variants: int, seed: int) -> tuple[list[AppLoad], dict[int, list[np.ndarray]]]:
    """`variants` random inputs per app, their request datagrams, and the oracle's logits for each."""
    loads: list[AppLoad] = []
    expected: dict[int, list[np.ndarray]] = {}
    nrng = np.random.default_rng(seed)
    for a in cfg.apps:
        shape = tuple(a.input_shape)
        if a.dtype == "uint8":
            xs = [nrng.integers(0, 256, shape, dtype=np.uint8) for _ in range(variants)]
        else:
            xs = [nrng.random(shape, dtype=np.float32) for _ in range(variants)]
        loads.append(AppLoad(a.name, a.app_id, xs, [wire.encode_request(a.app_id, 0, x) for x in xs]))
        expected[a.app_id] = expected_outputs(cfg, a.name, xs)
    return loads, expected


def start_node(cfg_path: Path, log_path: Path, ready_timeout_s: float) -> subprocess.Popen:
    """`gpuprims-orchestrator start cfg_path` in its own session, output to log_path."""
    with open(log_path, "w") as log_f:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-m", "orchestrator.cli.main", "start", str(cfg_path), "--ready-timeout",
                                 str(ready_timeout_s)], cwd=ROOT, stdout=log_f, stderr=subprocess.STDOUT,
                                start_new_session=True)


def stop_node(proc: subprocess.Popen, ctl: NodeControl | None, timeout_s: float = 120.0) -> int:
    """Ask the node to stop (draining); kill its session if it has not exited within timeout_s."""
    from orchestrator.control.messages import StopRequest

    if ctl is not None and proc.poll() is None:
        with contextlib.suppress(Exception):
            ctl.request(StopRequest(drain=True), 10)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def _busy_loops(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(n)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from orchestrator.control.messages import SetGpuRequest

    rng = random.Random(args.seed)  # faults
    tmp = Path(tempfile.mkdtemp(prefix="chaos-", dir="/tmp"))
    cfg_path, cfg = private_config(Path(args.config), tmp)
    apps = [a.name for a in cfg.apps]
    # Inputs and the oracle, before the node takes the cores.
    loads, expected = make_loads(cfg, args.variants, args.seed)
    ledger = Ledger(expected)

    busy = _busy_loops(2) if args.contended else []
    load0 = os.getloadavg()
    proc = start_node(cfg_path, tmp / "node.log", args.ready_timeout)
    stop_evt = threading.Event()
    client: LoadClient | None = None
    flood_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        run_dir = tmp / "run"
        st0 = wait_ready(run_dir, proc, apps, args.ready_timeout)
        port = st0["node"]["ports"][0]
        ctl = NodeControl(run_dir)
        res_start = resources(st0)
        t0 = time.monotonic()
        flood_sock.bind(("127.0.0.1", 0))
        flood_sock.setblocking(False)
        dest = ("127.0.0.1", port)
        flood_counts: Counter[str] = Counter()
        control_counts: Counter[str] = Counter()
        control_replied: Counter[str] = Counter()
        status_failures: list[str] = []
        set_gpu_results: list[dict[str, Any]] = []

        def faults() -> None:
            while not stop_evt.wait(rng.expovariate(1 / args.fault_interval)):
                if time.monotonic() - t0 > args.duration - 2:
                    return
                kind = rng.choices(FAULT_KINDS, weights=FAULT_WEIGHTS)[0]
                now = time.monotonic() - t0
                try:
                    if kind == "kill":
                        # Mostly active instances: they hold the requests.
                        st = ctl.status()
                        insts = [i for a in st["apps"].values() for i in a["instances"] if i.get("pid")]
                        active = [i for i in insts if i.get("role") == "active"]
                        pool = active if active and rng.random() < 0.75 else insts
                        if not pool:
                            continue
                        victim = rng.choice(pool)
                        os.kill(int(victim["pid"]), signal.SIGKILL)
                        ledger.fault(now, "kill", f"{victim['name']} ({victim.get('role')})")
                    elif kind == "set_gpu":
                        # Down or up from where the app is now (the node's monitor moves shares too),
                        # up only into the room the other apps leave.
                        st = ctl.status()
                        app = rng.choice(apps)
                        cur = int(st["apps"][app]["gpu_pct"])
                        room = 100 - sum(int(a["gpu_pct"]) for n, a in st["apps"].items() if n != app)
                        up = min(room, cur + rng.choice((10, 20)))
                        down = max(1, cur - rng.choice((10, 20)))
                        new = up if (up > cur and (rng.random() < 0.5 or down == cur)) else down
                        if new == cur:
                            continue
                        ledger.fault(now, "set_gpu", f"{app} {cur}->{new}")
                        t1 = time.monotonic()
                        reply = ctl.request(SetGpuRequest(app=app, gpu_pct=new), args.set_gpu_timeout)
                        set_gpu_results.append({"app": app, "from": cur, "to": new, "ok": reply.ok,
                                                "message": reply.message, "s": round(time.monotonic() - t1, 2)})
                    elif kind == "bad_control":
                        sub, frames = bad_control_frames(ctl.token.encode(), rng)
                        ledger.fault(now, "bad_control", sub)
                        control_counts[sub] += 1
                        if ctl.raw(frames, 1.0):
                            control_replied[sub] += 1
                        try:
                            ctl.status()
                        except Exception as e:
                            status_failures.append(f"after {sub}: {e}")
                    else:
                        dgrams, kinds = malformed_datagrams([d for a in loads for d in a.datagrams[0]], args.flood, rng)
                        ledger.fault(now, "flood", f"{len(dgrams)} datagrams")
                        flood_counts.update(kinds)
                        for d in dgrams:
                            with contextlib.suppress(OSError):
                                flood_sock.sendto(d, dest)
                        with contextlib.suppress(OSError):
                            while flood_sock.recv(65536):
                                pass
                except Exception as e:  # a fault that could not be injected is reported, not fatal
                    ledger.fault(now, f"{kind}_failed", repr(e)[:200])

        client = LoadClient(loads, dest, ledger, {a.app_id: args.rate for a in loads}, seed=args.seed + 1)
        client.start(t0, args.duration)
        fault_thread = threading.Thread(target=faults, name="chaos-faults", daemon=True)
        fault_thread.start()
        client.join_sender()  # the sender ends after --duration
        sent_end = time.monotonic()
        fault_thread.join(timeout=args.set_gpu_timeout)
        # Grace: answers may still come (a restarted instance loading, a switch-over finishing).
        grace_end = sent_end + args.grace
        while time.monotonic() < grace_end and ledger.outstanding() and proc.poll() is None:
            time.sleep(0.2)
        node_pid = st0["node"]["pid"]
        try:
            st1: dict[str, Any] = ctl.status()
            res_end = resources(st1)
        except Exception as e:  # the node died: what it held is lost, and the log says why
            st1, res_end = {"node_error": repr(e)}, {"rss_mb": None, "fds": None, "per_process": {}}
        stop_evt.set()
        client.close()
        client = None
        stop_node(proc, ctl)
        leftover_shm = sorted(p.name for p in Path("/dev/shm").glob(f"gpuprims-{node_pid}-*"))
        result = ledger.result()
        result.update({
            "duration_s": round(sent_end - t0, 1), "rate_per_app_rps": args.rate, "apps": apps,
            "rss_mb_start": res_start["rss_mb"], "rss_mb_end": res_end["rss_mb"], "fds_start": res_start["fds"],
            "fds_end": res_end["fds"], "processes_start": res_start["per_process"],
            "processes_end": res_end["per_process"], "flood_datagrams_by_kind": dict(flood_counts),
            "bad_control_by_kind": dict(control_counts), "bad_control_replied": dict(control_replied),
            "status_failures_after_bad_control": status_failures, "set_gpu": set_gpu_results,
            "node_drops_end": st1.get("drops", {}), "node_exit_code": proc.returncode,
            "node_alive_at_end": "node_error" not in st1, "node_error": st1.get("node_error"),
            "leftover_shm_segments": leftover_shm, "contended": args.contended,
            "load_avg_before": [round(x, 2) for x in load0], "load_avg_after": [round(x, 2) for x in os.getloadavg()],
            "node_log_tail": (tmp / "node.log").read_text()[-4000:],
        })
        return result
    finally:
        stop_evt.set()
        if client is not None:
            client.close()
        flood_sock.close()
        if proc.poll() is None:
            stop_node(proc, None, 0)
        for b in busy:
            b.kill()
            b.wait()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0, help="Seconds of load and faults.")
    ap.add_argument("--quick", action="store_true", help="A ~60 s run.")
    ap.add_argument("--contended", action="store_true", help="Two busy loops beside the node.")
    ap.add_argument("--rate", type=float, default=8.0, help="Requests/s per app (Poisson).")
    ap.add_argument("--fault-interval", type=float, default=4.0, help="Mean seconds between faults.")
    ap.add_argument("--flood", type=int, default=2000, help="Malformed datagrams per flood.")
    ap.add_argument("--variants", type=int, default=4, help="Distinct inputs per app (each checked against torch).")
    ap.add_argument("--grace", type=float, default=30.0, help="Seconds to wait for outstanding answers at the end.")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--set-gpu-timeout", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", default=str(ROOT / "examples" / "apps.yaml"))
    ap.add_argument("--name", default="reliability", help="Result file stem (e.g. reliability-prefix-quick).")
    ap.add_argument("--keep", action="store_true", help="Keep the temp dir (config, node log).")
    args = ap.parse_args()
    if args.quick:
        args.duration = 60.0
        args.grace = min(args.grace, 20.0)
    load0 = os.getloadavg()
    res = run(args)
    key = "contended" if args.contended else "uncontended"
    path = results_dir("cpu") / f"{args.name}.json"
    runs: dict[str, Any] = {}
    old_samples: dict[str, Any] = {}
    if path.exists():  # keep the other run (with or without contention)
        with contextlib.suppress(ValueError, KeyError, TypeError):
            old = json.loads(path.read_text())
            runs, old_samples = old["summary"]["runs"], old["samples"]
    samples = {k: res.pop(k) for k in ("losses", "faults", "processes_start", "processes_end", "node_log_tail",
                                       "set_gpu")}
    runs[key] = res
    write_result("reliability", "cpu", {"runs": runs}, {**old_samples, key: samples}, load_avg_before=load0,
                 name=args.name)
    print(json.dumps({k: v for k, v in res.items() if k not in ("node_drops_end",)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
