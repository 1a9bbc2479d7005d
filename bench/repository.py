"""bench/repository: the models of a Triton model repository through the node, each beside its engine alone
(issue 41, "Speed").

    python -m bench.repository [--quick] [--repository DIR] [--models NAME ...] [--name STEM] [--out-dir DIR]

Without ``--repository`` the example repository (examples/model_repository.py: ``mixed``, ``ocr``,
``scripted``, ``exported``, ``noconfig``, ``detector``) is built into a private temporary directory.
Each model is served **alone** by a node of its own (CPU backend, in this process as bench/e2e's, on
loopback): ``node.model_repository`` is the whole repository and ``model_control_mode: explicit`` loads
the one model (``load_models: [NAME]``), so every model gets the share its ``config.pbtxt`` gives it
(``noconfig``, which names none, is ``auto``: alone on the node that is every core), its batching
(``max_batch_size``, ``dynamic_batching``) and its SLO; ``autoscale`` is off so the share stays put. A
model the node refuses or cannot start gets a row saying why (the engine alone is still measured).

Per model:

1. **Start, cold and cached** (``start_cold_s``, ``start_cached_s``): the wall time of ``Node.start()``,
   which returns once the model's instance is READY (its process up, its engine prepared and warmed up),
   first with ``node.engine_cache`` a fresh empty directory, then again, a second node on the same
   directory. Beside each, the engine's own ``build_ms``/``load_ms``/``cache_hit`` as the instance's status
   reports them. The second node serves the rest of the model's measurement, once its shadow is ready
   (a process starting beside the one measured would take its core).
2. **The engine alone** (``engine_rate_rps``): gpuprims' file engine of the model's kind
   (``gpuprims.engines.files.make_file_engine``, as the instance makes it) in this process, made and run
   on the instance's cores with its thread count (bench/serving's ``pinned``, as bench/engines_node pins
   its model-only runs), ``FileEngine.run`` back to back on a batch of the model's ``max_batch_size`` (1
   for a model without batching) of the same seeded requests the client sends:
   ``engine_rate_rps = max_batch / median run time``. Two blocks, before and after the node's trials.
3. **The node's highest rate in SLO** (``node_rate_rps``): open-loop traffic (constant rate by default,
   ``--process poisson``) from ``gpuprims.client.Client`` (each request a dict of named arrays, the
   multi-tensor body) in a driver process of its own on the cores the instance does not hold (every core
   when it holds them all), at rising rates: bench/engines_node's ``RateSearch`` (doubling, or halving, until
   a held rate and a missed one bracket the answer, then bisection to 10 %), each trial a warm-up and then
   at least ``--trial-s``. A trial holds when at least 99 % of its measured requests were answered OK
   within the SLO, none was lost and every request sent was answered exactly once (engines_node's
   ``judge``). ``node_rate_rps`` is the highest held trial's achieved rate;
   ``node_over_engine_ratio = node_rate_rps / engine_rate_rps`` (the issue's goal: >= 0.9).
4. **Mixed shapes** (``mixed_shape_rate_rps``), for a model with a dynamic input dimension and batching
   (the example's ``ocr``): the same search with requests of ``--mixed-widths`` (three by default)
   interleaved, each dynamic dimension that width; the node batches only requests of one shape. Beside
   it the single-shape rate and ``engine_mixed_rate_rps``, the engine alone on full batches of an equal mix
   of the widths (one over the mean of one over each width's rate).

**What limits the figures.** The example's models are small (tens of microseconds a batch on one core),
and the client is Python: ``Client.submit`` encodes each request and sends its datagrams one by one, a
few thousand requests a second at most on the core it shares with the node's ingest and control loop.
A trial whose achieved rate is more than 2 % below its target, or whose sends lagged their schedule by
more than a tenth of the SLO at p99, is marked ``generator_limited`` (engines_node's rule) and stops the
search going up: a model's ``generator_limited`` then says its ``node_rate_rps`` is a floor set by the
client, not the node's capacity, and so is ``node_over_engine_ratio``.

Writes bench/results/<machine>/repository.json (BENCH.md; the raw samples, per trial every request's
latency, status and send lag, in repository.samples.json). It reports; it asserts no speed. ``--quick``
(the ``ocr`` model, two short trials per search) is a smoke test of the script, not a result.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench import serving as sv
from bench.common import ROOT, load_note, write_result
from bench.engines_node import ATTAINMENT, RateSearch, generator_limited, judge
from gpuprims.client import Client, RequestLost
from gpuprims.cpushare import available_cores, plan_cpu_shares
from gpuprims.engines import EngineCache, Target
from gpuprims.engines.files import make_file_engine
from gpuprims.modelrepo import ModelConfig, RepositoryError, RepositoryModel, scan
from gpuprims.modelrepo import load_model as load_repository_model
from gpuprims.tensors import DataType, ModelSignature
from orchestrator.config.schema import ConfigError, NodeConfig, parse_config
from orchestrator.node.node import Node, StartError

EXAMPLES = ROOT / "examples"
#: The issue's goal for ``node_over_engine_ratio`` (reported beside the figures, never asserted).
GOAL_RATIO = 0.9
#: The size of every dynamic (-1) input dimension of a single-shape request, and the mixed-shape widths.
WIDTH = 64
MIXED_WIDTHS = (32, 64, 128)
#: Distinct seeded requests per shape, sent in turn (one repeated body would let a cache flatter the model).
BODIES = 8
#: The most requests a second the search starts at: what one Python client can be asked to send.
MAX_RATE_RPS = 4000.0
#: Where a search starts (at most; half the engine alone's rate when that is lower): low enough that the
#: node holds it, so the search doubles up to the bracket rather than spending its trials halving down from
#: overload (the example's models run in a fraction of a millisecond alone, far above what the node holds).
START_RPS = 200.0
#: The engine alone: runs per batch shape in a block (fewer for a slow model: at least 5, or this many seconds).
ENGINE_REPS = 200
ENGINE_BUDGET_S = 1.0
#: How long to wait for the app's shadow to be ready before the measurement starts.
SETTLE_S = 90.0
#: Integer inputs are drawn from 0..INT_HIGH-1: valid ids and indices for any model that gathers with them.
INT_HIGH = 4


# -- requests (pure) ----------------------------------------------------------------------------------------
def dynamic_model(signature: ModelSignature) -> bool:
    """True when the model batches and some input has a dynamic (-1) dimension: requests of several shapes
    then form separate batches, which the mixed-shape search measures."""
    return signature.batched and any(-1 in s.dims for s in signature.inputs)


def request(signature: ModelSignature, width: int, seed: int) -> dict[str, np.ndarray]:
    """One request of the model (no batch dimension: the client sends requests, the node batches them):
    every required input of its datatype, each dynamic dimension ``width`` long. Floating inputs are
    standard normal, integers 0..INT_HIGH-1, booleans fair coins, all from ``seed``. BYTES and BF16 inputs
    are refused with ValueError naming the tensor (the client sends neither as a plain array)."""
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for spec in signature.inputs:
        if spec.optional:
            continue
        if spec.datatype in (DataType.BYTES, DataType.BF16):
            raise ValueError(f"input {spec.name!r} is {spec.datatype.value}: this bench sends numeric arrays only")
        shape = tuple(width if d == -1 else int(d) for d in spec.dims)
        dtype = spec.datatype.numpy
        if spec.datatype is DataType.BOOL:
            arr = rng.integers(0, 2, size=shape).astype(bool)
        elif np.issubdtype(dtype, np.integer):
            arr = rng.integers(0, INT_HIGH, size=shape).astype(dtype)
        else:
            arr = rng.standard_normal(shape).astype(dtype)
        out[spec.name] = arr
    return out


def requests_for(signature: ModelSignature, widths: Sequence[int], count: int = BODIES) -> tuple[list[dict[str, np.ndarray]],
                                                                                               list[int]]:
    """``count`` seeded requests of each width, interleaved (width 0, width 1, ..., width 0, ...), and the
    width of each: what a trial sends in turn."""
    if not widths or count < 1:
        raise ValueError(f"need at least one width and one request each, got widths {list(widths)}, count {count}")
    bodies, of = [], []
    for k in range(count):
        for w in widths:
            bodies.append(request(signature, w, seed=1000 * w + k))
            of.append(int(w))
    return bodies, of


def engine_batch(signature: ModelSignature, bodies: Sequence[Mapping[str, np.ndarray]],
                 rows: int | None = None) -> dict[str, np.ndarray]:
    """What the engine alone runs: ``rows`` (default ``max_batch_size``) of the requests stacked (cycled
    when fewer), or the first request as it is for a model without batching."""
    if not bodies:
        raise ValueError("no requests to batch")
    if not signature.batched:
        return dict(bodies[0])
    n = signature.max_batch_size if rows is None else rows
    if not 1 <= n <= signature.max_batch_size:
        raise ValueError(f"a batch of {n} rows: the model takes 1..{signature.max_batch_size}")
    picked = [bodies[i % len(bodies)] for i in range(n)]
    return {name: np.stack([r[name] for r in picked]) for name in picked[0]}


def batch_key(batch: int, width: int | None = None) -> str:
    """The engine-alone key of a batch shape: ``b4``, or ``b4@w32`` for one width of the mixed shapes."""
    return f"b{batch}" if width is None else f"b{batch}@w{width}"


# -- a trial's figures (pure) -------------------------------------------------------------------------------
def trial_stats(rec: Mapping[str, Any], *, slo_ms: float, target_rps: float, duration_s: float) -> dict[str, Any]:
    """One trial's figures from the driver's records (per request: ``warmup``, ``status`` (``OK``, another
    wire status, ``LOST`` when no answer came, ``SEND_ERROR``), ``latency_ms``, ``sched_s`` and ``send_s``
    (when it was due and when it went, from the trial's start), ``lag_us``; and ``stray``, answers the
    client matched to no request).

    Over the measured (non-warm-up) requests: ``sent``, ``ok``, ``lost``, ``slo_attainment`` (OK within
    ``slo_ms`` / sent), ``p50_ms``/``p99_ms`` of the OK answers, ``statuses`` by kind, ``offered_rps`` (sent
    over the measured window, stretched when the last sends went late), ``send_lag_p99_us`` and
    ``generator_limited`` (bench/engines_node's rule). Over every request sent, warm-up included:
    ``sent_all`` and ``once`` (answered, whatever the status); ``duplicates`` is ``stray``. The keys are
    those engines_node's ``judge`` reads."""
    status = np.asarray(rec["status"], dtype=object)
    n = len(status)
    for key in ("warmup", "latency_ms", "sched_s", "send_s", "lag_us"):
        if len(rec[key]) != n:
            raise ValueError(f"{key} has {len(rec[key])} entries for {n} requests")
    if not target_rps > 0 or not duration_s > 0:
        raise ValueError(f"target_rps and duration_s must be positive, got {target_rps!r}, {duration_s!r}")
    warm = np.asarray(rec["warmup"], dtype=bool)
    lat = np.asarray(rec["latency_ms"], dtype=float)
    m = ~warm
    answered = np.asarray([s not in ("LOST", "SEND_ERROR") for s in status], dtype=bool)
    ok = np.asarray([s == "OK" for s in status], dtype=bool)
    sent = int(m.sum())
    good = int((m & ok & (lat <= slo_ms)).sum())
    ok_lat = lat[m & ok]
    kinds: dict[str, int] = {}
    for s in status[m]:
        kinds[str(s)] = kinds.get(str(s), 0) + 1
    lag = np.asarray(rec["lag_us"], dtype=float)[m]
    lag_p99 = round(float(np.percentile(lag, 99)), 1) if lag.size else None
    if sent:
        send = np.asarray(rec["send_s"], dtype=float)[m]
        sched = np.asarray(rec["sched_s"], dtype=float)[m]
        span = max(duration_s, float(send.max() - sched.min()) + 1.0 / target_rps)
        offered = sent / span
    else:
        offered = 0.0

    def pct(p: float) -> float | None:
        return round(float(np.percentile(ok_lat, p)), 3) if ok_lat.size else None

    out: dict[str, Any] = {
        "target_rps": round(float(target_rps), 2), "sent": sent, "ok": int((m & ok).sum()),
        "lost": int((m & (status == "LOST")).sum()), "duplicates": int(rec.get("stray", 0)),
        "sent_all": n, "once": int(answered.sum()), "statuses": kinds,
        "slo_attainment": round(good / sent, 4) if sent else None, "p50_ms": pct(50), "p99_ms": pct(99),
        "offered_rps": round(offered, 2), "send_lag_p99_us": lag_p99,
    }
    out["generator_limited"] = generator_limited(out["offered_rps"], target_rps, lag_p99, slo_ms)
    return out


# -- the summary (pure) -------------------------------------------------------------------------------------
def engine_rate(times_ms: Sequence[float], batch: int) -> float | None:
    """Requests a second of the engine alone at ``batch``: ``batch`` over the median run time."""
    t = np.asarray(times_ms, dtype=float)
    if not t.size or not batch >= 1:
        return None
    med = float(np.median(t))
    return round(batch * 1e3 / med, 2) if med > 0 else None


def mixed_rate(rates: Sequence[float | None]) -> float | None:
    """The rate of an equal mix of shapes each served at its own rate: one over the mean of one over each."""
    if not rates or any(r is None or not r > 0 for r in rates):
        return None
    return round(1.0 / float(np.mean([1.0 / float(r) for r in rates if r])), 2)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def summarise(rows: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The flat summary from each model's row (``engine``: ``batch``, ``times_ms`` per batch key,
    ``mixed_widths``; ``single``/``mixed``: a search's ``best`` trial and ``history``; ``start_cold``/
    ``start_cached``: ``wall_s`` and the engine's status; ``error``).

    Per model: ``engine_rate_rps`` (and ``engine_batch``, ``engine_batch_ms``, ``engine_b1_ms``),
    ``node_rate_rps`` (the best held trial's achieved rate), ``node_over_engine_ratio``, ``meets_goal``,
    the held trial's ``node_p50_ms``/``node_p99_ms``, ``generator_limited`` (the best trial, or a missed one,
    was limited by the client), ``trials``, ``lost`` and ``duplicates`` over every trial; for a dynamic
    model ``mixed_shape_rate_rps`` beside ``single_shape_rate_rps``, ``mixed_over_single_ratio``,
    ``engine_mixed_rate_rps``; ``start_cold_s``, ``start_cached_s`` and the engine's ``*_build_ms``,
    ``*_load_ms``, ``*_cache_hit`` at each start; ``error`` when a part failed. Overall: the models that
    meet the goal and those measured."""
    out: dict[str, Any] = {}
    met: list[str] = []
    measured: list[str] = []
    for model, row in rows.items():
        eng = row.get("engine") or {}
        batch = eng.get("batch")
        times = eng.get("times_ms") or {}
        rate = engine_rate(times.get(batch_key(batch), []), batch) if batch else None
        out[f"{model}.engine_rate_rps"] = rate
        out[f"{model}.engine_batch"] = batch
        if batch and times.get(batch_key(batch)):
            out[f"{model}.engine_batch_ms"] = round(float(np.median(times[batch_key(batch)])), 4)
        if times.get(batch_key(1)):
            out[f"{model}.engine_b1_ms"] = round(float(np.median(times[batch_key(1)])), 4)
        single = row.get("single")
        node_rate = None
        if single is not None:
            best, history = single.get("best"), single.get("history") or []
            node_rate = best["offered_rps"] if best else None
            out[f"{model}.node_rate_rps"] = node_rate
            out[f"{model}.node_p50_ms"] = best.get("p50_ms") if best else None
            out[f"{model}.node_p99_ms"] = best.get("p99_ms") if best else None
            out[f"{model}.generator_limited"] = bool(best and best.get("generator_limited")) or any(
                h.get("generator_limited") and not h.get("passed") for h in history)
            ratio = _ratio(node_rate, rate)
            out[f"{model}.node_over_engine_ratio"] = ratio
            out[f"{model}.meets_goal"] = ratio is not None and ratio >= GOAL_RATIO
            measured.append(model)
            if out[f"{model}.meets_goal"]:
                met.append(model)
        mixed = row.get("mixed")
        all_trials = [*(single or {}).get("history", []), *(mixed or {}).get("history", [])]
        if single is not None:
            out[f"{model}.trials"] = len(all_trials)
            out[f"{model}.lost"] = int(sum(h.get("lost", 0) for h in all_trials))
            out[f"{model}.duplicates"] = int(sum(h.get("duplicates", 0) for h in all_trials))
        if mixed is not None:
            best = mixed.get("best")
            m_rate = best["offered_rps"] if best else None
            widths = list(eng.get("mixed_widths") or [])
            out[f"{model}.mixed_widths"] = widths
            out[f"{model}.mixed_shape_rate_rps"] = m_rate
            out[f"{model}.single_shape_rate_rps"] = node_rate
            out[f"{model}.mixed_over_single_ratio"] = _ratio(m_rate, node_rate)
            out[f"{model}.mixed_generator_limited"] = bool(best and best.get("generator_limited")) or any(
                h.get("generator_limited") and not h.get("passed") for h in mixed.get("history") or [])
            e_mixed = mixed_rate([engine_rate(times.get(batch_key(batch, w), []), batch) for w in widths]) \
                if batch and widths else None
            out[f"{model}.engine_mixed_rate_rps"] = e_mixed
            out[f"{model}.mixed_over_engine_ratio"] = _ratio(m_rate, e_mixed)
        for when in ("cold", "cached"):
            st = row.get(f"start_{when}")
            if st is None:
                continue
            out[f"{model}.start_{when}_s"] = st.get("wall_s")
            e = st.get("engine") or {}
            for k in ("build_ms", "load_ms", "cache_hit"):
                out[f"{model}.start_{when}_engine_{k}"] = e.get(k)
        if row.get("error"):
            out[f"{model}.error"] = row["error"]
    out["models_measured"] = measured
    out["models_meeting_goal"] = met
    out["goal_node_over_engine_ratio"] = GOAL_RATIO
    return out


# -- the repository -----------------------------------------------------------------------------------------
def build_example(out: Path) -> Path:
    """The example repository (examples/model_repository.py's ``build``) written to ``out``."""
    # examples/ holds scripts, not a package (tests/examples imports them the same way), and the builder
    # imports torch and onnx: loaded only when no --repository is given.
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    builder = importlib.import_module("model_repository")
    return Path(builder.build(out))


def model_names(root: Path) -> list[str]:
    """Every model directory of the repository, in the example's order where it is the example."""
    names = [m.name for m in scan(root, torch_ok=False, check_files=False)]
    order = ("mixed", "ocr", "scripted", "exported", "noconfig", "detector")
    return sorted(names, key=lambda n: (order.index(n) if n in order else len(order), n))


def read_model(root: Path, name: str) -> RepositoryModel:
    """One model of the repository read as the node reads it (torch allowed: the engine alone of a torch
    file needs its tensors); RepositoryError when it does not read."""
    m = load_repository_model(root, name, torch_ok=True)
    if m.error is not None or m.config is None or m.latest is None:
        raise RepositoryError(m.error or f"model {name!r}: no version to serve")
    return m


def node_config(root: Path, model: str, cache: Path) -> NodeConfig:
    """A loopback CPU-backend node serving ``model`` alone from the repository (explicit mode), its engine
    cache in ``cache``, no automatic share changes."""
    node: dict[str, Any] = {"backend": "cpu", "listen": {"host": "127.0.0.1", "port": [0]}, "pool": sv.POOL,
                            "scheduler": "spatial", "log_level": "WARNING", "autoscale": False,
                            "model_repository": str(root), "model_control_mode": "explicit",
                            "load_models": [model], "engine_cache": str(cache)}
    return parse_config({"node": node, "apps": []}, source=f"bench.repository {model}")


def active_instance(node: Node, app: str) -> dict[str, Any]:
    """The app's active instance as status shows it, after the next heartbeats (100 ms apart)."""
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        node.step(50)
    insts = node.status()["apps"][app]["instances"]
    return next((i for i in insts if i.get("role") == "active"), insts[0] if insts else {})


def settle(node: Node, app: str, timeout_s: float) -> float | None:
    """Pump the node until every instance of ``app`` (its shadow too) is ready; seconds waited, or None
    when the deadline passed first."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        node.step(50)
        insts = node.status()["apps"][app]["instances"]
        if insts and all(i.get("ready") for i in insts):
            return round(time.monotonic() - t0, 2)
    return None


@contextlib.contextmanager
def timed_node(cfg: NodeConfig) -> Iterator[tuple[Node, float]]:
    """A started node and the wall time (s) its ``start()`` took (until every app is READY); stopped on
    the way out."""
    node = Node(cfg, heartbeat_ms=100, warmup=True)
    t0 = time.perf_counter()
    try:
        node.start()
        wall = time.perf_counter() - t0
        yield node, round(wall, 3)
    finally:
        node.stop()


def start_record(node: Node, app: str, wall_s: float) -> dict[str, Any]:
    """What a start shows: its wall time and the active instance's engine (build_ms, load_ms, cache_hit);
    raises StartError when the app did not start (the node dropped it as UNAVAILABLE)."""
    if app not in node.status()["apps"]:
        why = next((u.reason for u in node.unavailable if u.name == app), "not served")
        raise StartError(f"model {app!r} is UNAVAILABLE: {why}")
    eng = active_instance(node, app).get("engine") or {}
    keep = ("kind", "cache_hit", "build_ms", "load_ms", "threads", "provider")
    return {"wall_s": wall_s, "engine": {k: eng.get(k) for k in keep}}


# -- the engine alone ---------------------------------------------------------------------------------------
def engine_alone(cfg: ModelConfig, path: str, fingerprint: str | None, *, cores: Sequence[int], threads: int,
                 cache: Path, batches: Mapping[str, Mapping[str, np.ndarray]], reps: int = ENGINE_REPS,
                 budget_s: float = ENGINE_BUDGET_S) -> dict[str, list[float]]:
    """Run time (ms) of every run of the model's file engine on each of ``batches`` (key -> named inputs),
    back to back in this thread on ``cores`` with ``threads`` (the engine is made there too, so its
    threads start there), after three warm-up runs each: ``reps`` runs per batch, fewer for a slow
    model (at least 5, or ``budget_s``)."""
    choice = cfg.engine("cpu")
    times: dict[str, list[float]] = {k: [] for k in batches}
    with sv.pinned(cores, threads):
        eng = make_file_engine(choice.kind, path, cfg.signature, Target("cpu", threads=threads),
                               dict(choice.options), fingerprint)
        try:
            eng.prepare(EngineCache(cache))
            for x in batches.values():
                for _ in range(3):
                    eng.run(x)
            for key, x in batches.items():
                spent = 0.0
                while len(times[key]) < reps and (len(times[key]) < 5 or spent < budget_s):
                    t = time.perf_counter_ns()
                    eng.run(x)
                    dt = (time.perf_counter_ns() - t) / 1e6
                    times[key].append(round(dt, 4))
                    spent += dt / 1e3
        finally:
            eng.close()
    return times


# -- the driver (a process of its own) ------------------------------------------------------------------------
def schedule(rate: float, duration_s: float, warmup_s: float, process: str, seed: int) -> np.ndarray:
    """Send times (s from the trial's start) of an open-loop trial: a warm-up and then ``duration_s`` at
    ``rate`` requests a second, evenly spaced (``constant``) or with exponential gaps (``poisson``)."""
    if not rate > 0 or not duration_s > 0 or warmup_s < 0:
        raise ValueError(f"bad trial: rate {rate!r}, duration_s {duration_s!r}, warmup_s {warmup_s!r}")
    total = warmup_s + duration_s
    n = math.ceil(total * rate) + 1
    if process == "constant":
        times = np.arange(n) / rate
    elif process == "poisson":
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=2 * n + 16)
        times = np.concatenate([[0.0], np.cumsum(gaps)])
    else:
        raise ValueError(f"process must be constant or poisson, got {process!r}")
    return times[times < total]


def send_trial(port: int, app_id: int, bodies: Sequence[Mapping[str, np.ndarray]], times_s: np.ndarray,
               warmup_s: float, timeout_s: float) -> dict[str, Any]:
    """Send ``bodies`` in turn at ``times_s`` with one ``Client`` and wait for every answer; the records
    `trial_stats` reads, plus ``body`` (the index of each request's body)."""
    n = len(times_s)
    send_s = np.zeros(n)
    futs: list[Any] = []
    status: list[str] = []
    lat = np.full(n, np.nan)
    with Client(("127.0.0.1", port), timeout_s=timeout_s) as client:
        t0 = time.perf_counter() + 0.05
        for i, due in enumerate(times_s):
            ahead = due - (time.perf_counter() - t0)
            if ahead > 0:
                time.sleep(ahead)  # open loop: a late send goes at once, its lag recorded, never skipped
            send_s[i] = time.perf_counter() - t0
            try:
                futs.append(client.submit(app_id, bodies[i % len(bodies)]))
            except OSError:
                futs.append(None)
        for i, f in enumerate(futs):
            if f is None:
                status.append("SEND_ERROR")
                continue
            try:
                r = f.result(timeout=timeout_s + 10)
            except RequestLost:
                status.append("LOST")
                continue
            except Exception as e:  # a malformed answer, the client closing: counted by kind
                status.append(f"ERROR_{type(e).__name__}")
                continue
            status.append(r.status.name)
            lat[i] = r.latency_ms
        time.sleep(0.1)  # a duplicate answer would come within the node's batch time: let it be seen
        stray = client.stray
    return {"warmup": (times_s < warmup_s).tolist(), "status": status, "latency_ms": np.round(lat, 4).tolist(),
            "sched_s": np.round(times_s, 6).tolist(), "send_s": np.round(send_s, 6).tolist(),
            "lag_us": np.round((send_s - times_s) * 1e6, 1).tolist(), "stray": int(stray),
            "body": [i % len(bodies) for i in range(n)]}


def _driver(cmds: Any, out: Any) -> None:
    """Child process: runs ("trial", kwargs) commands (its cores first) until ("stop",)."""
    while True:
        cmd = cmds.get()
        if cmd[0] == "stop":
            return
        kw = dict(cmd[1])
        try:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, kw.pop("cores"))
            times = schedule(kw.pop("rate"), kw.pop("duration_s"), kw["warmup_s"], kw.pop("process"), kw.pop("seed"))
            out.put(send_trial(times_s=times, **kw))
        except BaseException as e:  # reported to the parent, which fails the run with it
            out.put({"error": repr(e)})


class Driver:
    """The driver process (spawned) and its queues; `trial` runs one trial there while this process pumps
    the node's control loop. Always stopped and reaped by `close`."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.cmds, self.out = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_driver, args=(self.cmds, self.out), daemon=True, name="bench-repository-driver")
        self.proc.start()
        self.broken = False  # a trial failed or went silent: its result may still come, so never reuse this one

    def trial(self, node: Node, *, wait_s: float, **kw: Any) -> dict[str, Any]:
        """Run one trial (`send_trial`'s arguments, `schedule`'s and ``cores``) in the driver and return its
        records, pumping ``node`` meanwhile; RuntimeError when the driver fails or is silent for ``wait_s``
        (the driver is then ``broken``)."""
        try:
            return self._trial(node, wait_s, kw)
        except BaseException:
            self.broken = True
            raise

    def _trial(self, node: Node, wait_s: float, kw: dict[str, Any]) -> dict[str, Any]:
        self.cmds.put(("trial", kw))
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            node.step(50)
            try:
                res = self.out.get(timeout=0.01 if self.proc.is_alive() else 1.0)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(f"the driver exited ({self.proc.exitcode}) without a result") from None
                continue
            if "error" in res:
                raise RuntimeError(f"the driver failed: {res['error']}")
            return res
        raise RuntimeError(f"no result from the driver within {wait_s:g} s")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.cmds.put(("stop",))
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


# -- one model ----------------------------------------------------------------------------------------------
def _batch_delta(after: Mapping[str, int] | None, before: Mapping[str, int] | None) -> dict[str, int]:
    a, b = after or {}, before or {}
    return {str(k): int(v) - int(b.get(k, 0)) for k, v in a.items() if int(v) - int(b.get(k, 0)) > 0}


def search(node: Node, driver: Driver, app: str, app_id: int, slo_ms: float, bodies: Sequence[Mapping[str, np.ndarray]],
           widths: Sequence[int], *, start_rps: float, opts: argparse.Namespace, cores: Sequence[int],
           label: str) -> dict[str, Any]:
    """One rate search (RateSearch) of the node's app with ``bodies`` sent in turn: every trial's figures
    (its per-request records under ``requests``) and the best held one."""
    sr = RateSearch(start_rps, max_trials=opts.max_trials)
    while sr.rate is not None:
        rate = sr.rate
        duration = min(max(opts.trial_s, opts.min_requests / rate), 4 * opts.trial_s)
        timeout_s = max(2.0, 4 * slo_ms / 1e3)
        before = active_instance(node, app).get("batch_sizes")
        rec = driver.trial(node, wait_s=opts.warmup_s + duration + timeout_s + 60, port=sv.port_of(node),
                           app_id=app_id, bodies=list(bodies), rate=rate, duration_s=duration, warmup_s=opts.warmup_s,
                           process=opts.process, seed=len(sr.history), timeout_s=timeout_s, cores=list(cores))
        st = trial_stats(rec, slo_ms=slo_ms, target_rps=rate, duration_s=duration)
        st["passed"] = judge(st, attainment=ATTAINMENT)
        st["duration_s"] = round(duration, 3)
        st["batch_sizes"] = _batch_delta(active_instance(node, app).get("batch_sizes"), before)
        of = [widths[i] for i in rec["body"]]
        st["requests"] = {k: rec[k] for k in ("warmup", "status", "latency_ms", "lag_us")}
        if len(set(widths)) > 1:
            st["requests"]["width"] = of
        print(f"    {label:>6} {rate:8.1f} req/s (offered {st['offered_rps']}): att {st['slo_attainment']} lost "
              f"{st['lost']} dup {st['duplicates']} once {st['once']}/{st['sent_all']} p99 {st['p99_ms']} ms, "
              f"batches {st['batch_sizes']} -> {'held' if st['passed'] else 'missed'}"
              f"{' (generator limited)' if st['generator_limited'] else ''}", flush=True)
        sr.record(st)
    return {"best": sr.best, "history": sr.history}


def planned_share(cfg: ModelConfig) -> tuple[list[int], int]:
    """The cores and threads the node would give the model alone (for the engine alone of a model the
    node does not serve): its ``gpu_pct`` parameter, or every core for auto."""
    pct = cfg.parameters.gpu_pct if isinstance(cfg.parameters.gpu_pct, int) else 100
    share = plan_cpu_shares([("model", int(pct))])["model"]
    return list(share.cores), share.threads


def run_model(root: Path, name: str, tmp: Path, driver: Callable[[], Driver], opts: argparse.Namespace) -> dict[str, Any]:
    """Everything measured of one model (see the module docstring); a part that fails leaves ``error``
    and the parts before it."""
    row: dict[str, Any] = {"model": name}
    try:
        m = read_model(root, name)
    except RepositoryError as e:
        row["error"] = f"the model does not read: {e}"
        return row
    assert m.config is not None and m.latest is not None
    cfg, latest = m.config, m.latest
    sig = cfg.signature
    batch = sig.max_batch_size if sig.batched else 1
    dynamic = dynamic_model(sig)
    widths = list(opts.mixed_widths) if dynamic else []
    bodies, of_single = requests_for(sig, [opts.width])
    engine_batches = {batch_key(1): engine_batch(sig, bodies, 1), batch_key(batch): engine_batch(sig, bodies)}
    for w in widths:
        engine_batches[batch_key(batch, w)] = engine_batch(sig, requests_for(sig, [w])[0])
    row.update(kind=cfg.engine("cpu").kind, max_batch_size=sig.max_batch_size, slo_ms=cfg.parameters.slo_ms,
               gpu_pct=cfg.parameters.gpu_pct, width=opts.width if any(-1 in s.dims for s in sig.inputs) else None,
               engine={"batch": batch, "mixed_widths": widths, "times_ms": {k: [] for k in engine_batches}, "blocks": 0})
    print(f"{name}: {cfg.engine('cpu').kind}, max_batch_size {sig.max_batch_size}, inputs "
          + ", ".join(f"{s.name} {s.datatype.value}{list(s.dims)}" for s in sig.inputs), flush=True)
    cache = tmp / f"cache-{name}"

    def engine_block(cores: Sequence[int], threads: int) -> None:
        t = engine_alone(cfg, latest.model_path, latest.fingerprint, cores=cores, threads=threads, cache=cache,
                         batches=engine_batches, reps=opts.engine_reps)
        for k, v in t.items():
            row["engine"]["times_ms"][k] += v
        row["engine"]["blocks"] += 1
        row["engine"].update(cores=list(cores), threads=threads)
        print(f"  engine alone on cores {list(cores)}, {threads} thread(s): " + ", ".join(
            f"{k} {np.median(v):.3f} ms" for k, v in t.items()), flush=True)

    try:
        ncfg = node_config(root, name, cache)
    except ConfigError as e:
        row["error"] = f"the node refuses the model: {' '.join(str(e).split())}"
        print(f"  {row['error']}", flush=True)
        engine_block(*planned_share(cfg))
        return row
    app = ncfg.apps[0]
    try:
        with timed_node(ncfg) as (node, wall):
            row["start_cold"] = start_record(node, name, wall)
        print(f"  start, empty cache: {row['start_cold']}", flush=True)
        with timed_node(ncfg) as (node, wall):
            row["start_cached"] = start_record(node, name, wall)
            print(f"  start, cache filled: {row['start_cached']}", flush=True)
            row["settle_s"] = settle(node, name, opts.settle_s)
            inst = active_instance(node, name)
            cores = list(inst.get("cores") or planned_share(cfg)[0])
            threads = int((inst.get("engine") or {}).get("threads") or len(cores))
            row["instance"] = {"cores": cores, "threads": threads, "gpu_pct": inst.get("gpu_pct")}
            engine_block(cores, threads)
            e_rate = engine_rate(row["engine"]["times_ms"][batch_key(batch)], batch) or 100.0
            rest = [c for c in available_cores() if c not in cores] or available_cores()
            start = max(5.0, min(opts.max_rate, opts.start_rps, 0.5 * e_rate))
            row["single"] = search(node, driver(), name, app.app_id, app.slo_ms, bodies, of_single,
                                   start_rps=start, opts=opts, cores=rest, label="single")
            if widths:
                mixed, of = requests_for(sig, widths)
                best = row["single"]["best"]
                m_start = min(opts.max_rate, max(5.0, (0.8 * best["offered_rps"]) if best else start))
                row["mixed"] = search(node, driver(), name, app.app_id, app.slo_ms, mixed, of, start_rps=m_start,
                                      opts=opts, cores=rest, label="mixed")
            engine_block(cores, threads)
            row["instance_after"] = sv.instance_stats(node, name)
    except (StartError, RuntimeError) as e:
        row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())}"
        print(f"  {row['error']}", flush=True)
        if not row["engine"]["blocks"]:
            engine_block(*planned_share(cfg))
    return row


# -- main ---------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The arguments, each checked (argparse's error, exit status 2, names the bad value)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the ocr model (or the first dynamic one), two short trials "
                    "per search: a smoke test, not a result")
    ap.add_argument("--repository", type=Path, default=None, help="a Triton model repository (default: the example, "
                    "built into a temporary directory)")
    ap.add_argument("--models", nargs="+", default=None, help="the models to measure (default: every one)")
    ap.add_argument("--trial-s", type=float, default=4.0, help="measured seconds per trial (at least)")
    ap.add_argument("--warmup-s", type=float, default=1.0, help="warm-up seconds before each trial's measured part")
    ap.add_argument("--max-trials", type=int, default=8, help="trials per rate search")
    ap.add_argument("--min-requests", type=int, default=200, help="measured requests per trial (at least)")
    ap.add_argument("--start-rps", type=float, default=START_RPS, help="the rate a search starts at (at most; "
                    "half the engine alone's rate when lower)")
    ap.add_argument("--max-rate", type=float, default=MAX_RATE_RPS, help="the highest rate a search starts at (req/s)")
    ap.add_argument("--process", choices=("constant", "poisson"), default="constant", help="arrivals")
    ap.add_argument("--width", type=int, default=WIDTH, help="each dynamic input dimension of a single-shape request")
    ap.add_argument("--mixed-widths", type=int, nargs="+", default=list(MIXED_WIDTHS),
                    help="the widths of the mixed-shape search (three or more)")
    ap.add_argument("--engine-reps", type=int, default=ENGINE_REPS, help="engine-alone runs per batch shape and block")
    ap.add_argument("--settle-s", type=float, default=SETTLE_S, help="the longest wait for the app's shadow")
    ap.add_argument("--name", default="repository", help="stem of the result file (-quick appended with --quick)")
    ap.add_argument("--out-dir", type=Path, default=None, help="write here instead of bench/results/<machine>/")
    args = ap.parse_args(argv)
    for flag, v in (("--trial-s", args.trial_s), ("--start-rps", args.start_rps), ("--max-rate", args.max_rate)):
        if not (math.isfinite(v) and v > 0):
            ap.error(f"{flag} must be a positive number, got {v}")
    for flag, v in (("--warmup-s", args.warmup_s), ("--settle-s", args.settle_s)):
        if not (math.isfinite(v) and v >= 0):
            ap.error(f"{flag} must be >= 0, got {v}")
    for flag, v, low in (("--max-trials", args.max_trials, 1), ("--min-requests", args.min_requests, 1),
                         ("--width", args.width, 1), ("--engine-reps", args.engine_reps, 5)):
        if v < low:
            ap.error(f"{flag} must be >= {low}, got {v}")
    if len(set(args.mixed_widths)) < 3 or min(args.mixed_widths) < 1:
        ap.error(f"--mixed-widths needs three or more different widths >= 1, got {args.mixed_widths}")
    if args.repository is not None and not args.repository.is_dir():
        ap.error(f"--repository {str(args.repository)!r} is not a directory")
    return ap, args


def pick_models(names: Sequence[str], wanted: Sequence[str] | None, quick: bool, root: Path) -> list[str]:
    """The models to measure: ``wanted`` (each must be in the repository: ValueError names the others),
    else every one, else with ``quick`` ``ocr`` or the first model with a dynamic input and batching (the
    first model when none has)."""
    if wanted:
        unknown = [w for w in wanted if w not in names]
        if unknown:
            raise ValueError(f"no model(s) {unknown} in the repository (it has: {', '.join(names) or 'none'})")
        return list(dict.fromkeys(wanted))
    if not quick:
        return list(names)
    if "ocr" in names:
        return ["ocr"]
    for n in names:
        with contextlib.suppress(RepositoryError):
            m = read_model(root, n)
            if m.config is not None and dynamic_model(m.config.signature):
                return [n]
    return list(names[:1])


def main(argv: Sequence[str] | None = None) -> Path:
    ap, args = parse_args(argv)
    if args.quick:
        args.trial_s, args.warmup_s, args.max_trials, args.min_requests = 0.5, 0.3, 2, 20
        args.start_rps = min(args.start_rps, 50.0)
        args.engine_reps, args.settle_s = min(args.engine_reps, 30), min(args.settle_s, 30.0)
    load_before = os.getloadavg()
    t_run = time.monotonic()
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="gpuprims-bench-repository-") as tmp_name:
        tmp = Path(tmp_name)
        if args.repository is not None:
            root, where = args.repository.resolve(), str(args.repository)
        else:
            t0 = time.perf_counter()
            root = build_example(tmp / "repository")
            where = "examples/model_repository.py, built into a temporary directory"
            print(f"example repository built in {time.perf_counter() - t0:.1f} s", flush=True)
        try:
            models = pick_models(model_names(root), args.models, args.quick, root)
        except (ValueError, RepositoryError) as e:
            ap.error(str(e))
        drivers: list[Driver] = []

        def driver() -> Driver:
            if drivers and (drivers[-1].broken or not drivers[-1].proc.is_alive()):
                drivers.pop().close()  # the next model gets a fresh one
            if not drivers:  # started when the first trial needs it: a model without a node needs none
                drivers.append(Driver())
            return drivers[-1]

        try:
            for name in models:
                rows[name] = run_model(root, name, tmp, driver, args)
        finally:
            for d in drivers:
                d.close()
    summary = summarise(rows)
    summary.update(repository=where, models=models, serving="one model at a time: a node per model with "
                   "model_control_mode explicit, load_models [model], its own share from config.pbtxt",
                   attainment_required=ATTAINMENT, process=args.process, trial_s=args.trial_s, warmup_s=args.warmup_s,
                   width=args.width, mixed_widths=list(args.mixed_widths), client="gpuprims.client.Client (Python, "
                   "one process)", duration_s=round(time.monotonic() - t_run, 1))
    notes = ("CPU backend (no GPU). Each model served alone by a node in this process on loopback, at the share its "
             "config.pbtxt gives (noconfig, which names none: auto, every core); the client (gpuprims.client in a "
             "driver process) on the cores the instance does not hold, beside the node's ingest and control loop. "
             "engine_rate_rps: gpuprims' file engine of the model's kind alone on the instance's cores and threads at "
             "the model's max_batch_size. A model marked generator_limited was held at every rate the Python client "
             "could offer: its node_rate_rps and node_over_engine_ratio are floors set by the client."
             + load_note(load_before))
    samples = {name: {k: v for k, v in row.items()} for name, row in rows.items()}
    stem = f"{args.name}-quick" if args.quick and args.name == "repository" else args.name
    path = write_result("repository", "cpu", summary, samples, notes=notes, large_samples=True,
                        load_avg_before=load_before, name=None if stem == "repository" else stem, out_dir=args.out_dir)
    print(path)
    for k, v in summary.items():
        print(f"{k:>45}: {v}")
    return path


if __name__ == "__main__":
    main()
