"""bench/single_stream: one request at a time (MLPerf's SingleStream), closed loops of 2, 4 and 8, and
MultiStream queries of 8, each beside the engine alone at the same batch on the same core (issue 45).

A real node started in this process serves the example's classify app (examples/apps.yaml: MobileNetV2,
3x64x64 float32 = 48 datagrams a request, SLO 200 ms, gpu_pct 50 = one core of two on the CPU backend,
``engine: onnxruntime``, its ``max_wait_ms``), without its shadow (a second process beside the one
measured adds nothing here), with the Open Inference Protocol front door beside it as bench/oip starts it.
``max_batch`` is 8 (``--max-batch``; the example's is 4) so that a MultiStream query of 8 can be one
batch; an OIP query of more rows than ``max_batch`` is refused as Triton refuses it, so with
``--max-batch`` below 8 the HTTP and gRPC MultiStream rows are left out (said in ``skipped``).

A driver process (spawned, on every core, as a client on this machine) runs each case: a closed loop
of ``concurrency`` clients, each sending a request, waiting for its answer, sending the next:

- ``udp``: ``gpuprims.client.Client`` (concurrency 1, the way a camera sends) or ``AsyncClient``;
- ``http``: tritonclient.http (binary tensor data; ``.aio`` above concurrency 1);
- ``grpc``: tritonclient.grpc (``.aio`` above concurrency 1);
- MultiStream: one query of 8 at a time: ``infer_many`` of 8 over UDP, one OIP inference of batch 8.

Beside each case, the engine alone (gpuprims' ONNX Runtime engine, built from the same model into the
same engine cache) runs back to back at the batch that case serves (``min(concurrency, max_batch)``,
8 for MultiStream) in this process, pinned to the instance's cores with its thread count. The cases
take turns over ``--rounds`` rounds (order rotated), each case followed by its engine block, so a change
in the machine's background load falls on all of them alike.

The peers (``--peers``, bench/peer's servers, started one at a time after the node has stopped, on the
instance's cores and threads, the app's model, ``max_batch`` and ``max_wait_ms``): LitServe on gpuprims'
ONNX Runtime engine (its JSON request, HTTP) and Ray Serve (its raw-bytes request, HTTP; bench/peer_ray
runs torch eager, it has no ONNX Runtime engine), each in the same closed loops of single requests
(``litserve.c1`` ...). A peer that is not installed is left out with the reason in ``skipped``.

The stage trace (``--trace N``, on by default): a node of its own, started with the instances' trace
on (orchestrator.worker.loops.trace ``TRACE_ENV``), serves N single requests one at a time from a
``gpuprims.client.Client(trace=True)``; each request's client and instance timestamps are joined (by
request id and the client's timestamp) into the stages of its way, p50 and p99 of each in
``trace.<stage>.p50_ms``: ``client_prep`` (call to the request built: the body's array, its id, the
wire header's ``client_ts_ns``), ``to_ingest`` (to the ingest's first datagram in: the client's send
call and the kernel), ``reassembly`` (to the last datagram in: the client's other datagrams and their
reassembly), ``ring_wake`` (to the instance taking it off its ring), ``batch_wait``, ``gather``,
``engine``, ``answer`` (published to the answer ring), ``send_back`` (to the client's receive thread
reading the answer), ``client_return`` (to the call returning), and ``total``. ``--only-trace`` runs the
trace alone (a quick look at where a request's time goes).

Summary, per ``<transport>.c<concurrency>`` and ``<transport>.multistream8``: ``p50_ms``, ``p90_ms``
(SingleStream's metric), ``p99_ms`` of the client's latency (call to answer, the whole query for
MultiStream), ``engine_ms`` (the engine alone, p50), ``added_p50_ms`` (p50 - engine_ms) and
``added_p99_ms`` (p99 - engine_ms: the issue's goals are UDP +0.3 ms p50 and +1 ms p99 at concurrency
1, HTTP and gRPC +0.5 ms, MultiStream p99 +0.5 ms), ``throughput_rps``, ``errors`` and the instance's
``batch_sizes`` during the case (from its heartbeats). The instance's per-stage breakdown
(``instance_stages.*``) says where a miss goes. Raw latencies are in the samples.

Run: ``python -m bench.single_stream [--quick] [--max-wait-ms MS] [--peers ...] [--trace N] [--only-trace]
[--name NAME]``. Reports, never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import functools
import importlib.util
import multiprocessing as mp
import os
import queue
import resource
import socket
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from bench import peer
from bench import serving as sv
from bench.common import ROOT, load_note, write_result
from bench.e2e import load_runner
from gpuprims.cpushare import available_cores, plan_cpu_shares
from orchestrator.config.schema import NodeConfig, parse_config
from orchestrator.frontdoor import start_frontdoor
from orchestrator.node.node import Node
from orchestrator.worker.loops.trace import TRACE_ENV, TracedRequest, read_trace

EXAMPLE = ROOT / "examples" / "apps.yaml"
APP = "classify"
TRANSPORTS = ("udp", "http", "grpc")
PEERS = ("litserve", "ray")
#: What each peer needs importable (bench/peer_litserve, bench/peer_ray).
PEER_MODULES = {"litserve": ("litserve",), "ray": ("ray", "starlette")}
TRACE_STAGES = ("client_prep", "to_ingest", "reassembly", "ring_wake", "batch_wait", "gather", "engine", "answer",
                "send_back", "client_return", "total")
CONCURRENCY = (1, 2, 4, 8)
MULTI = 8  #: samples per MultiStream query (MLPerf's edge MultiStream)
CLIENT_TIMEOUT_S = 5.0
WARMUP = 10  #: requests (queries) per client discarded at the start of each block


def example_app(max_batch: int, max_wait_ms: float | None) -> dict[str, Any]:
    """The example's classify entry (examples/apps.yaml) as the bench serves it: no shadow, `max_batch`,
    and `max_wait_ms` when given (else the example's)."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    app = copy.deepcopy(next(a for a in doc["apps"] if a["name"] == APP))
    app.update(shadow=False, max_batch=max_batch)
    if max_wait_ms is not None:
        app["max_wait_ms"] = float(max_wait_ms)
    return app


def node_config(app: dict[str, Any], cache: str | None) -> NodeConfig:
    """A loopback CPU-backend node with the one app (its front door is started beside it, as bench/oip)."""
    node: dict[str, Any] = {"backend": "cpu", "listen": {"host": "127.0.0.1", "port": [0]}, "pool": sv.POOL,
                            "scheduler": "spatial", "log_level": "WARNING"}
    if cache is not None:
        node["engine_cache"] = cache
    return parse_config({"node": node, "apps": [app]}, source="bench.single_stream")


def case_key(transport: str, concurrency: int, query: int) -> str:
    """``udp.c1`` for closed loops of single requests, ``udp.multistream8`` for queries of 8."""
    return f"{transport}.multistream{query}" if query > 1 else f"{transport}.c{concurrency}"


def engine_batch(concurrency: int, query: int, max_batch: int) -> int:
    """The batch the engine alone runs beside a case: what the instance can serve it as at most."""
    return query if query > 1 else min(concurrency, max_batch)


# -- the driver (a process of its own) ------------------------------------------------------------------
def _inputs(transport: str, query: int, shape: Sequence[int]) -> tuple[Any, Any]:
    """The request body (one sample, or `query` samples) and, for OIP, the InferInput that carries it."""
    x = np.random.default_rng(query).random((query, *shape), dtype=np.float32)
    if transport == "udp":
        return x, None
    if transport == "http":
        import tritonclient.http as mod
    else:
        import tritonclient.grpc as mod  # type: ignore[no-redef]
    inp = mod.InferInput("input", list(x.shape), "FP32")
    if transport == "http":
        inp.set_data_from_numpy(x, binary_data=True)
    else:
        inp.set_data_from_numpy(x)
    return x, inp


def _outcome(e: Exception, elapsed_ms: float) -> str:
    """What a failed call is called in the result: ``lost`` when it ran into the client's timeout (no
    answer), else the error's kind (an OIP error status, a wire status)."""
    if elapsed_ms >= CLIENT_TIMEOUT_S * 1e3 or type(e).__name__ == "RequestLost":
        return "lost"
    status = getattr(e, "status", None)
    kind = status() if callable(status) else None
    return f"error_{kind or type(e).__name__}"


def _peer_call(transport: str, target: str, x: np.ndarray) -> Callable[[], str]:
    """One single-sample request to a peer (bench/peer's request formats), blocking; its outcome."""
    if transport == "litserve":
        url, body, headers = f"http://{target}/predict", peer.litserve_body(x), {"Content-Type": "application/json"}
    else:
        url, body, headers = f"http://{target}/infer", np.ascontiguousarray(x, np.float32).tobytes(), {}

    def call() -> str:
        req = urllib.request.Request(url, data=body, method="POST", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=CLIENT_TIMEOUT_S) as r:
                r.read()
                return "ok"
        except urllib.error.HTTPError as e:
            return f"error_{e.code}"
        except (urllib.error.URLError, OSError):
            return "lost"

    return call


def _run_threads(call: Callable[[], str], concurrency: int, n: int) -> tuple[list[float], list[str]]:
    """`concurrency` closed-loop clients, a thread each (a peer's blocking HTTP call); each discards its
    first `WARMUP`, then `n` latencies in all."""
    lat: list[float] = []
    outcomes: list[str] = []
    lock = threading.Lock()
    left = [n]

    def one_client() -> None:
        for _ in range(WARMUP):
            call()
        while True:
            with lock:
                if left[0] <= 0:
                    return
                left[0] -= 1
            t = time.perf_counter_ns()
            outcome = call()
            ms = (time.perf_counter_ns() - t) / 1e6
            with lock:
                lat.append(ms)
                outcomes.append(outcome)

    threads = [threading.Thread(target=one_client, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=(WARMUP + n) * (CLIENT_TIMEOUT_S + 1))
    return lat, outcomes


def _run_trace(target: str, app_id: int, n: int, shape: Sequence[int]) -> list[dict[str, int]]:
    """`n` single requests one at a time from a tracing Client (after `WARMUP`): each OK one's client
    timestamps (`gpuprims.client.ClientTrace`), request id and the time the call returned."""
    from gpuprims.client import Client

    x = np.random.default_rng(1).random(tuple(shape), dtype=np.float32)
    host, port = target.rsplit(":", 1)
    out: list[dict[str, int]] = []
    with Client((host, int(port)), timeout_s=CLIENT_TIMEOUT_S, trace=True) as client:
        for k in range(WARMUP + n):
            try:
                r = client.infer(app_id, x)
            except Exception:
                continue
            returned_ns = time.monotonic_ns()
            if k >= WARMUP and r.ok and r.trace is not None:
                t = r.trace
                out.append({"request_id": r.request_id, "start_ns": t.start_ns, "client_ts_ns": t.client_ts_ns,
                            "first_sent_ns": t.first_sent_ns, "last_sent_ns": t.last_sent_ns,
                            "answered_ns": t.answered_ns, "returned_ns": returned_ns})
    return out


def _run_sync(transport: str, target: str, app_id: int, query: int, n: int, shape: Sequence[int]
              ) -> tuple[list[float], list[str]]:
    """One client, one request (query) at a time: `WARMUP` discarded, then `n` latencies (ms) and
    outcomes (``ok``, ``lost`` or the error's kind)."""
    x, inp = _inputs(transport, query, shape)
    if transport == "udp":
        from gpuprims.client import Client

        host, port = target.rsplit(":", 1)
        client: Any = Client((host, int(port)), timeout_s=CLIENT_TIMEOUT_S)

        def call() -> str:
            results = [client.infer(app_id, x[0])] if query == 1 else client.infer_many(app_id, list(x))
            bad = [r.status.name for r in results if not r.ok]
            return bad[0] if bad else "ok"
    else:
        if transport == "http":
            import tritonclient.http as mod

            client = mod.InferenceServerClient(target)
            kw: dict[str, Any] = {}
        else:
            import tritonclient.grpc as mod  # type: ignore[no-redef]

            client = mod.InferenceServerClient(target)
            kw = {"client_timeout": CLIENT_TIMEOUT_S}

        def call() -> str:
            rows = client.infer(APP, [inp], **kw).as_numpy("logits").shape[0]
            return "ok" if rows == query else f"error_{rows}_rows"

    lat: list[float] = []
    outcomes: list[str] = []
    try:
        for k in range(WARMUP + n):
            t = time.perf_counter_ns()
            try:
                outcome = call()
            except Exception as e:
                outcome = _outcome(e, (time.perf_counter_ns() - t) / 1e6)
            if k >= WARMUP:
                lat.append((time.perf_counter_ns() - t) / 1e6)
                outcomes.append(outcome)
    finally:
        client.close()
    return lat, outcomes


async def _run_async(transport: str, target: str, app_id: int, concurrency: int, n: int, shape: Sequence[int]
                     ) -> tuple[list[float], list[str]]:
    """`concurrency` closed-loop clients on one event loop, sharing one connection (UDP socket, HTTP
    session, gRPC channel); each discards its first `WARMUP`, then `n` latencies in all."""
    x, inp = _inputs(transport, 1, shape)
    if transport == "udp":
        from gpuprims.client import AsyncClient

        host, port = target.rsplit(":", 1)
        client: Any = await AsyncClient((host, int(port)), timeout_s=CLIENT_TIMEOUT_S).open()

        async def call() -> str:
            r = await client.infer(app_id, x[0])
            return "ok" if r.ok else r.status.name
    else:
        if transport == "http":
            import tritonclient.http.aio as aio

            client = aio.InferenceServerClient(target)
            kw: dict[str, Any] = {}
        else:
            import tritonclient.grpc.aio as aio  # type: ignore[no-redef]

            client = aio.InferenceServerClient(target)
            kw = {"client_timeout": CLIENT_TIMEOUT_S}

        async def call() -> str:
            rows = (await client.infer(APP, [inp], **kw)).as_numpy("logits").shape[0]
            return "ok" if rows == 1 else f"error_{rows}_rows"

    lat: list[float] = []
    outcomes: list[str] = []
    left = n

    async def one_client() -> None:
        nonlocal left
        for _ in range(WARMUP):
            with contextlib.suppress(Exception):
                await call()
        while left > 0:
            left -= 1
            t = time.perf_counter_ns()
            try:
                outcome = await call()
            except Exception as e:
                outcome = _outcome(e, (time.perf_counter_ns() - t) / 1e6)
            lat.append((time.perf_counter_ns() - t) / 1e6)
            outcomes.append(outcome)

    try:
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
    finally:
        res = client.close()
        if asyncio.iscoroutine(res):
            await res
    return lat, outcomes


def _driver(app_id: int, shape: tuple[int, ...], cmds: Any, out: Any, cores: list[int]) -> None:
    """Child process: runs ("run", transport, target, concurrency, query, n) and ("trace", target, n)
    commands until ("stop",)."""
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, cores)
    while True:
        cmd = cmds.get()
        if cmd[0] == "stop":
            return
        if cmd[0] == "trace":
            try:
                out.put({"trace": _run_trace(cmd[1], app_id, cmd[2], shape)})
            except BaseException as e:
                out.put({"error": repr(e)})
            continue
        _, transport, target, concurrency, query, n = cmd
        try:
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            if transport in PEERS:
                x = np.random.default_rng(1).random(shape, dtype=np.float32)
                lat, outcomes = _run_threads(_peer_call(transport, target, x), concurrency, n)
            elif concurrency == 1:
                lat, outcomes = _run_sync(transport, target, app_id, query, n, shape)
            else:
                lat, outcomes = asyncio.run(_run_async(transport, target, app_id, concurrency, n, shape))
            wall = time.perf_counter() - t0
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
            out.put({"latency_ms": lat, "outcomes": outcomes, "wall_s": wall, "client_cpu_s": cpu})
        except BaseException as e:  # reported to the parent, which fails the run with it
            out.put({"error": repr(e)})


def _take(node: Node | None, proc: Any, out: Any, timeout_s: float) -> dict[str, Any]:
    """The driver's next result, pumping the node's control loop meanwhile (if there is one)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if node is not None:
            node.step(50)
        try:
            res = out.get(timeout=0.01 if proc.is_alive() else 1.0)
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"driver exited ({proc.exitcode}) without a result") from None
            continue
        if "error" in res:
            raise RuntimeError(f"driver failed: {res['error']}")
        return res
    raise RuntimeError(f"no result from the driver within {timeout_s:g} s")


def _instance(node: Node) -> dict[str, Any]:
    """The app's active instance as `status` shows it, after its next heartbeats (100 ms apart)."""
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        node.step(50)
    insts = sv.instance_stats(node, APP)["instances"]
    return next((i for i in insts if i.get("role") == "active"), insts[0] if insts else {})


def _batch_delta(after: dict[str, int] | None, before: dict[str, int] | None) -> dict[str, int]:
    a, b = after or {}, before or {}
    return {k: v - b.get(k, 0) for k, v in a.items() if v - b.get(k, 0) > 0}


# -- the summary (pure) ---------------------------------------------------------------------------------
def summarise_case(latency_ms: Sequence[float], outcomes: Sequence[str], engine_ms: Sequence[float], wall_s: float,
                   query: int) -> dict[str, Any]:
    """One case's figures: client percentiles over the requests answered OK (the others counted by kind
    in ``errors``, ``lost`` those never answered), the engine alone's p50, and the differences the
    issue's goals are set on."""
    if len(outcomes) != len(latency_ms):
        raise ValueError(f"{len(outcomes)} outcomes for {len(latency_ms)} latencies")
    lat = np.asarray(latency_ms, float)
    good = np.asarray([o == "ok" for o in outcomes], bool)
    ok = lat[good] if lat.size else lat
    kinds: dict[str, int] = {}
    for o in outcomes:
        if o != "ok":
            kinds[o] = kinds.get(o, 0) + 1
    eng = np.asarray(engine_ms, float)
    engine_p50 = float(np.median(eng)) if eng.size else None

    def pct(p: float) -> float | None:
        return round(float(np.percentile(ok, p)), 3) if ok.size else None

    p50, p99 = pct(50), pct(99)
    return {"requests": int(lat.size), "ok": int(ok.size), "lost": kinds.get("lost", 0), "errors": kinds,
            "p50_ms": p50, "p90_ms": pct(90),
            "p99_ms": p99, "engine_ms": round(engine_p50, 3) if engine_p50 is not None else None,
            "added_p50_ms": round(p50 - engine_p50, 3) if p50 is not None and engine_p50 is not None else None,
            "added_p99_ms": round(p99 - engine_p50, 3) if p99 is not None and engine_p50 is not None else None,
            "throughput_rps": round(ok.size * query / wall_s, 2) if wall_s > 0 else None}


def trace_stages(client: Sequence[dict[str, int]], node: Sequence[TracedRequest]) -> dict[str, list[float]]:
    """Each stage's durations (ms, `TRACE_STAGES`) over the requests traced on both sides, joined by
    request id and the client's timestamp (the wire header's, echoed in the instance's record)."""
    by_key = {(r.request_id, r.client_ts_ns): r for r in node}
    out: dict[str, list[float]] = {k: [] for k in TRACE_STAGES}
    for c in client:
        r = by_key.get((c["request_id"], c["client_ts_ns"]))
        if r is None:
            continue
        marks = (c["start_ns"], c["client_ts_ns"], r.first_ns, r.complete_ns, r.woke_ns, r.take_ns, r.gathered_ns,
                 r.model_ns, r.answered_ns, c["answered_ns"], c["returned_ns"])
        for stage, a, b in zip(TRACE_STAGES, marks, marks[1:]):
            out[stage].append((b - a) / 1e6)
        out["total"].append((c["returned_ns"] - c["start_ns"]) / 1e6)
    return out


def summarise_trace(stages: dict[str, list[float]]) -> dict[str, Any]:
    """``trace.<stage>.p50_ms`` and ``.p99_ms`` of each stage, and how many requests were joined."""
    out: dict[str, Any] = {"trace.requests": len(stages.get("total", []))}
    for stage in TRACE_STAGES:
        v = np.asarray(stages.get(stage, []), float)
        out[f"trace.{stage}.p50_ms"] = round(float(np.percentile(v, 50)), 4) if v.size else None
        out[f"trace.{stage}.p99_ms"] = round(float(np.percentile(v, 99)), 4) if v.size else None
    return out


def missing_peer_modules(system: str) -> list[str]:
    """The modules a peer needs that are not installed (empty: it can run)."""
    return [m for m in PEER_MODULES[system] if importlib.util.find_spec(m) is None]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sk:
        sk.bind(("127.0.0.1", 0))
        return int(sk.getsockname()[1])


@dataclass
class PeerServer:
    """A running peer server (bench/peer's) and the address its closed loops go to."""

    name: str
    proc: peer.SystemProc
    target: str


@contextlib.contextmanager
def peer_server(system: str, app: dict[str, Any], cores: list[int], threads: int, work: Path,
                cache: str | None) -> Iterator[PeerServer]:
    """`system` serving the app's model on `cores` with `threads`, its batching the app's, once it answers;
    stopped (its whole process tree) on the way out."""
    port = _free_port()
    shape = [str(v) for v in app["input_shape"]]
    common = ["--port", str(port), "--model", str(app["model"]), "--shape", *shape, "--cores", *map(str, cores),
              "--threads", str(threads), "--max-batch", str(app["max_batch"]), "--wait-ms", str(app["max_wait_ms"])]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if system == "litserve":
        argv = [sys.executable, "-m", "bench.peer_litserve", *common, "--engine", str(app["engine"])]
        if cache is not None:
            argv += ["--engine-cache", cache]
        ask: Callable[[np.ndarray], Any] = functools.partial(peer.ask_litserve, port)
    else:
        tmp = tempfile.mkdtemp(prefix="rp", dir="/tmp")  # Ray's socket paths must stay short
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        argv = [sys.executable, "-m", "bench.peer_ray", *common, "--max-ongoing", str(2 * int(app["max_batch"])),
                "--num-cpus", str(os.cpu_count() or 1), "--temp-dir", tmp]
        ask = functools.partial(peer.ask_ray, port)
    proc = peer.SystemProc(system, argv, env, work / f"{system}.log")
    try:
        x = np.random.default_rng(0).random(tuple(int(v) for v in app["input_shape"]), dtype=np.float32)
        peer.wait_ready(proc, ask, x)
        yield PeerServer(system, proc, f"127.0.0.1:{port}")
    finally:
        proc.stop()


def cases(transports: Sequence[str], concurrency: Sequence[int], max_batch: int) -> tuple[list[tuple[str, int, int]],
                                                                                         list[str]]:
    """(transport, concurrency, query) of every case, and the cases left out with the reason."""
    out = [(t, c, 1) for t in transports for c in concurrency]
    skipped = []
    for t in transports:
        if t != "udp" and max_batch < MULTI:
            skipped.append(f"{t}.multistream{MULTI}: an OIP query of {MULTI} rows is refused by a model whose "
                           f"max_batch is {max_batch} (as Triton refuses it)")
        else:
            out.append((t, 1, MULTI))
    return out, skipped


def _trace_run(cfg: NodeConfig, proc: Any, cmds: Any, out: Any, n: int) -> dict[str, list[float]]:
    """The stage trace (module docstring): a node of its own with the instances' trace on, `n` single
    requests from a tracing client, both sides joined."""
    with tempfile.TemporaryDirectory(prefix="gpuprims-trace-") as d:
        os.environ[TRACE_ENV] = d  # the node's instances inherit it
        try:
            with sv.running_node(cfg) as node:
                _instance(node)
                cmds.put(("trace", f"127.0.0.1:{sv.port_of(node)}", n))
                res = _take(node, proc, out, (WARMUP + n) * (CLIENT_TIMEOUT_S + 1) + 120)
                _instance(node)  # the last answers' lines written
        finally:
            del os.environ[TRACE_ENV]
        return trace_stages(res["trace"], read_trace(Path(d)))


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few requests per case (a smoke test, not a result)")
    ap.add_argument("--requests", type=int, default=1000, help="measured requests (queries) per case")
    ap.add_argument("--rounds", type=int, default=4, help="turns each case takes (order rotated)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY), help="closed-loop clients")
    ap.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=TRANSPORTS)
    ap.add_argument("--peers", nargs="*", default=list(PEERS), choices=PEERS,
                    help="peer servers in the same closed loops (none: --peers with no name)")
    ap.add_argument("--trace", type=int, default=500, help="requests of the stage trace (0: none)")
    ap.add_argument("--only-trace", action="store_true", help="the stage trace alone (no cases, no peers)")
    ap.add_argument("--max-batch", type=int, default=MULTI, help="the app's max_batch (the example's is 4)")
    ap.add_argument("--max-wait-ms", type=float, default=None, help="the app's max_wait_ms (default: the example's)")
    ap.add_argument("--cache", default=None, help="engine cache directory (default: the node's)")
    ap.add_argument("--name", default="single_stream", help="stem of the result file")
    ap.add_argument("--out-dir", type=Path, default=None, help="write the result here instead of bench/results/<machine>/")
    args = ap.parse_args(argv)
    for flag, v in (("--requests", args.requests), ("--rounds", args.rounds), ("--max-batch", args.max_batch)):
        if v < 1:
            ap.error(f"{flag} must be >= 1, got {v}")
    if any(c < 1 for c in args.concurrency):
        ap.error(f"--concurrency must be >= 1 each, got {args.concurrency}")
    if args.trace < 0 or (args.only_trace and args.trace < 1):
        ap.error(f"--trace must be >= 0 (>= 1 with --only-trace), got {args.trace}")
    requests, rounds = (20, 1) if args.quick else (args.requests, args.rounds)
    concurrency = ([c for c in args.concurrency if c <= 2] or args.concurrency[:1]) if args.quick else args.concurrency
    trace_n = min(args.trace, 20) if args.quick else args.trace
    per_block = max(1, requests // rounds)
    load_before = os.getloadavg()
    app = example_app(args.max_batch, args.max_wait_ms)
    cfg = node_config(app, args.cache)
    shape = tuple(int(v) for v in app["input_shape"])
    todo, skipped = cases(args.transports, concurrency, args.max_batch)
    peers: list[str] = []
    for system in ([] if args.only_trace else args.peers):
        missing = missing_peer_modules(system)
        if missing:
            skipped.append(f"{system}: not installed here (no module {', '.join(missing)}; bench/peer's servers)")
        else:
            peers.append(system)
    if args.only_trace:
        todo = []
    ctx = mp.get_context("spawn")
    peer_cases = [(system, c, 1) for system in peers for c in concurrency]
    lat: dict[str, list[float]] = {case_key(*c): [] for c in todo + peer_cases}
    outcomes: dict[str, list[str]] = {k: [] for k in lat}
    eng: dict[str, list[float]] = {k: [] for k in lat}
    wall = dict.fromkeys(lat, 0.0)
    cpu = dict.fromkeys(lat, 0.0)
    batches: dict[str, dict[str, int]] = {k: {} for k in lat}
    share = plan_cpu_shares([("app-0", int(app["gpu_pct"]))])["app-0"]  # as the node plans the one app
    cores, threads = list(share.cores), share.threads
    final: dict[str, Any] = {}
    trace: dict[str, list[float]] = {}
    cmds, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_driver, args=(int(app["app_id"]), shape, cmds, out, available_cores()), daemon=True)
    proc.start()
    runner: Any = None
    try:
        with sv.running_node(cfg) as node:
            port = sv.port_of(node)
            inst = _instance(node)
            cores = list(inst.get("cores") or share.cores)
            with sv.pinned(cores, threads):  # the engine alone: built on the instance's cores, its threads
                runner = load_runner(app["model"], app["engine"], threads, cache=args.cache)
            door = start_frontdoor(cfg.apps, ("127.0.0.1", port), http_port=0, grpc_port=0, ingest=node.ingest)
            try:
                assert door.http_url is not None and door.grpc_target is not None
                targets = {"udp": f"127.0.0.1:{port}", "http": door.http_url.removeprefix("http://"),
                           "grpc": door.grpc_target}
                for r in range(rounds if todo else 0):
                    for transport, c, query in todo[r % len(todo):] + todo[:r % len(todo)]:
                        key = case_key(transport, c, query)
                        before = _instance(node).get("batch_sizes")
                        cmds.put(("run", transport, targets[transport], c, query, per_block))
                        res = _take(node, proc, out, (WARMUP * c + per_block) * (CLIENT_TIMEOUT_S + 1) + 120)
                        for size, n in _batch_delta(_instance(node).get("batch_sizes"), before).items():
                            batches[key][size] = batches[key].get(size, 0) + n
                        lat[key] += res["latency_ms"]
                        outcomes[key] += res["outcomes"]
                        wall[key] += res["wall_s"]
                        cpu[key] += res["client_cpu_s"]
                        b = engine_batch(c, query, args.max_batch)
                        with sv.pinned(cores, threads):
                            eng[key] += sv.model_latency_ms(runner, shape, b, reps=min(per_block, 200)).tolist()
                        print(f"{key}: p50 {np.median(res['latency_ms']):.3f} ms, engine b{b} "
                              f"{np.median(eng[key]):.3f} ms", flush=True)
                final = _instance(node)
            finally:
                door.close()
        if trace_n:
            trace = _trace_run(cfg, proc, cmds, out, trace_n)
            print("stage trace (p50 ms): " + ", ".join(
                f"{k} {np.median(v):.3f}" for k, v in trace.items() if v), flush=True)
        with tempfile.TemporaryDirectory(prefix="single-stream-peers-") as work:
            for system in peers:  # one at a time, the node stopped
                with peer_server(system, app, cores, threads, Path(work), args.cache) as server:
                    for _round in range(rounds):
                        for c in [pc[1] for pc in peer_cases if pc[0] == system]:
                            key = case_key(system, c, 1)
                            cmds.put(("run", system, server.target, c, 1, per_block))
                            res = _take(None, proc, out, (WARMUP * c + per_block) * (CLIENT_TIMEOUT_S + 1) + 120)
                            lat[key] += res["latency_ms"]
                            outcomes[key] += res["outcomes"]
                            wall[key] += res["wall_s"]
                            cpu[key] += res["client_cpu_s"]
                            b = engine_batch(c, 1, args.max_batch)
                            with sv.pinned(cores, threads):
                                eng[key] += sv.model_latency_ms(runner, shape, b, reps=min(per_block, 200)).tolist()
                            print(f"{key}: p50 {np.median(res['latency_ms']):.3f} ms", flush=True)
    finally:
        cmds.put(("stop",))
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join()
        if runner is not None:
            with contextlib.suppress(Exception):
                runner.close()
    summary: dict[str, Any] = {}
    for transport, c, query in todo + peer_cases:
        key = case_key(transport, c, query)
        s = summarise_case(lat[key], outcomes[key], eng[key], wall[key], query)
        s["engine_batch"] = engine_batch(c, query, args.max_batch)
        s["client_cpu_ms_per_request"] = round(cpu[key] * 1e3 / max(len(lat[key]), 1), 3)
        if transport not in PEERS:
            s["batch_sizes"] = batches[key]
        for k, v in s.items():
            summary[f"{key}.{k}"] = v
    for stage, v in (final.get("stages") or {}).items():
        if isinstance(v, dict):
            summary[f"instance_stages.{stage}.p50_ms"] = v.get("p50_ms")
            summary[f"instance_stages.{stage}.p99_ms"] = v.get("p99_ms")
    if trace_n:
        summary.update(summarise_trace(trace))
    summary.update({"engine": app["engine"], "model": app["model"], "input_shape": "x".join(map(str, shape)),
                    "slo_ms": app["slo_ms"], "gpu_pct": app["gpu_pct"], "max_batch": args.max_batch,
                    "max_wait_ms": app["max_wait_ms"], "requests_per_case": per_block * rounds, "rounds": rounds,
                    "instance_cores": cores, "instance_engine": (final.get("engine") or {}).get("kind"),
                    "peers": peers, "peer_engines": {p: (app["engine"] if p == "litserve" else "eager") for p in peers},
                    "skipped": skipped})
    notes = ("CPU backend (no GPU): the instance holds one core of two; the node's ingest, front door and control "
             "loop, this process and the driver share the other. Closed loops: each client sends its next request "
             "when it has the answer to the last. engine_ms: gpuprims' engine of the app's kind alone, back to back, "
             "in this process on the instance's cores and threads, at min(concurrency, max_batch) (8 for "
             "MultiStream), measured right after each block of its case. added_p99_ms = client p99 - engine p50. "
             "batch_sizes: the instance's batches during the case (warm-up requests included). Peers: started one "
             "at a time after the node stopped, on the instance's cores and threads; Ray Serve runs torch eager "
             "(bench/peer_ray has no ONNX Runtime engine). trace.*: a node of its own with the instances' stage "
             "trace on (one JSON line written per request after its answer), single requests one at a time."
             + load_note(load_before))
    samples = {"latency_ms": {k: [round(v, 4) for v in vs] for k, vs in lat.items()}, "outcomes": outcomes,
               "engine_ms": {k: [round(v, 4) for v in vs] for k, vs in eng.items()}, "instance": final,
               "trace_ms": {k: [round(v, 4) for v in vs] for k, vs in trace.items()}}
    path = write_result("single_stream", "cpu", summary, samples, notes=notes, large_samples=True,
                        load_avg_before=load_before,
                        name=f"{args.name}-quick" if args.quick and args.name == "single_stream" else args.name,
                        out_dir=args.out_dir)
    print(path)
    for k, v in summary.items():
        print(f"{k:>45}: {v}")
    return path


if __name__ == "__main__":
    main()
