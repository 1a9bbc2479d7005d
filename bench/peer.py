"""bench/peer: the same apps on gpuprims, Ray Serve and LitServe, side by side, interleaved.

Per app (default MobileNetV2 with a 100 ms SLO and ResNet-50 with 250 ms, 3x64x64 float32 requests,
as bench/e2e), both systems run at once, each as its own process tree started by this bench:

- **gpuprims**: ``gpuprims-orchestrator start`` on a generated config: the app at gpu_pct 50 (one
  core of two on the CPU backend, as many torch threads as the share gives), ``max_batch`` and
  ``max_wait_ms`` as below, spatial scheduler, no front door and no metrics endpoint;
- **ray**: ``python -m bench.peer_ray``: a fresh local Ray cluster (no dashboard) with Serve's HTTP
  proxy and one replica (``num_cpus=1``) that loads the same zoo model with the same seed, confines
  itself with the same ``apply_cpu_share`` (same core, same torch intra/inter-op threads, same
  ``OMP_*``) and batches with ``@serve.batch`` at the same max batch size and wait;
- **litserve**: ``python -m bench.peer_litserve``: LitServe with one API server process and one
  inference worker process (cpu, one device, one worker) that loads the same model, applies the same
  ``apply_cpu_share`` and batches with ``LitAPI(max_batch_size, batch_timeout)`` at the same settings;
- **mlserver**: MLServer (``mlserver start`` on a repository written here, ``mlserver_repository``), the
  server that speaks the Open Inference Protocol natively (what a KServe user would pick): one inference
  worker process (``bench.peer_mlserver.ZooModel``) that loads the same model and applies the same
  ``apply_cpu_share``, with MLServer's adaptive batching at the same max batch size and wait. It runs from
  its own environment (``scripts/setup-mlserver.sh`` makes ``.venv-mlserver``; ``GPUPRIMS_MLSERVER_VENV``
  points elsewhere): MLServer pins fastapi, starlette and protobuf below what Ray Serve 2.60 and the
  ``peer`` extra's tritonclient need.

Before measuring, one fixed input goes to both and to the model in this process: the logits must
agree (same weights, same inputs). Traffic is open loop at constant rate from a driver process per
system (one asyncio loop; each request starts at its scheduled time whatever the earlier ones are
doing): ``gpuprims.client.AsyncClient`` over the node's UDP wire, and aiohttp (no connection limit)
posting the raw tensor to Serve, or LitServe's JSON (the tensor in base64) to LitServe; MLServer is driven
over OIP/gRPC by ``tritonclient.grpc.aio`` with ``raw_input_contents`` (its fastest way in: its HTTP path has
no binary tensor extension), the client and encoding of gpuprims' own gRPC row. Both cycle through the same 16 seeded inputs in the same order, and
give up on an answer after the same client timeout (counted ``lost``). Rates: ``light``, ``medium``
and ``overload`` = 0.25, 0.6 and 1.5 x the model's batch-8 capacity on its core, measured here in
torch first. At each rate the systems take turns in short blocks (the order alternates), so a
change in the machine's background load falls on both alike.

Per system, app and rate: ``throughput_rps`` (OK answers/s of the measured window), ``goodput_rps``
(OK within the SLO), ``p50_ms``/``p99_ms`` of OK answers, ``slo_attainment`` (OK within the SLO /
sent), ``lost``, other errors by kind, and ``cpu_s``: CPU seconds (user + system) of the system's
whole process tree over its blocks (warm-ups included), sampled from /proc through psutil every
0.2 s so processes that come and go are counted to their last sample; ``cpu_ms_per_request`` divides
by the requests sent in those blocks. The tree's idle CPU while the other system is measured is
recorded too. Ratios are gpuprims over the peer oriented so that >= 1 means gpuprims is ahead.

Engines (issue 23): ``--engine onnxruntime`` runs gpuprims' app on ``engine: onnxruntime`` and LitServe's
worker on the very same engine (``bench.peer_litserve --engine onnxruntime``: gpuprims' ONNX Runtime engine
built from the same model into the same engine cache, so the same ONNX file, the same session options and
the share's threads), and MLServer's worker on it too: the same model runner in each, so the rows compare
the servers. Ray stays on its
eager default (``ray_engine`` in the summary). The rates then come from that engine's batch-8 latency,
measured here on the same core, and the result is written as ``peer-onnxruntime.json``.

Transports (issue 26): ``--transports udp http grpc`` adds gpuprims reached through its Open Inference
Protocol front door as rows of their own, the same node (one process tree, one CPU meter) with
``node.http_port``/``grpc_port`` set: ``gpuprims-http`` driven by the same aiohttp client as the peers,
posting OIP requests with binary tensor data (the JSON header, then the raw float32 tensor, the output
asked for in binary: what tritonclient sends), and ``gpuprims-grpc`` by ``tritonclient.grpc.aio``
(``raw_input_contents``). Their ratios against each peer are ``<figure>_ratio_http`` and
``<figure>_ratio_grpc``; gpuprims' rows are not compared with each other (bench/oip does that, paired).

Run: ``python3 -m bench.peer [--quick] [--peers ray litserve] [--engine onnxruntime]`` (needs
``pip install -e '.[peer]'``; the onnxruntime engine the ``onnx`` extra).
Reports, never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import multiprocessing as mp
import os
import queue
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import yaml

from bench import serving as sv
from bench.common import ROOT, write_result
from gpuprims.cpushare import plan_cpu_shares

SHAPE = (3, 64, 64)
GPU_PCT = 50
MAX_BATCH = 8
MAX_WAIT_MS = 2.0
APP_ID = 1
APPS = {"mobilenet_v2": {"slo_ms": 100.0}, "resnet50": {"slo_ms": 250.0}}
LEVELS = {"light": 0.25, "medium": 0.6, "overload": 1.5}
SYSTEMS = ("gpuprims", "ray", "litserve", "mlserver")
# gpuprims over each transport: one node, three ways in (its UDP wire, the OIP front door's HTTP and gRPC)
TRANSPORTS = {"udp": "gpuprims", "http": "gpuprims-http", "grpc": "gpuprims-grpc"}
OURS = tuple(TRANSPORTS.values())
#: The peers a run compares with by default (``--peers``).
PEERS = SYSTEMS[1:]
N_INPUTS = 16
CLIENT_TIMEOUT_S = 2.0
#: Serve's max_ongoing_requests for the replica: its default (5) would cap a batch below MAX_BATCH.
RAY_MAX_ONGOING = 2 * MAX_BATCH
CPU_SAMPLE_S = 0.2
#: Before each block, wait (up to QUIET_MAX_S) until no system's process tree uses more than QUIET_CPU
#: cores: a system still working off requests its clients gave up on in its own block (Ray's and
#: LitServe's queues keep them) would otherwise take the shared core from the next block's system.
QUIET_CPU = 0.5
QUIET_MAX_S = 45.0
READY_TIMEOUT_S = 300.0
#: MLServer's own environment (scripts/setup-mlserver.sh), unless GPUPRIMS_MLSERVER_VENV names another.
MLSERVER_VENV = ROOT / ".venv-mlserver"


# -- pure logic (tests/bench/test_peer.py) --------------------------------------------------------------
def schedule(levels: Sequence[str], systems: Sequence[str], blocks: int) -> list[tuple[str, str, int]]:
    """(level, system, block) in run order: per level, `blocks` rounds; each round runs every system once,
    the order rotated by one each round, so neither system always goes first."""
    if blocks < 1 or not systems or not levels:
        raise ValueError(f"need levels, systems and blocks >= 1, got {list(levels)}, {list(systems)}, {blocks}")
    out = []
    for level in levels:
        for k in range(blocks):
            s = k % len(systems)
            out += [(level, system, k) for system in [*systems[s:], *systems[:s]]]
    return out


def rates(capacity_rps: float, levels: dict[str, float]) -> dict[str, float]:
    """Offered rate per level: a fraction of the capacity, rounded to 0.1 req/s (at least 0.5)."""
    if not capacity_rps > 0:
        raise ValueError(f"capacity must be > 0, got {capacity_rps}")
    return {name: max(0.5, round(capacity_rps * f, 1)) for name, f in levels.items()}


def send_offsets(rate: float, warmup_s: float, duration_s: float) -> tuple[np.ndarray, int]:
    """Constant-rate send times (s from the block's start) and how many of them are warm-up."""
    if not rate > 0 or warmup_s < 0 or not duration_s > 0:
        raise ValueError(f"bad schedule: rate {rate}, warmup {warmup_s}, duration {duration_s}")
    return np.arange(round((warmup_s + duration_s) * rate)) / rate, round(warmup_s * rate)


def summarise(blocks: Sequence[dict[str, Any]], slo_ms: float) -> dict[str, Any]:
    """One system's figures at one rate from its blocks (each: latency_ms, status, span_s, cpu_s, sent_total).

    Latency percentiles are over OK answers; ``slo_attainment`` = OK within the SLO / sent; ``lost`` =
    no answer within the client timeout; every other status is counted under ``errors``.
    """
    lat = np.asarray([v for b in blocks for v in b["latency_ms"]], dtype=float)
    st = np.asarray([v for b in blocks for v in b["status"]], dtype=object)
    span = sum(b["span_s"] for b in blocks)
    sent = len(st)
    ok = st == "ok"
    good = int((ok & (lat <= slo_ms)).sum())
    bad = st[~ok & (st != "lost")]
    kinds, counts = np.unique(bad.astype(str), return_counts=True) if bad.size else ([], [])
    cpu = sum(b["cpu_s"] for b in blocks)
    sent_total = sum(b["sent_total"] for b in blocks)

    def pct(p: float) -> float | None:
        return round(float(np.percentile(lat[ok], p)), 3) if ok.any() else None

    return {"sent": sent, "ok": int(ok.sum()), "lost": int((st == "lost").sum()),
            "errors": {str(k): int(c) for k, c in zip(kinds, counts)},
            "throughput_rps": round(int(ok.sum()) / span, 2) if span else None,
            "goodput_rps": round(good / span, 2) if span else None,
            "p50_ms": pct(50), "p99_ms": pct(99),
            "slo_attainment": round(good / sent, 4) if sent else None,
            "cpu_s": round(cpu, 3), "cpu_ms_per_request": round(cpu * 1e3 / sent_total, 3) if sent_total else None,
            "driver_cpu_s": round(sum(b.get("driver_cpu_s", 0.0) for b in blocks), 3),
            "driver_lag_p99_ms": round(float(np.percentile([v for b in blocks for v in b.get("lag_ms", [0.0])], 99)), 3)}


def _ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 3) if num is not None and den else None


def assemble(results: dict[str, dict[str, dict[str, dict[str, Any]]]], ours: str = "gpuprims") -> dict[str, Any]:
    """The flat summary (CONTRIBUTING.md, Benchmarks: `peer`) from results[app][level][system] = summarise(...).

    Keys ``<app>.<level>.<system>.<figure>``, and per peer ``<app>.<level>.<peer>.<figure>_ratio`` with
    >= 1 meaning `ours` is ahead: throughput, goodput and attainment as ours/peer; p50, p99 and CPU
    per request as peer/ours. gpuprims over its other transports (``gpuprims-http``, ``gpuprims-grpc``)
    are rows of their own and get ratios against every peer too, ``<figure>_ratio_<transport>``
    (e.g. ``p50_ratio_http``); gpuprims' rows are never compared with each other.
    """
    out: dict[str, Any] = {}
    figures = ("throughput_rps", "goodput_rps", "p50_ms", "p99_ms", "slo_attainment", "lost", "cpu_s",
               "cpu_ms_per_request")
    for app, levels in results.items():
        for level, systems in levels.items():
            if ours not in systems:
                raise ValueError(f"{app}/{level}: no result for {ours}")
            for system, st in systems.items():
                for f in figures:
                    out[f"{app}.{level}.{system}.{f}"] = st.get(f)
            for us in [ours, *(s for s in OURS if s in systems and s != ours)]:
                mine = systems[us]
                tail = "" if us == ours else "_" + us.removeprefix("gpuprims-")
                for peer, st in systems.items():
                    if peer == ours or peer in OURS:
                        continue
                    p = f"{app}.{level}.{peer}."
                    out[p + "throughput_ratio" + tail] = _ratio(mine["throughput_rps"], st["throughput_rps"])
                    out[p + "goodput_ratio" + tail] = _ratio(mine["goodput_rps"], st["goodput_rps"])
                    out[p + "slo_attainment_ratio" + tail] = _ratio(mine["slo_attainment"], st["slo_attainment"])
                    out[p + "p50_ratio" + tail] = _ratio(st["p50_ms"], mine["p50_ms"])
                    out[p + "p99_ratio" + tail] = _ratio(st["p99_ms"], mine["p99_ms"])
                    out[p + "cpu_ratio" + tail] = _ratio(st["cpu_ms_per_request"], mine["cpu_ms_per_request"])
    return out


@dataclass
class CpuMeter:
    """CPU seconds (user + system) of a process tree: the root and every descendant seen so far.

    A process that exits keeps the CPU of its last sample (sample often: what it used after that is
    not counted); children's CPU is taken from each child itself, never also from its parent's
    ``children_*`` times, so nothing counts twice. `proc` lets tests hand in a fake psutil.
    """

    root: int
    proc: Any = psutil
    seen: dict[tuple[int, float], float] = field(default_factory=dict)
    names: dict[tuple[int, float], tuple[str, int | None]] = field(default_factory=dict)

    def _tree(self) -> list[Any]:
        try:
            root = self.proc.Process(self.root)
            return [root, *root.children(recursive=True)]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return []

    def sample(self) -> float:
        for p in self._tree():
            try:
                with p.oneshot():
                    key = (p.pid, p.create_time())
                    t = p.cpu_times()
                    self.seen[key] = float(t.user + t.system)
                    if key not in self.names:
                        self.names[key] = (p.name(), p.nice())
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return self.total()

    def total(self) -> float:
        return float(sum(list(self.seen.values())))  # (a copy: the Sampler thread may be adding to it)

    def processes(self) -> list[dict[str, Any]]:
        """Every process counted: pid, name, niceness when first seen, CPU seconds at its last sample."""
        return [{"pid": k[0], "name": self.names.get(k, ("?", None))[0], "nice": self.names.get(k, ("?", None))[1],
                 "cpu_s": round(v, 3)} for k, v in sorted(self.seen.items(), key=lambda kv: -kv[1])]


def wait_quiet(meters: Sequence[CpuMeter], *, level: float = QUIET_CPU, max_s: float = QUIET_MAX_S,
               step_s: float = 0.5, sleep: Any = time.sleep) -> float:
    """Wait until every tree used less than `level` cores over the last `step_s` (at most `max_s`);
    returns the seconds waited (counted in steps, so a fake `sleep` can test it)."""
    if not level > 0 or max_s < 0 or not step_s > 0:
        raise ValueError(f"bad wait: level {level}, max_s {max_s}, step_s {step_s}")
    prev = [m.sample() for m in meters]
    waited = 0.0
    while waited < max_s:
        sleep(step_s)
        waited += step_s
        cur = [m.sample() for m in meters]
        if all((c - p) / step_s < level for c, p in zip(cur, prev)):
            break
        prev = cur
    return waited


IDLE_WINDOW_S = 5.0


@contextlib.contextmanager
def paused(meters: Sequence[CpuMeter]) -> Iterator[list[int]]:
    """Stop (SIGSTOP) every process of these trees for the block, and continue them afterwards whatever
    happens: the measured system then has the machine alone, not beside a peer's idle loop on its core."""
    stopped: list[Any] = []
    try:
        for m in meters:
            for p in m._tree():
                try:
                    p.suspend()
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                stopped.append(p)
        yield [p.pid for p in stopped]
    finally:
        for p in reversed(stopped):
            with contextlib.suppress(psutil.Error):
                p.resume()


def idle_cpu(meters: dict[str, CpuMeter], window_s: float = IDLE_WINDOW_S,
             sleep: Any = time.sleep) -> dict[str, float]:
    """Cores each tree uses with no traffic at all, over `window_s` (what it costs a neighbour idle)."""
    before = {s: m.sample() for s, m in meters.items()}
    sleep(window_s)
    return {s: round((m.sample() - before[s]) / window_s, 4) for s, m in meters.items()}


class Sampler:
    """Samples several CpuMeters every `period_s` in a thread while running (`with Sampler(...)`)."""

    def __init__(self, meters: Sequence[CpuMeter], period_s: float = CPU_SAMPLE_S) -> None:
        self.meters, self.period_s = list(meters), period_s
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            for m in self.meters:
                m.sample()

    def __enter__(self) -> Sampler:
        for m in self.meters:
            m.sample()
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        for m in self.meters:
            m.sample()


# -- the systems ------------------------------------------------------------------------------------------
def free_port(kind: int = socket.SOCK_DGRAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def inputs(seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).random((N_INPUTS, *SHAPE), dtype=np.float32)


class SystemProc:
    """One system's root process; stopping it ends its whole tree (SIGTERM, then SIGKILL to what is left)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.log = name, log
        self._logf = log.open("w")
        self.p = subprocess.Popen(argv, env=env, stdout=self._logf, stderr=subprocess.STDOUT, cwd=ROOT,
                                  start_new_session=True)
        self.meter = CpuMeter(self.p.pid)

    def alive(self) -> bool:
        return self.p.poll() is None

    def stop(self, timeout_s: float = 60.0) -> None:
        self.meter.sample()
        tree = [p for p in self.meter._tree() if p.pid != self.p.pid]
        if self.alive():
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        _, alive = psutil.wait_procs(tree, timeout=10)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(alive, timeout=10)
        self._logf.close()


def gpuprims_config(model: str, slo_ms: float, port: int, engine: str = "eager",
                    engine_cache: Path | None = None, http_port: int = 0, grpc_port: int = 0) -> dict[str, Any]:
    """The node's config (module docstring): the one app on `engine`, the engines kept in `engine_cache`;
    the OIP front door on `http_port`/`grpc_port` where they are not 0."""
    app = sv.app(model, model, APP_ID, shape=SHAPE, slo_ms=slo_ms, gpu_pct=GPU_PCT, max_batch=MAX_BATCH,
                 max_wait_ms=MAX_WAIT_MS)
    app.update(seed=0, engine=engine)
    node: dict[str, Any] = {"backend": "cpu", "listen": {"host": "127.0.0.1", "port": port}, "pool": sv.POOL,
                            "scheduler": "spatial", "log_level": "warning", "metrics_port": 0, "http_port": http_port,
                            "grpc_port": grpc_port, "autoscale": False}
    if engine_cache is not None:
        node["engine_cache"] = str(engine_cache)
    return {"node": node, "apps": [app]}


def mlserver_venv() -> Path:
    """MLServer's environment (``GPUPRIMS_MLSERVER_VENV`` or ``.venv-mlserver``); a clear error if it is not
    there."""
    venv = Path(os.environ.get("GPUPRIMS_MLSERVER_VENV") or MLSERVER_VENV)
    if not (venv / "bin" / "mlserver").exists():
        raise SystemExit(f"the mlserver peer needs MLServer's own environment at {venv}: run scripts/setup-mlserver.sh "
                         "(or set GPUPRIMS_MLSERVER_VENV), or leave it out with --peers ray litserve")
    return venv


def mlserver_repository(root: Path, model: str, grpc_port: int, http_port: int, cores: list[int], threads: int,
                        engine: str = "eager", engine_cache: Path | None = None) -> Path:
    """MLServer's repository under `root` (bench.peer_mlserver says which defaults change and why): the server's
    ``settings.json`` and the model's ``<model>/model-settings.json``, with the node's batching, share and
    engine; `root`."""
    settings = {"debug": False, "host": "127.0.0.1", "http_port": http_port, "grpc_port": grpc_port,
                "metrics_endpoint": None, "parallel_workers": 1, "load_models_at_startup": True}
    model_settings = {
        "name": model, "implementation": "bench.peer_mlserver.ZooModel",
        "max_batch_size": MAX_BATCH, "max_batch_time": MAX_WAIT_MS / 1e3,
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, *SHAPE]}],
        "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, -1]}],
        "parameters": {"extra": {"model": model, "shape": list(SHAPE), "cores": list(cores), "threads": threads,
                                 "max_batch": MAX_BATCH, "engine": engine,
                                 "engine_cache": None if engine_cache is None else str(engine_cache)}},
    }
    (root / model).mkdir(parents=True, exist_ok=True)
    (root / "settings.json").write_text(json.dumps(settings, indent=1))
    (root / model / "model-settings.json").write_text(json.dumps(model_settings, indent=1))
    return root


def litserve_argv(model: str, port: int, cores: list[int], threads: int, engine: str = "eager",
                  engine_cache: Path | None = None) -> list[str]:
    """LitServe's command line (bench.peer_litserve): the same model, share, batching and engine as the node."""
    argv = [sys.executable, "-m", "bench.peer_litserve", "--port", str(port), "--model", model,
            "--shape", *map(str, SHAPE), "--cores", *map(str, cores), "--threads", str(threads),
            "--max-batch", str(MAX_BATCH), "--wait-ms", str(MAX_WAIT_MS), "--engine", engine]
    return argv + (["--engine-cache", str(engine_cache)] if engine_cache is not None else [])


def engine_latency_ms(model: str, engine: str, cache: Path, batch: int, *, cores: list[int], threads: int,
                      reps: int) -> np.ndarray:
    """Latency (ms) of `model` at `batch` on gpuprims' `engine`, in this process on `cores` with `threads`
    threads, after two warm-up runs; builds the engine into `cache` (so the systems then load it from there)."""
    import torch

    from gpuprims.engines import EngineCache, ModelSource, Target, make_engine

    with sv.pinned(cores, threads):
        eng = make_engine(engine, ModelSource(model, SHAPE, MAX_BATCH, seed=0), Target("cpu", threads=threads),
                          cache=EngineCache(cache))
        try:
            eng.prepare()
            x = torch.from_numpy(np.random.default_rng(0).random((batch, *SHAPE), dtype=np.float32))
            out = np.empty(reps)
            for _ in range(2):
                eng.run(x)
            for i in range(reps):
                t = time.perf_counter_ns()
                eng.run(x).float().cpu().numpy()
                out[i] = (time.perf_counter_ns() - t) / 1e6
        finally:
            eng.close()
    return out


def start_gpuprims(model: str, slo_ms: float, port: int, work: Path, engine: str = "eager",
                   engine_cache: Path | None = None, http_port: int = 0, grpc_port: int = 0) -> SystemProc:
    cfg = gpuprims_config(model, slo_ms, port, engine, engine_cache, http_port, grpc_port)
    path = work / "gpuprims.yaml"
    path.write_text(yaml.safe_dump(cfg))
    exe = str(Path(sys.executable).parent / "gpuprims-orchestrator")
    return SystemProc("gpuprims", [exe, "start", str(path), "--run-dir", str(work / "run")], dict(os.environ),
                      work / "gpuprims.log")


def start_ray(model: str, port: int, cores: list[int], threads: int, work: Path) -> SystemProc:
    tmp = tempfile.mkdtemp(prefix="rp", dir="/tmp")  # Ray's socket paths must stay short
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
    argv = [sys.executable, "-m", "bench.peer_ray", "--port", str(port), "--model", model,
            "--shape", *map(str, SHAPE), "--cores", *map(str, cores), "--threads", str(threads),
            "--max-batch", str(MAX_BATCH), "--wait-ms", str(MAX_WAIT_MS), "--max-ongoing", str(RAY_MAX_ONGOING),
            "--num-cpus", str(os.cpu_count() or 1), "--temp-dir", tmp]
    proc = SystemProc("ray", argv, env, work / "ray.log")
    proc.tmp = tmp  # type: ignore[attr-defined]
    return proc


def start_litserve(model: str, port: int, cores: list[int], threads: int, work: Path, engine: str = "eager",
                   engine_cache: Path | None = None) -> SystemProc:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return SystemProc("litserve", litserve_argv(model, port, cores, threads, engine, engine_cache), env,
                      work / "litserve.log")


def start_mlserver(model: str, port: int, cores: list[int], threads: int, work: Path, engine: str = "eager",
                   engine_cache: Path | None = None) -> SystemProc:
    venv = mlserver_venv()
    repo = mlserver_repository(work / "mlserver", model, port, free_port(socket.SOCK_STREAM), cores, threads, engine,
                               engine_cache)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VIRTUAL_ENV": str(venv)}
    return SystemProc("mlserver", [str(venv / "bin" / "mlserver"), "start", str(repo)], env, work / "mlserver.log")


def ask_gpuprims(port: int, x: np.ndarray) -> np.ndarray | None:
    from gpuprims.client import Client, RequestLost

    with Client(("127.0.0.1", port), timeout_s=CLIENT_TIMEOUT_S) as c:
        try:
            r = c.infer(APP_ID, x)
        except RequestLost:
            return None
    return r.output if r.ok else None


def ask_ray(port: int, x: np.ndarray) -> np.ndarray | None:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/infer", data=x.astype(np.float32).tobytes(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=CLIENT_TIMEOUT_S) as r:
            return np.frombuffer(r.read(), np.float32)
    except (urllib.error.URLError, OSError):
        return None


def litserve_body(x: np.ndarray) -> bytes:
    """LitServe's request: JSON (its request path), the raw float32 tensor in base64."""
    return json.dumps({"x": base64.b64encode(np.ascontiguousarray(x, np.float32).tobytes()).decode("ascii")}).encode()


def ask_litserve(port: int, x: np.ndarray) -> np.ndarray | None:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/predict", data=litserve_body(x), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=CLIENT_TIMEOUT_S) as r:
            return np.frombuffer(base64.b64decode(json.loads(r.read())["y"]), np.float32)
    except (urllib.error.URLError, OSError, ValueError, KeyError):
        return None


def oip_body(x: np.ndarray) -> tuple[bytes, dict[str, str]]:
    """An Open Inference Protocol request with binary tensor data (what tritonclient sends with
    ``binary_data=True``): the JSON header, then the raw float32 tensor; the output asked for in binary."""
    raw = np.ascontiguousarray(x, np.float32).tobytes()
    head = json.dumps({"inputs": [{"name": "input", "shape": [1, *x.shape], "datatype": "FP32",
                                   "parameters": {"binary_data_size": len(raw)}}],
                       "outputs": [{"name": "logits", "parameters": {"binary_data": True}}]}).encode()
    return head + raw, {"Inference-Header-Content-Length": str(len(head)),
                        "Content-Type": "application/octet-stream"}


def oip_output(body: bytes, header_length: int) -> np.ndarray:
    """The binary output of an OIP reply (the bytes after its JSON header)."""
    return np.frombuffer(body[header_length:], np.float32)


def ask_gpuprims_http(model: str, port: int, x: np.ndarray) -> np.ndarray | None:
    body, headers = oip_body(x)
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/{model}/infer", data=body, method="POST",
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=CLIENT_TIMEOUT_S) as r:
            return oip_output(r.read(), int(r.headers.get("Inference-Header-Content-Length", "0")))
    except (urllib.error.URLError, OSError, ValueError):
        return None


def ask_gpuprims_grpc(model: str, port: int, x: np.ndarray) -> np.ndarray | None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    try:
        with grpcclient.InferenceServerClient(f"127.0.0.1:{port}") as c:
            i = grpcclient.InferInput("input", [1, *x.shape], "FP32")
            i.set_data_from_numpy(np.ascontiguousarray(x[None], np.float32))
            out = c.infer(model, [i], client_timeout=CLIENT_TIMEOUT_S).as_numpy("logits")
    except InferenceServerException:
        return None
    return None if out is None else out.reshape(-1)


ASK = {"gpuprims": ask_gpuprims, "ray": ask_ray, "litserve": ask_litserve}
#: Over the Open Inference Protocol: the model's name in the path. MLServer's gRPC is asked as the node's is.
ASK_OIP = {"gpuprims-http": ask_gpuprims_http, "gpuprims-grpc": ask_gpuprims_grpc, "mlserver": ask_gpuprims_grpc}


def wait_ready(system: SystemProc, ask: Any, x: np.ndarray, timeout_s: float = READY_TIMEOUT_S) -> np.ndarray:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if not system.alive():
            raise RuntimeError(f"{system.name} exited ({system.p.returncode}); see {system.log}:\n"
                               + system.log.read_text()[-3000:])
        out = ask(x)
        if out is not None:
            return out
        time.sleep(1.0)
    raise RuntimeError(f"{system.name} not answering after {timeout_s:g} s; see {system.log}")


# -- the traffic drivers ------------------------------------------------------------------------------------
async def _drive_async(system: str, port: int, rate: float, duration_s: float, warmup_s: float,
                       timeout_s: float, model: str = "") -> dict[str, Any]:
    xs = inputs()
    offsets, n_warm = send_offsets(rate, warmup_s, duration_s)
    n = len(offsets)
    if system == "gpuprims":
        from gpuprims.client import AsyncClient, RequestLost

        client = await AsyncClient(("127.0.0.1", port), timeout_s=timeout_s).open()

        async def call(i: int) -> str:
            try:
                r = await client.infer(APP_ID, xs[i])
            except RequestLost:
                return "lost"
            return "ok" if r.ok else r.status.name

        async def close() -> None:
            client.close()
    elif system in ("gpuprims-grpc", "mlserver"):
        import tritonclient.grpc as grpcclient
        import tritonclient.grpc.aio as grpcaio
        from tritonclient.utils import InferenceServerException

        gclient = grpcaio.InferenceServerClient(f"127.0.0.1:{port}")
        grpc_inputs = []
        for x in xs:
            i = grpcclient.InferInput("input", [1, *x.shape], "FP32")
            i.set_data_from_numpy(np.ascontiguousarray(x[None], np.float32))
            grpc_inputs.append(i)

        async def call(i: int) -> str:
            t = time.monotonic()
            try:
                await gclient.infer(model, [grpc_inputs[i]], client_timeout=timeout_s)
            except InferenceServerException as e:
                code = str(e.status() or "error").removeprefix("StatusCode.")
                # the client's own deadline: no answer in time; the node's (a request it shed) comes early
                return "lost" if code == "DEADLINE_EXCEEDED" and time.monotonic() - t >= 0.99 * timeout_s \
                    else f"grpc_{code}"
            return "ok"

        async def close() -> None:
            await gclient.close()
    else:
        import aiohttp

        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                        timeout=aiohttp.ClientTimeout(total=timeout_s))
        if system == "litserve":
            url, headers = f"http://127.0.0.1:{port}/predict", {"Content-Type": "application/json"}
            bodies = [litserve_body(x) for x in xs]
        elif system == "gpuprims-http":
            url = f"http://127.0.0.1:{port}/v2/models/{model}/infer"
            pairs = [oip_body(x) for x in xs]
            bodies, headers = [b for b, _ in pairs], pairs[0][1]  # one tensor size: the same headers
        else:
            url, headers = f"http://127.0.0.1:{port}/infer", {}
            bodies = [x.tobytes() for x in xs]

        async def call(i: int) -> str:
            try:
                async with session.post(url, data=bodies[i], headers=headers) as r:
                    data = await r.read()
                    if r.status != 200:
                        return f"http_{r.status}"
                    return "ok" if len(data) > 0 else "empty"
            except (asyncio.TimeoutError, TimeoutError):
                return "lost"
            except aiohttp.ClientError as e:
                return f"conn_{type(e).__name__}"

        async def close() -> None:
            await session.close()

    loop = asyncio.get_running_loop()
    lat = np.full(n, np.nan)
    lag = np.zeros(n)
    status = [""] * n

    async def one(k: int, at: float) -> None:
        lag[k] = loop.time() - at
        t = time.perf_counter_ns()
        status[k] = await call(k % N_INPUTS)
        lat[k] = (time.perf_counter_ns() - t) / 1e6

    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = loop.time() + 0.05
    tasks = []
    for k in range(n):
        at = t0 + offsets[k]
        delay = at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(k, at)))
    await asyncio.gather(*tasks)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    await close()
    m = slice(n_warm, n)
    return {"latency_ms": lat[m].tolist(), "status": status[m], "lag_ms": (lag[m] * 1e3).tolist(),
            "span_s": duration_s, "sent_total": n,
            "driver_cpu_s": (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)}


def native_result(samples: dict[str, np.ndarray], duration_s: float, driver_cpu_s: float) -> dict[str, Any]:
    """A traffic-tool report's measured requests as a driver's block result (the keys `summarise` reads):
    answered in time -> its status (``ok`` for OK), unanswered or answered after the timeout -> ``lost``,
    never sent -> ``unsent``."""
    from gpuprims.wire import Status

    m = ~samples["warmup"] & (samples["app_id"] >= 0)
    state, status = samples["state"][m], samples["status"][m]
    answered = state == 1  # gpuprims.traffic.report: 0 none, 1 answered, 2 late
    names = {int(v): v.name for v in Status}
    sent, sched = samples["sent_ns"][m], samples["sched_ns"][m]
    # A request the sender never sent (it stops at the run's end when it has fallen that far behind)
    # is counted apart, as a failure of the driver: under errors, and against SLO attainment.
    out_status = ["unsent" if t < 0 else "lost" if not a else
                  ("ok" if int(c) == int(Status.OK) else names.get(int(c), f"status_{int(c)}"))
                  for t, a, c in zip(sent.tolist(), answered.tolist(), status.tolist())]
    lat = np.where(answered, samples["latency_ns"][m] / 1e6, np.nan)
    lag = (sent[sent >= 0] - sched[sent >= 0]).astype(np.float64)  # a request never sent has no lag
    lag = (lag - lag.min()) / 1e6 if lag.size else lag  # from the earliest: the clock offset is the run's t0
    return {"latency_ms": lat.tolist(), "status": out_status, "lag_ms": lag.tolist(), "span_s": duration_s,
            "sent_total": int(samples["app_id"].size), "driver_cpu_s": driver_cpu_s}


def _drive_native(port: int, rate: float, duration_s: float, warmup_s: float, timeout_s: float) -> dict[str, Any]:
    """gpuprims' own traffic tool (native paced sender, sendmmsg; native receiver): the same constant rate
    and client timeout as the asyncio driver, a fixed body (``inputs()[0]``: a CNN's time does not
    depend on the values), without a Python task per request."""
    from gpuprims.traffic.runner import run
    from gpuprims.traffic.stream import AppStream, Stream

    # The very schedule the asyncio driver sends (send_offsets): the same requests at the same times, so
    # both clients offer the same count in a block.
    offsets, n_warm = send_offsets(rate, warmup_s, duration_s)
    stream = AppStream(app_id=APP_ID, shape=SHAPE, dtype="float32", rate=rate, process="constant",
                       count=len(offsets) - n_warm, to=("127.0.0.1", port), body=inputs()[0])
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    report = run(Stream([stream], seed=1, warmup_s=n_warm / rate), timeout_s=timeout_s, linger_s=timeout_s)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    return native_result(report.samples, duration_s,
                         (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime))


def _driver(system: str, port: int, cmds: Any, out: Any, native: bool = False, model: str = "") -> None:
    """Child process: serves ("run", rate, duration_s, warmup_s, timeout_s) until ("stop",); ``native``:
    gpuprims through its traffic tool instead of the asyncio client."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    while True:
        cmd = cmds.get()
        if cmd[0] == "stop":
            return
        _, rate, duration_s, warmup_s, timeout_s = cmd
        try:
            if native and system == "gpuprims":
                out.put(_drive_native(port, rate, duration_s, warmup_s, timeout_s))
            else:
                out.put(asyncio.run(_drive_async(system, port, rate, duration_s, warmup_s, timeout_s, model)))
        except BaseException as e:
            out.put({"error": repr(e)})


@contextlib.contextmanager
def drivers(ports: dict[str, int], native: bool = False, model: str = "") -> Iterator[dict[str, tuple[Any, Any, Any]]]:
    ctx = mp.get_context("spawn")
    out = {}
    for system, port in ports.items():
        cmds, res = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=_driver, args=(system, port, cmds, res, native, model), daemon=True,
                        name=f"driver-{system}")
        p.start()
        out[system] = (p, cmds, res)
    try:
        yield out
    finally:
        for _p, cmds, _ in out.values():
            cmds.put(("stop",))
        for p, _, _ in out.values():
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()


def run_block(driver: tuple[Any, Any, Any], rate: float, duration_s: float, warmup_s: float,
              timeout_s: float) -> dict[str, Any]:
    p, cmds, res = driver
    cmds.put(("run", rate, duration_s, warmup_s, timeout_s))
    end = time.monotonic() + warmup_s + duration_s + timeout_s + 60
    while time.monotonic() < end:
        try:
            r = res.get(timeout=1.0)
        except queue.Empty:
            if not p.is_alive():
                raise RuntimeError(f"driver exited ({p.exitcode}) without a result") from None
            continue
        if "error" in r:
            raise RuntimeError(f"driver failed: {r['error']}")
        return r
    raise RuntimeError("no result from the driver in time")


# -- the run ------------------------------------------------------------------------------------------------
def renice_tree(meter: CpuMeter, nice: int) -> list[dict[str, Any]]:
    """Set every process of the tree that runs above niceness 0 (Ray's workers) to `nice`; what changed."""
    changed = []
    for p in meter._tree():
        try:
            old = p.nice()
            if old > 0 and old != nice:
                p.nice(nice)
                changed.append({"pid": p.pid, "name": p.name(), "nice_before": old, "nice_after": nice})
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return changed


def run_app(model: str, slo_ms: float, duration_s: float, blocks: int, warmup_s: float,
            fixed_rates: list[float] | None, ray_nice: int | None = None,
            systems: Sequence[str] = SYSTEMS, engine: str = "eager", native: bool = False,
            pause: bool = False) -> dict[str, Any]:
    import torch

    from apps.zoo import load_model

    share = plan_cpu_shares([(model, GPU_PCT)])[model]
    cores, threads = list(share.cores), share.threads
    work = Path(tempfile.mkdtemp(prefix=f"peer-{model}-"))
    cache = work / "engines" if engine != "eager" else None  # filled here, loaded by the node and LitServe
    if cache is None:
        b8 = sv.torch_latency_ms(model, SHAPE, MAX_BATCH, cores=cores, threads=threads, reps=10)
    else:
        b8 = engine_latency_ms(model, engine, cache, MAX_BATCH, cores=cores, threads=threads, reps=10)
    capacity = MAX_BATCH * 1e3 / float(np.median(b8))
    level_rates = (dict(zip(LEVELS, fixed_rates)) if fixed_rates else rates(capacity, LEVELS))
    print(f"{model} on {engine}: capacity ~{capacity:.1f} req/s on cores {cores} ({threads} threads); "
          f"rates {level_rates}",
          flush=True)
    xs = inputs()
    with torch.inference_mode():
        ref = load_model(model, seed=0, input_shape=SHAPE).eval()(torch.from_numpy(xs[:1])).numpy()[0]

    ports = {s: free_port(socket.SOCK_DGRAM if s == "gpuprims" else socket.SOCK_STREAM) for s in systems}
    procs: dict[str, SystemProc] = {}
    try:
        procs["gpuprims"] = start_gpuprims(model, slo_ms, ports["gpuprims"], work, engine, cache,
                                           ports.get("gpuprims-http", 0), ports.get("gpuprims-grpc", 0))
        for s in systems:
            if s in OURS:  # one node, several ways in: the same process tree, the same CPU meter
                procs[s] = procs["gpuprims"]
        if "ray" in systems:
            procs["ray"] = start_ray(model, ports["ray"], cores, threads, work)
        if "litserve" in systems:
            procs["litserve"] = start_litserve(model, ports["litserve"], cores, threads, work, engine, cache)
        if "mlserver" in systems:
            procs["mlserver"] = start_mlserver(model, ports["mlserver"], cores, threads, work, engine, cache)
        t0 = time.monotonic()
        check = {}
        for name in systems:
            ask = ASK[name] if name in ASK else partial(ASK_OIP[name], model)
            got = wait_ready(procs[name], lambda x, a=ask, p=ports[name]: a(p, x), xs[0])
            check[name] = {"max_abs_diff_vs_torch": float(np.max(np.abs(got - ref))) if got.shape == ref.shape
                           else None, "ready_s": round(time.monotonic() - t0, 1)}
            print(f"  {name} ready after {check[name]['ready_s']} s, logits vs torch: {check[name]}", flush=True)
        reniced = renice_tree(procs["ray"].meter, ray_nice) if ray_nice is not None and "ray" in procs else []
        if reniced:
            print(f"  reniced Ray's processes: {reniced}", flush=True)
        raw: dict[str, dict[str, list[dict[str, Any]]]] = {lv: {s: [] for s in systems} for lv in LEVELS}
        idle: dict[str, list[float]] = {s: [] for s in systems}
        trees = {s: procs[s].meter for s in systems if s not in OURS or s == "gpuprims"}  # one per process tree
        meters = list(trees.values())
        idle_alone = idle_cpu(trees) if pause else None
        with drivers(ports, native, model) as drv, Sampler(meters):
            for level, system, k in schedule(list(LEVELS), systems, blocks):
                rate = level_rates[level]
                quiet_wait_s = wait_quiet(meters)
                before = {s: procs[s].meter.sample() for s in systems}
                tb = time.monotonic()
                load0 = os.getloadavg()[0]
                mine = procs[system].meter
                others = [m for m in meters if m is not mine] if pause else []
                with paused(others):
                    r = run_block(drv[system], rate, duration_s, warmup_s, CLIENT_TIMEOUT_S)
                wall = time.monotonic() - tb
                after = {s: procs[s].meter.sample() for s in systems}
                r.update(cpu_s=after[system] - before[system], block=k, rate_rps=rate, wall_s=round(wall, 3),
                         quiet_wait_s=quiet_wait_s,
                         load1_before=round(load0, 2), load1_after=round(os.getloadavg()[0], 2))
                for other in trees:
                    if trees[other] is not mine:
                        r[f"idle_cpu_s_{other}"] = after[other] - before[other]
                        idle[other].append((after[other] - before[other]) / wall)
                raw[level][system].append(r)
                st = summarise([r], slo_ms)
                print(f"  {level:>8} {rate:7.1f} req/s {system:>8} block {k}: ok {st['ok']}/{st['sent']}, "
                      f"att {st['slo_attainment']}, p50 {st['p50_ms']} p99 {st['p99_ms']} ms, lost {st['lost']}, "
                      f"cpu {r['cpu_s']:.2f} s, load {r['load1_before']}", flush=True)
        results = {lv: {s: summarise(raw[lv][s], slo_ms) for s in systems} for lv in LEVELS}
        for lv in LEVELS:
            for s in systems:
                results[lv][s]["rate_rps"] = level_rates[lv]
        return {"results": results, "raw": raw, "check": check, "capacity_rps": round(capacity, 1),
                "model_b8_ms": b8.tolist(), "cores": cores, "threads": threads, "rates": level_rates,
                "idle_cpu_s_per_s": idle_alone if idle_alone is not None else
                {s: round(float(np.mean(v)), 4) if v else None for s, v in idle.items()},
                "processes": {s: m.processes() for s, m in trees.items()}, "reniced": reniced,
                "systems": list(systems)}
    finally:
        for p in {id(p): p for p in procs.values()}.values():  # the node once, whatever its ways in
            p.stop()
            if getattr(p, "tmp", None):
                shutil.rmtree(p.tmp, ignore_errors=True)  # type: ignore[attr-defined]
        shutil.rmtree(work, ignore_errors=True)


CAVEATS = (
    "Fairness caveats. Transport: gpuprims is driven over its own UDP wire (48 datagrams a request, "
    "reassembled by the native ingest), Ray Serve over HTTP/1.1 (aiohttp client, Serve's proxy actor, then "
    "a Ray RPC to the replica): the transport is part of what each system is, so it is part of what is "
    "measured, but an HTTP front door on gpuprims (bench/oip) costs more than its UDP path. Client: one "
    "asyncio driver process per system, open loop, the same inputs in the same order, the same client "
    "timeout (requests not answered in time count as lost); the drivers' own CPU is in no system's tree "
    "(reported as driver_cpu_s). Pinning: every model process is confined to the same core with the same "
    "torch threads (gpuprims' planner decides it; Ray's replica and LitServe's worker apply the same "
    "CpuShare); no system's other processes (node ingest and control loop; Ray's proxy, GCS, raylet, "
    "agents; LitServe's API server) are pinned. All systems stay up for the whole run, so each one's idle "
    "background CPU falls on the others' blocks "
    "(idle_cpu_s_per_s). Ray: started with its defaults except no dashboard (which favours Ray's CPU "
    "figure) and max_ongoing_requests raised to 2 x max batch (the default 5 would cap a batch below 8); "
    "its queue in front of the replica is unbounded (max_queued_requests -1), so above capacity requests "
    "wait until the client gives up, where gpuprims answers DEADLINE_MISSED at once; Ray's worker "
    "processes run at the niceness listed under samples.<app>.processes (as Ray sets it, not changed "
    "here). LitServe 0.2.19: its defaults except fast_queue (ZeroMQ between its API server and its worker, "
    "which its documentation advises above 100 requests/s); its request path is JSON, so its requests "
    "carry the tensor in base64 (about a third larger, plus encoding on both sides: part of what LitServe "
    "is, as HTTP is part of Ray Serve); no queue bound is set, and its own request timeout (30 s by "
    "default) is longer than the client's, so above capacity it too keeps requests until the client gives "
    "up. MLServer 1.7.1 (its own environment): its defaults except the ports, debug off and no metrics "
    "server (the node runs without one too), with adaptive batching at the node's batch size and wait (off "
    "by default in MLServer); driven over gRPC with raw tensor contents, as gpuprims-grpc; no queue bound "
    "is set. gpuprims sheds late work by design, so compare goodput and attainment, not raw throughput, "
    "above capacity. Shared 2-core machine: other sessions' load is recorded per block (load1_*) and "
    "falls on every system alike through the interleaving, but moves every absolute figure. Before each "
    "block the bench waits (up to 45 s, quiet_wait_s per block) until no system's tree uses half a core: "
    "Ray and LitServe go on computing answers their clients gave up on after an overload block, on the "
    "core every system's model shares, and that work would otherwise fall on the next block.")


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    apps = list(res)
    fig, axes = plt.subplots(len(apps), 4, figsize=(16, 3.6 * len(apps)), squeeze=False)
    colors = {"gpuprims": "tab:blue", "ray": "tab:orange", "litserve": "tab:green", "mlserver": "tab:red"}
    for i, app in enumerate(apps):
        results = res[app]["results"]
        levels = list(results)
        x = np.arange(len(levels))
        for j, (fig_key, label, log) in enumerate((("goodput_rps", "goodput (OK within SLO, req/s)", False),
                                                   ("slo_attainment", "SLO attainment", False),
                                                   ("p99_ms", "p50 (hatched) / p99 latency of OK (ms)", True),
                                                   ("cpu_ms_per_request", "CPU ms per request (process tree)", False))):
            ax = axes[i][j]
            systems = res[app].get("systems", list(SYSTEMS))
            width = 0.8 / len(systems)
            for k, s in enumerate(systems):
                at = x + (k - (len(systems) - 1) / 2) * width
                vals = [results[lv][s].get(fig_key) or 0 for lv in levels]
                ax.bar(at, vals, width, label=s, color=colors.get(s))
                if fig_key == "p99_ms":
                    p50 = [results[lv][s].get("p50_ms") or 0 for lv in levels]
                    ax.bar(at, p50, width, color="none", edgecolor="k", hatch="//")
            ax.set_xticks(x, [f"{lv}\n{results[lv][systems[0]]['rate_rps']:g}/s" for lv in levels])
            ax.set_title(f"{app}: {label}", fontsize=9)
            if log:
                ax.set_yscale("log")
            ax.grid(True, axis="y", alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one app, short blocks (a smoke test, not a result)")
    ap.add_argument("--apps", nargs="+", default=list(APPS), choices=list(APPS))
    ap.add_argument("--duration", type=float, default=8.0, help="measured seconds per block")
    ap.add_argument("--blocks", type=int, default=2, help="blocks per system and rate (order alternates)")
    ap.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds at the start of each block")
    ap.add_argument("--rates", type=float, nargs=3, default=None, help="light, medium, overload req/s "
                    "(default: 0.25, 0.6, 1.5 x the measured batch-8 capacity)")
    ap.add_argument("--ray-nice", type=int, default=None, help="renice Ray's worker processes (Ray starts them "
                    "at 15) to this niceness once Serve is up; default: leave Ray's own setting")
    ap.add_argument("--peers", nargs="+", default=list(PEERS), choices=list(PEERS),
                    help="the peer systems to run beside gpuprims (default: all)")
    ap.add_argument("--driver", default="asyncio", choices=["asyncio", "native"],
                    help="gpuprims' client: the asyncio one (as the peers') or its native traffic tool, which "
                         "drives rates a Python client cannot on two cores")
    ap.add_argument("--pause-others", action="store_true",
                    help="stop (SIGSTOP) the other systems' processes during each block, so that each is measured "
                         "alone on the machine (idle CPU is then measured over a window before the blocks)")
    ap.add_argument("--engine", default="eager", choices=["eager", "onnxruntime"],
                    help="gpuprims', LitServe's and MLServer's model runner (the same engine in each; Ray stays eager)")
    ap.add_argument("--transports", nargs="+", default=["udp"], choices=list(TRANSPORTS),
                    help="ways into gpuprims, each a row of its own: its UDP wire (always), the OIP front door's "
                         "HTTP (aiohttp, binary tensor data, as the peers' client) and gRPC (tritonclient.grpc.aio)")
    args = ap.parse_args()
    extra = [TRANSPORTS[t] for t in dict.fromkeys(args.transports) if t != "udp"]
    systems = ("gpuprims", *extra, *args.peers)
    apps = args.apps[:1] if args.quick else args.apps
    duration = 3.0 if args.quick else args.duration
    blocks = 1 if args.quick else args.blocks
    load_before = os.getloadavg()
    res = {app: run_app(app, APPS[app]["slo_ms"], duration, blocks, args.warmup, args.rates, args.ray_nice, systems,
                        args.engine, args.driver == "native", args.pause_others) for app in apps}
    summary = assemble({app: r["results"] for app, r in res.items()})
    summary.update(systems=list(systems), ray_version=_version("ray"), litserve_version=_version("litserve"), input_shape="x".join(map(str, SHAPE)),
                   gpu_pct=GPU_PCT, max_batch=MAX_BATCH, max_wait_ms=MAX_WAIT_MS, client_timeout_s=CLIENT_TIMEOUT_S,
                   block_s=duration, blocks=blocks, engine=args.engine, gpuprims_driver=args.driver,
                   pause_others=args.pause_others, transports=["udp", *(t for t in args.transports if t != "udp")],
                   litserve_engine=args.engine if "litserve" in systems else None,
                   mlserver_version=mlserver_version() if "mlserver" in systems else None,
                   mlserver_engine=args.engine if "mlserver" in systems else None,
                   ray_engine="eager" if "ray" in systems else None)
    for app, r in res.items():
        summary[f"{app}.slo_ms"] = APPS[app]["slo_ms"]
        summary[f"{app}.capacity_rps"] = r["capacity_rps"]
        for s, c in r["check"].items():
            summary[f"{app}.{s}.logits_max_abs_diff_vs_torch"] = c["max_abs_diff_vs_torch"]
        if "ray" in r["processes"]:
            workers = [p["nice"] for p in r["processes"]["ray"] if str(p["name"]).startswith("ray::")]
            summary[f"{app}.ray.worker_nice_during_run"] = sorted(set(workers))
        for s, v in r["idle_cpu_s_per_s"].items():
            summary[f"{app}.{s}.idle_cpu_s_per_s"] = v
    samples = {app: {k: v for k, v in r.items() if k != "results"} | {"results": r["results"]} for app, r in res.items()}
    notes = CAVEATS
    if args.driver == "native":
        notes += (" DRIVER: gpuprims is driven by its own traffic tool (native paced sender and receiver, one fixed "
                  "input; gpuprims_driver), the peers by the asyncio HTTP driver as above: a Python client cannot "
                  "offer MobileNetV2's overload rate on two cores beside the server, and what is compared is each "
                  "server with the client its users would run.")
    if extra:
        notes += (" TRANSPORTS: gpuprims-http and gpuprims-grpc are the same node as gpuprims, reached through its "
                  "OIP front door (HTTP: the peers' aiohttp client with binary tensor data; gRPC: "
                  "tritonclient.grpc.aio); their CPU is the node's tree during their blocks, front door included.")
    if args.pause_others:
        notes += (" PAUSED: during each block every other system's processes are stopped (SIGSTOP, continued "
                  "after the block), so each system is measured alone on the machine instead of beside a peer's "
                  "idle loop on its core; idle_cpu_s_per_s is then each tree's CPU over a 5 s window with no "
                  "traffic before the blocks.")
    path = write_result("peer", "cpu", summary, samples, notes=notes, large_samples=True,
                        load_avg_before=load_before, name=("peer-quick" if args.quick else "peer")
                        + ("" if args.engine == "eager" else f"-{args.engine}")
                        + ("" if set(args.peers) == set(PEERS) else "-" + "-".join(args.peers))
                        + ("" if args.quick or set(apps) == set(APPS) else "-" + "-".join(apps))
                        + ("" if args.driver == "asyncio" else f"-{args.driver}")
                        + ("-paused" if args.pause_others else "")
                        + "".join(f"-{t}" for t in dict.fromkeys(args.transports) if t != "udp")
                        + ("" if args.ray_nice is None else f"-ray-nice{args.ray_nice}"))
    plot(res, path.with_suffix(".png"))
    print(path)
    for k, v in summary.items():
        if "ratio" in k or k.endswith(("slo_attainment", "p50_ms", "p99_ms", "cpu_ms_per_request")):
            print(f"{k:>55}: {v}")


def mlserver_version() -> str | None:
    """MLServer's version, asked of its own environment (it is not importable here)."""
    python = mlserver_venv() / "bin" / "python"
    r = subprocess.run([str(python), "-c", "from importlib.metadata import version; print(version('mlserver'))"],
                       capture_output=True, text=True, timeout=60)
    return r.stdout.strip() or None if r.returncode == 0 else None


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
