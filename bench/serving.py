"""Shared helpers for the benchmarks that measure a running node (e2e, overlap, multi, css).

A node built in code on loopback (CPU backend where there is no GPU), traffic from the traffic tool
sent in a thread while the main thread pumps the node's control loop, per-app figures from the
client's samples, and the model's own latency measured directly in torch on a given core share.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from gpuprims import wire
from gpuprims.traffic.report import Report
from gpuprims.traffic.stream import AppStream, Stream
from orchestrator.config.schema import NodeConfig, parse_config
from orchestrator.node.node import Node

POOL = {"slot_count": 8192, "max_chunks": 1024, "record_count": 512}


def app(name: str, model: str, app_id: int, *, shape: Sequence[int], slo_ms: float, gpu_pct: int,
        instances: int = 1, max_batch: int = 8, max_wait_ms: float = 0.0, shadow: bool = False) -> dict[str, Any]:
    """One app entry of the config (docs/apps-yaml.md)."""
    return {"name": name, "model": model, "app_id": app_id, "input_shape": list(shape), "dtype": "float32",
            "slo_ms": float(slo_ms), "gpu_pct": gpu_pct, "instances": instances, "max_batch": max_batch,
            "max_wait_ms": float(max_wait_ms), "shadow": shadow}


def node_config(apps: list[dict[str, Any]], *, oversubscribe: bool = False, scheduler: str = "spatial") -> NodeConfig:
    """A loopback CPU-backend node on an ephemeral port with a small pool."""
    return parse_config({"node": {"backend": "cpu", "listen": {"host": "127.0.0.1", "port": [0]}, "pool": POOL,
                                  "allow_oversubscribe": oversubscribe, "scheduler": scheduler,
                                  "log_level": "WARNING"},
                         "apps": apps}, source="bench")


@contextlib.contextmanager
def running_node(cfg: NodeConfig, *, warmup: bool = True) -> Iterator[Node]:
    """A started node (heartbeats every 100 ms), always stopped on the way out."""
    node = Node(cfg, heartbeat_ms=100, warmup=warmup)
    try:
        node.start()
        yield node
    finally:
        node.stop()


def port_of(node: Node) -> int:
    assert node.ingest is not None
    return int(node.ingest.ports[0])


def stream(app_id: int, shape: Sequence[int], rate: float, duration_s: float, port: int, *,
           process: str = "constant") -> AppStream:
    return AppStream(app_id=app_id, shape=tuple(shape), dtype="float32", rate=rate, process=process,
                     duration_s=duration_s, to=("127.0.0.1", port))


def drive(node: Node | None, streams: list[AppStream], *, timeout_s: float, slo_ms: float | None,
          seed: int = 1, warmup_s: float = 1.0, during: Any = None) -> Report:
    """Send `streams` with the traffic tool in a thread; meanwhile pump the node's control loop.

    `during(node, sending)`, if given, runs once in the main thread while the traffic flows (a
    reconfiguration, which pumps the control loop itself); `sending()` is true until the run ends.
    Afterwards the loop is pumped until the run ends.
    """
    from gpuprims.traffic.runner import run

    result: dict[str, Any] = {}

    def traffic() -> None:
        try:
            result["report"] = run(Stream(streams, seed=seed, warmup_s=warmup_s), timeout_s=timeout_s, slo_ms=slo_ms)
        except BaseException as e:  # surfaced in the main thread below
            result["error"] = e

    t = threading.Thread(target=traffic, name="traffic")
    t.start()
    if during is not None:
        during(node, t.is_alive)
    while t.is_alive():
        if node is not None:
            node.step(50)
        else:
            t.join(0.05)
    t.join()
    if node is not None:
        for _ in range(3):
            node.step(50)  # last heartbeats
    if "error" in result:
        raise result["error"]
    return result["report"]


def app_stats(report: Report, app_id: int, slo_ms: float) -> dict[str, Any]:
    """Client-side figures of one app's measured (non-warm-up) requests; percentiles over OK answers."""
    s = report.samples
    m = (s["app_id"] == app_id) & ~s["warmup"] & (s["sent_ns"] >= 0)
    sent = int(m.sum())
    ans = m & (s["state"] == 1)
    ok = ans & (s["status"] == int(wire.Status.OK))
    lat = s["latency_ns"][ok] / 1e6  # a DEADLINE_MISSED answer comes back fast; it is not a latency
    good = int((ok & (s["latency_ns"] <= slo_ms * 1e6)).sum())
    window = max(float(report.summary["rate"]["window_s"]), 1e-9)

    def pct(p: float) -> float | None:
        return round(float(np.percentile(lat, p)), 3) if lat.size else None

    return {"sent": sent, "answered": int(ans.sum()), "ok": int(ok.sum()), "lost": sent - int(ans.sum()),
            "duplicates": int(np.maximum(s["answers"][m].astype(np.int64) - 1, 0).sum()),
            "p50_ms": pct(50), "p99_ms": pct(99), "p99.9_ms": pct(99.9),
            "slo_attainment": round(good / sent, 4) if sent else None,
            "offered_rps": round(sent / window, 2), "goodput_rps": round(good / window, 2)}


def latencies_ms(report: Report, app_id: int) -> np.ndarray:
    """Latency (ms) of the app's measured requests answered OK in time."""
    s = report.samples
    m = (s["app_id"] == app_id) & ~s["warmup"] & (s["state"] == 1) & (s["status"] == int(wire.Status.OK))
    return s["latency_ns"][m] / 1e6


@contextlib.contextmanager
def pinned(cores: Sequence[int], threads: int) -> Iterator[None]:
    """Run the calling thread on `cores` with `threads` torch threads; restore both afterwards."""
    import torch

    old_aff, old_threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, list(cores))
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)
        os.sched_setaffinity(0, old_aff)


def torch_latency_ms(model_name: str, shape: Sequence[int], batch: int, *, cores: Sequence[int], threads: int,
                     reps: int, seed: int = 0) -> np.ndarray:
    """Latency (ms) of the zoo model itself at `batch`, in this process on `cores` with `threads` threads.

    Times what an instance times around its model call (the forward pass and the copy of the logits
    to numpy), after two warm-up calls.
    """

    from apps.zoo import load_model

    with pinned(cores, threads):
        model = load_model(model_name, seed=seed, input_shape=tuple(shape)).eval()
        return model_latency_ms(model, shape, batch, reps=reps, seed=seed)


def model_latency_ms(model: Any, shape: Sequence[int], batch: int, *, reps: int, seed: int = 0) -> np.ndarray:
    """Latency (ms) of `model` (a torch module or a prepared gpuprims engine) at `batch`, back to back in
    this thread: the call and the copy of its output to numpy, after two warm-up calls."""
    import torch

    x = torch.from_numpy(np.random.default_rng(seed).random((batch, *shape), dtype=np.float32))
    out = np.empty(reps)
    with torch.inference_mode():
        for _ in range(2):
            model(x)
        for i in range(reps):
            t = time.perf_counter_ns()
            model(x).float().cpu().numpy()
            out[i] = (time.perf_counter_ns() - t) / 1e6
    return out


def instance_stats(node: Node, app_name: str) -> dict[str, Any]:
    """The node's own view of an app (status), trimmed to the figures a bench reports."""
    a = node.status()["apps"][app_name]
    keep = ("received", "ok", "deadline_missed", "errors", "p50_ms", "p99_ms", "slo_attainment", "gpu_pct")
    out = {k: a.get(k) for k in keep}
    out["instances"] = [{k: i.get(k) for k in ("name", "role", "gpu_pct", "cores", "model_p50_ms", "p50_ms",
                                               "p99_ms", "batch_sizes", "stages", "engine")} for i in a["instances"]]
    return out


def ramp(rates_rps: Sequence[float], segment_s: float, *, warmup_rps: float, warmup_s: float = 1.0
         ) -> tuple[list[float], list[tuple[int, int, float]]]:
    """Inter-request intervals (s) of a constant-rate staircase, and each step's (start_ns, end_ns, rate).

    The first `warmup_s` at `warmup_rps` is the warm-up (Stream(warmup_s=...) marks it); then each rate
    for `segment_s`. Offsets are from the run's t0, as in the report's `sched_ns`.
    """
    times = list(np.arange(0.0, warmup_s, 1.0 / warmup_rps))
    bounds = []
    t = warmup_s
    for r in rates_rps:
        start = t
        times += list(start + np.arange(0.0, segment_s, 1.0 / r))
        t = start + segment_s
        bounds.append((round(start * 1e9), round(t * 1e9), float(r)))
    return list(np.diff(times)), bounds


def ramp_stats(report: Report, app_id: int, slo_ms: float, bounds: list[tuple[int, int, float]]) -> list[dict[str, Any]]:
    """Per step of a `ramp`: requests sent, SLO attainment (answered OK within the SLO / sent), p50/p99."""
    s = report.samples
    out = []
    for lo, hi, rate in bounds:
        m = (s["app_id"] == app_id) & (s["sent_ns"] >= 0) & (s["sched_ns"] >= lo) & (s["sched_ns"] < hi)
        sent = int(m.sum())
        ok = m & (s["state"] == 1) & (s["status"] == int(wire.Status.OK))
        lat = s["latency_ns"][ok] / 1e6
        good = int((ok & (s["latency_ns"] <= slo_ms * 1e6)).sum())
        out.append({"rate_rps": round(rate, 2), "sent": sent, "ok": int(ok.sum()),
                    "slo_attainment": round(good / sent, 4) if sent else None,
                    "p50_ms": round(float(np.percentile(lat, 50)), 3) if lat.size else None,
                    "p99_ms": round(float(np.percentile(lat, 99)), 3) if lat.size else None})
    return out


def held_rate(steps: list[dict[str, Any]], target: float = 0.99) -> dict[str, Any] | None:
    """The highest step meeting `target` attainment, looking up the staircase until two steps in a row miss."""
    best, misses = None, 0
    for st in steps:
        if st["slo_attainment"] is not None and st["slo_attainment"] >= target:
            best, misses = st, 0
        else:
            misses += 1
            if misses == 2:
                break
    return best
