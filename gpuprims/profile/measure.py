"""Measure a model's profile on this machine: latency p50/p99 and peak memory per (batch, GPU%).

Every point runs in a fresh ``spawn`` process whose share is applied before torch initialises:

- ``cuda``: ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=<gpu_pct>`` in the environment before torch is
  imported. The share is only enforced when an MPS control daemon is running; without one the point
  is still measured (at the whole GPU) and the profile's ``device`` says so.
- ``cpu``: the share of cores that ``gpuprims.cpushare.plan_cpu_shares`` gives ``gpu_pct`` (affinity
  and thread count), with ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` set before torch is imported.

Latency is timed per forward pass (CUDA events on cuda, ``perf_counter_ns`` on cpu) after warm-up
passes. Peak memory is ``torch.cuda.max_memory_allocated`` on cuda and, on cpu, the growth of the
process's peak resident set (``getrusage`` ru_maxrss) over its size after importing torch, before the
model was built.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from apps.zoo import load_model
from gpuprims._version import __version__
from gpuprims.backend import resolve_backend
from gpuprims.coexec.fx_exec import partition, profile_subgraphs
from gpuprims.cpushare import apply_cpu_share, plan_cpu_shares
from gpuprims.engines import EngineCache, EngineError, ModelSource, Target, check_engine, make_engine
from gpuprims.profile.format import Profile, ProfilePoint, StageEntry, with_stages
from gpuprims.profile.knee import knee

MPS_PIPE_DIR = "/tmp/nvidia-mps"


@dataclass(frozen=True)
class PointSpec:
    """What one child process measures."""

    model: str
    batch_size: int
    gpu_pct: int
    backend: str
    input_shape: tuple[int, ...]
    repeats: int
    warmup: int
    width: float
    seed: int
    cores: tuple[int, ...] | None
    # The model runner measured (gpuprims.engines; apps.yaml ``engine:``), so Multi-Model sizes an app
    # from what its engine does; ``max_batch`` is the engine's (the largest batch profiled).
    engine: str = "eager"
    engine_options: tuple[tuple[str, Any], ...] = ()
    engine_cache: str | None = None
    max_batch: int = 1


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _apply_share(spec: PointSpec) -> None:
    """Give THIS (fresh) process the point's share before torch initialises: the MPS percentage on
    cuda, a core set and thread count on the CPU backend."""
    if spec.backend == "cuda":
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(spec.gpu_pct)
        return
    share = plan_cpu_shares([("profile", spec.gpu_pct)], list(spec.cores) if spec.cores else None)["profile"]
    os.environ.update(share.env())
    apply_cpu_share(share)


def measure_point(spec: PointSpec) -> dict[str, Any]:
    """Measure one point in THIS process; call it only in a fresh process (it sets the share first).

    Returns a ProfilePoint-shaped dict plus ``"device"`` and ``"torch"``.
    """
    _apply_share(spec)

    base_rss_mb = _rss_mb()  # after torch's own import, so only the model and its activations count

    device = torch.device("cuda" if spec.backend == "cuda" else "cpu")
    engine = None
    if spec.engine == "eager":
        model = load_model(spec.model, seed=spec.seed, input_shape=tuple(spec.input_shape), width=spec.width,
                           device=device)
    else:  # built or taken from the cache before anything is timed, as an instance does at start
        engine = _prepared_engine(spec, torch.get_num_threads())
        model = engine
    gen = torch.Generator().manual_seed(spec.seed)
    x = torch.rand((spec.batch_size, *spec.input_shape), generator=gen).to(device)
    times_ms: list[float] = []
    with torch.inference_mode():
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            for _ in range(spec.warmup):
                model(x)
            torch.cuda.synchronize()
            for _ in range(spec.repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                model(x)
                end.record()
                end.synchronize()
                times_ms.append(start.elapsed_time(end))
            peak_mb = torch.cuda.max_memory_allocated() / 2**20
            name = torch.cuda.get_device_name(0)
            mps = os.path.exists(os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", MPS_PIPE_DIR), "control"))
            dev = name + ("" if mps else " (no MPS daemon: GPU% not enforced)")
        else:

            for _ in range(spec.warmup):
                model(x)
            for _ in range(spec.repeats):
                t0 = time.perf_counter_ns()
                model(x)
                times_ms.append((time.perf_counter_ns() - t0) / 1e6)
            peak_mb = max(0.0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base_rss_mb)
            # What the child actually got, not what was asked for: affinity set and torch threads.
            dev = (f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores; this share: "
                   f"{len(os.sched_getaffinity(0))} cores, {torch.get_num_threads()} threads)")
    if engine is not None:
        dev += f"; engine {spec.engine}" + "".join(f" {k}={v}" for k, v in spec.engine_options)
        engine.close()
    a = np.asarray(times_ms)
    p50 = float(np.percentile(a, 50))
    return {"batch_size": spec.batch_size, "gpu_pct": spec.gpu_pct, "latency_p50_ms": p50,
            "latency_p99_ms": float(np.percentile(a, 99)), "peak_mem_mb": float(peak_mb),
            "throughput_rps": spec.batch_size * 1000.0 / p50, "device": dev, "torch": torch.__version__}


def _prepared_engine(spec: PointSpec, threads: int) -> Any:
    """The point's engine (``spec.engine``), prepared: built, or taken from the engine cache."""
    shape = tuple(spec.input_shape)
    source = ModelSource(spec.model, (shape[0], shape[1], shape[2]), max(spec.max_batch, spec.batch_size),
                         seed=spec.seed)
    engine = make_engine(spec.engine, source, Target(spec.backend, 0, threads), dict(spec.engine_options),
                         cache=EngineCache(spec.engine_cache))
    engine.prepare()
    return engine


def check_engine_args(engine: str, options: dict[str, Any], backend: str, input_shape: Sequence[int],
                      width: float) -> None:
    """Refuse an engine this backend cannot run, or a profile an engine cannot take, with the reason."""
    if engine == "eager" and not options:
        return
    try:
        check_engine(engine, backend, options)
    except EngineError as e:
        raise ValueError(f"--engine {engine}: {e}") from None
    if len(tuple(input_shape)) != 3:
        raise ValueError(f"--engine {engine} needs a 3-dimensional --input-shape (C,H,W), got {list(input_shape)}")
    if width != 1.0 and engine != "eager":
        raise ValueError(f"--engine {engine} builds the model at width 1 (as a node does); drop --width {width}")


def measure_stages(spec: PointSpec) -> list[dict[str, Any]]:
    """Per-subgraph latencies of ``spec.model`` at ``spec.batch_size`` in THIS (fresh) process.

    The model is cut by ``gpuprims.coexec.fx_exec.partition`` (DUET's phases and branches) and each
    subgraph timed alone on this device with its real inputs. Returns StageEntry-shaped dicts whose
    latency is keyed ``"cpu"`` on the CPU backend and ``"gpu"`` on cuda.
    """
    _apply_share(spec)

    device = torch.device("cuda" if spec.backend == "cuda" else "cpu")
    model = load_model(spec.model, seed=spec.seed, input_shape=tuple(spec.input_shape), width=spec.width)
    part = partition(model)
    x = torch.rand((spec.batch_size, *spec.input_shape), generator=torch.Generator().manual_seed(spec.seed))
    prof = profile_subgraphs(part, [x], device=device, repeats=spec.repeats, warmup=spec.warmup)
    key = "gpu" if device.type == "cuda" else "cpu"
    return [{"name": s.name, "deps": list(part.deps[s.name]), "latency_ms": {key: prof[s.name]["latency_ms"]},
             "out_mb": prof[s.name]["out_mb"], "source": f"measured: {s.kind} subgraph of {len(s.nodes)} fx nodes"}
            for s in part.subgraphs]


def parse_int_list(text: str, *, label: str, lo: int = 1, hi: int | None = None,
                   ordered: bool = False) -> list[int]:
    """"4,1,2" -> [1, 2, 4] (sorted, unique; as written with ``ordered``); ValueError naming the bad item."""
    out: list[int] = []
    for item in text.split(","):
        item = item.strip()
        try:
            v = int(item)
        except ValueError:
            raise ValueError(f"{label}: {item!r} is not an integer (in {text!r})") from None
        if v < lo or (hi is not None and v > hi):
            rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
            raise ValueError(f"{label}: {v} must be {rng} (in {text!r})")
        out.append(v)
    return out if ordered else sorted(set(out))


def measure_profile(model: str, *, batch_sizes: Sequence[int], gpu_pcts: Sequence[int], backend: str = "auto",
                    input_shape: Sequence[int] = (3, 224, 224), repeats: int = 20, warmup: int = 3,
                    width: float = 1.0, seed: int = 0, cores: Sequence[int] | None = None,
                    timeout_s: float = 600.0, progress: bool = True,
                    on_point: Callable[[dict[str, Any]], None] | None = None, device_kind: str | None = None,
                    stages: bool = False, engine: str = "eager", engine_options: dict[str, Any] | None = None,
                    engine_cache: str | None = None) -> Profile:
    """Measure ``model`` (a zoo name or ``module:factory``) at every (batch, GPU%) and return the profile.

    Each point runs in its own spawn process (module docstring). ``device_kind="cpu"`` measures the
    CPU overflow pool of a co-executing node: the CPU backend over ``cores`` (default: every core this
    process may use), recorded with ``device_kind`` and ``cpu_cores`` (format version 2);
    ``"accelerator"`` the accelerator (the auto/cuda backend). ``stages`` also times each DUET
    subgraph alone at the smallest batch and full share, in one more process. ``engine`` (with
    ``engine_options``) measures that model runner (gpuprims.engines) instead of eager torch, built once
    into ``engine_cache`` (each point's process then loads it from there). Raises ValueError for
    bad arguments, RuntimeError naming the point when a child fails or exceeds ``timeout_s``.
    """
    if not model:
        raise ValueError("model must be non-empty")
    bs = sorted({int(b) for b in batch_sizes})
    gs = sorted({int(g) for g in gpu_pcts})
    if not bs or bs[0] < 1:
        raise ValueError(f"batch sizes must be >= 1, got {list(batch_sizes)}")
    if not gs or gs[0] < 1 or gs[-1] > 100:
        raise ValueError(f"gpu_pcts must be in 1..100, got {list(gpu_pcts)}")
    if repeats < 2:
        raise ValueError(f"repeats must be >= 2, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    shape = tuple(int(d) for d in input_shape)
    if not shape or any(d < 1 for d in shape):
        raise ValueError(f"input_shape must be positive integers, got {list(input_shape)}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if device_kind not in (None, "accelerator", "cpu"):
        raise ValueError(f"device_kind must be 'accelerator' or 'cpu', got {device_kind!r}")
    if device_kind == "cpu":
        if backend not in ("auto", "cpu"):
            raise ValueError(f"device_kind 'cpu' measures the CPU backend, not {backend!r}")
        backend = "cpu"
        if cores is None:
            cores = sorted(os.sched_getaffinity(0))
    be = resolve_backend(backend)
    if device_kind == "accelerator" and be != "cuda":
        raise ValueError("device_kind 'accelerator' needs a GPU (the cuda backend); none is usable here")
    options = dict(engine_options or {})
    check_engine_args(engine, options, be, shape, width)
    if stages and engine != "eager":
        raise ValueError(f"--stages times torch.fx subgraphs of the eager model; not with --engine {engine}")
    specs = [PointSpec(model, b, g, be, shape, repeats, warmup, float(width), seed,
                       tuple(cores) if cores is not None else None, engine, tuple(sorted(options.items())),
                       engine_cache, bs[-1]) for b in bs for g in gs]

    points: list[dict[str, Any]] = []
    ctx = get_context("spawn")
    bar = tqdm(specs, desc=f"profile {model} ({be})", unit="point", disable=not progress, file=sys.stderr)
    try:
        for spec in bar:
            bar.set_postfix(batch=spec.batch_size, gpu_pct=spec.gpu_pct)
            # The worker ignores Ctrl-C (the terminal sends it to the whole group): this loop stops it.
            with ProcessPoolExecutor(max_workers=1, mp_context=ctx, initializer=signal.signal,
                                     initargs=(signal.SIGINT, signal.SIG_IGN)) as pool:
                fut = _submit_shielded(pool, measure_point, spec)
                try:
                    res = fut.result(timeout=timeout_s)
                except FutureTimeout:
                    _kill_workers(pool)
                    raise RuntimeError(f"profiling {model} batch={spec.batch_size} gpu_pct={spec.gpu_pct} took "
                                       f"longer than timeout_s={timeout_s}") from None
                except KeyboardInterrupt:
                    _kill_workers(pool)
                    raise
                except Exception as e:
                    raise RuntimeError(f"profiling {model} batch={spec.batch_size} gpu_pct={spec.gpu_pct} "
                                       f"failed: {type(e).__name__}: {e}") from e
            points.append(res)
            if on_point is not None:
                on_point(res)
    except KeyboardInterrupt:
        bar.close()
        rows = [b for b in bs if sum(p["batch_size"] == b for p in points) == len(gs)]
        partial = _profile(model, be, specs, rows, gs, shape, repeats,
                           [p for p in points if p["batch_size"] in rows]) if rows else None
        raise ProfileInterrupted(points, len(specs), partial) from None
    prof = _profile(model, be, specs, bs, gs, shape, repeats, points)
    stage_rows: list[dict[str, Any]] = []
    if stages:
        spec = PointSpec(model, bs[0], gs[-1], be, shape, repeats, warmup, float(width), seed,
                         tuple(cores) if cores is not None else None)
        with ProcessPoolExecutor(max_workers=1, mp_context=ctx, initializer=signal.signal,
                                 initargs=(signal.SIGINT, signal.SIG_IGN)) as pool:
            fut = _submit_shielded(pool, measure_stages, spec)
            try:
                stage_rows = fut.result(timeout=timeout_s)
            except FutureTimeout:
                _kill_workers(pool)
                raise RuntimeError(f"profiling the stages of {model} took longer than timeout_s={timeout_s}") from None
            except KeyboardInterrupt:
                _kill_workers(pool)
                raise ProfileInterrupted(points, len(specs), prof) from None
            except Exception as e:
                raise RuntimeError(f"profiling the stages of {model} failed: {type(e).__name__}: {e}") from e
    if device_kind is None and not stage_rows:
        return prof
    return with_stages(prof, [StageEntry(**r) for r in stage_rows], device_kind=device_kind,  # type: ignore[arg-type]
                       cpu_cores=len(cores) if device_kind == "cpu" and cores is not None else None)


class ProfileInterrupted(KeyboardInterrupt):
    """Ctrl-C during `measure_profile`: ``points`` were measured (of ``total``); ``partial`` is the
    profile of the batch sizes measured at every GPU% (None if no batch size was complete)."""

    def __init__(self, points: list[dict[str, Any]], total: int, partial: Profile | None) -> None:
        super().__init__(f"interrupted after {len(points)} of {total} points")
        self.points, self.total, self.partial = points, total, partial


def _submit_shielded(pool: ProcessPoolExecutor, fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """Submit with Ctrl-C held off while the worker process is spawned.

    SIGINT is blocked in this thread, so the worker inherits the blocked mask (its initializer then
    ignores SIGINT) and a Ctrl-C that lands while it is still importing never gives it a traceback.
    The mask alone does not hold off Python's KeyboardInterrupt: the kernel hands the signal to another
    thread (tqdm's monitor, the pool's manager), whose C handler trips the flag the main thread acts on,
    possibly between the worker's start and the write of its start-up data (the worker then dies on an
    EOFError with a traceback). So a handler that only notes the signal is installed for the submit; a
    noted Ctrl-C is handed to the handler it replaced once the submit is done, and if that raises
    (KeyboardInterrupt by default), the new worker is killed first.
    """
    old_handler = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(old_handler):
        # Handlers belong to the main thread (no Ctrl-C lands elsewhere); and a process that ignores
        # SIGINT (a background job) or dies of it has nothing to defer.
        return _submit_masked(pool, fn, *args)
    noted: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: noted.append(signum))
    try:
        fut = _submit_masked(pool, fn, *args)
    finally:
        signal.signal(signal.SIGINT, old_handler)
    if noted:
        try:
            old_handler(signal.SIGINT, None)  # what the Ctrl-C would have done (KeyboardInterrupt by default)
        except BaseException:
            _kill_workers(pool)
            raise
    return fut


def _submit_masked(pool: ProcessPoolExecutor, fn: Callable[..., Any], *args: Any) -> Future[Any]:
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return pool.submit(fn, *args)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def _kill_workers(pool: ProcessPoolExecutor) -> None:
    for p in list(getattr(pool, "_processes", {}).values()):
        p.kill()


def _profile(model: str, be: str, specs: list[PointSpec], bs: list[int], gs: list[int], shape: tuple[int, ...],
             repeats: int, points: list[dict[str, Any]]) -> Profile:
    return Profile(
        model=model, source="measured", backend=be, device=points[0]["device"],
        source_note=f"gpuprims-profile, {asdict(specs[0]) | {'batch_size': bs, 'gpu_pct': gs}}",
        versions={"torch": points[0]["torch"], "gpuprims": __version__, "python": platform.python_version()},
        conditions={"input_shape": shape, "dtype": "float32",
                    "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
                    "repeats": repeats},
        points=[ProfilePoint(**{k: v for k, v in p.items() if k in ProfilePoint.model_fields}) for p in points],
    )


def plot_profile(profile: Profile, path: str | Path, *, tolerance: float = 0.10) -> Path:
    """Latency (p50) vs GPU% per batch size, knee marked (paper Fig. 2a); writes a PNG and returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for b in profile.batch_sizes:
        xs = profile.gpu_pcts
        ax.plot(xs, [profile.point(b, g).latency_p50_ms for g in xs], marker="o", label=f"batch {b}")
        k = knee(profile, b, tolerance=tolerance)
        ax.plot([k], [profile.latency_ms(b, k)], marker="*", markersize=14, color="k")
    ax.plot([], [], "k*", markersize=10, label=f"knee (within {tolerance:.0%} of full share)")
    ax.set_xlabel("GPU% (CPU backend: share of cores)" if profile.backend == "cpu" else "GPU%")
    ax.set_ylabel("latency p50 (ms)")
    ax.set_title(f"{profile.model} ({profile.source}, {profile.backend})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
