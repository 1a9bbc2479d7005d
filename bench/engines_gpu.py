"""The GPU engines on a GPU host, in one run: build, check against eager, and time each engine on the zoo
models at batch 1 and max batch, into one JSON (docs/gpu-machine.md step 4, docs/engines-gpu.md).

    python3 -m bench.engines_gpu [--quick] [--fake] [--models mobilenet_v2,resnet50] [--max-batch 8]
                                 [--cache DIR] [--out DIR]
    scripts/gpu-engines.sh        # the same, with the defaults

Engines: ``eager`` (the reference), ``cudagraph``, ``tensorrt`` fp32 and fp16, and ONNX Runtime with
the CUDA and TensorRT execution providers (``onnxruntime``, where this build has that engine). For
each model and engine: the build (or cache) time, whether the outputs equal eager's within the engine's
stated tolerance at batch 1 and max batch (and the largest difference), and the latency of back-to-back
runs (CUDA events around each run on the instance-like stream, plus wall time; p50/p99 with the raw
samples), with the ratio to eager. An engine that cannot run here is listed with the reason, never
dropped. Nothing is asserted: the JSON answers the open questions (does each GPU engine build, match
eager and beat it, by how much, at which batch) on a first GPU run in minutes.

``--fake`` runs the same code on the fake CUDA runtime (no GPU; the figures are the CPU's and mean
nothing, the run proves the script and the engines' paths end to end). Output: ``bench/results/<gpu>/
engines_gpu.json`` (``engines_gpu-fake.json`` on the fake runtime), or ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import git_commit, machine_info, machine_name, percentiles
from gpuprims.cuda import runtime
from gpuprims.engines import KINDS, EngineCache, EngineError, ModelSource, Target, make_engine

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("mobilenet_v2", "resnet50", "resnext50", "vgg19", "alexnet")
#: name -> (kind, options)
ENGINES: dict[str, tuple[str, dict[str, Any]]] = {
    "eager": ("eager", {}),
    "cudagraph": ("cudagraph", {}),
    "tensorrt-fp32": ("tensorrt", {"precision": "fp32"}),
    "tensorrt-fp16": ("tensorrt", {"precision": "fp16"}),
    "onnxruntime-cuda": ("onnxruntime", {"provider": "cuda"}),
    "onnxruntime-tensorrt": ("onnxruntime", {"provider": "tensorrt"}),
}


def _stream(device: int) -> Any:
    """The instance-like stream the engines run on: a gpuprims Stream (fake) or a torch stream (GPU)."""
    if runtime.is_fake():
        from gpuprims.cuda.event import Stream

        return Stream(device)
    import torch

    return torch.cuda.Stream(device)


def _run_once(eng: Any, x: Any, stream: Any) -> Any:
    """One run issued on ``stream`` (eager under torch's stream context on a GPU, synchronously on the
    fake); returns the output."""
    if getattr(eng, "asynchronous", False) or runtime.is_fake():
        return eng.run(x)
    import torch

    with torch.cuda.stream(stream):
        return eng.run(x)


def _timed(eng: Any, x: Any, stream: Any, iters: int, device: int) -> dict[str, Any]:
    """Back-to-back runs: per run, CUDA events around it on the stream (device time) and the wall time
    until the end event completes (what a caller waits)."""
    from gpuprims.cuda.event import Event

    start, end = Event(device, timing=True), Event(device, timing=True)
    dev_ms, wall_ms = [], []
    try:
        for _ in range(iters):
            t0 = time.perf_counter()
            start.record(stream)
            _run_once(eng, x, stream)
            end.record(stream)
            end.synchronize()
            wall_ms.append((time.perf_counter() - t0) * 1e3)
            dev_ms.append(start.elapsed_time(end))
    finally:
        start.close()
        end.close()
    return {"device_ms": dev_ms, "wall_ms": wall_ms}


def _output(eng: Any, x: Any, stream: Any) -> np.ndarray:
    out = _run_once(eng, x, stream)
    if hasattr(eng, "synchronize"):
        eng.synchronize()
    elif not runtime.is_fake():
        import torch

        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
    return out.detach().float().cpu().numpy().copy()


def measure(model: str, name: str, kind: str, options: dict[str, Any], *, shape: tuple[int, int, int],
            max_batch: int, iters: int, cache: EngineCache, device: int,
            reference: dict[int, np.ndarray], inputs: dict[int, Any]) -> dict[str, Any]:
    """One engine on one model: build, equality at batch 1 and max, timing. Never raises: a failure is
    the row's ``error`` (an engine that cannot run here says why in ``skipped``)."""
    row: dict[str, Any] = {"engine": name, "kind": kind, "options": options}
    if kind not in KINDS:
        row["skipped"] = f"engine {kind!r} is not in this build (known: {', '.join(KINDS)})"
        return row
    source = ModelSource(model, shape, max_batch=max_batch)
    stream = _stream(device)
    eng = None
    try:
        eng = make_engine(kind, source, Target("cuda", device_index=device, stream=stream), options, cache=cache)
        t0 = time.perf_counter()
        info = eng.prepare()
        row.update(build_s=round(time.perf_counter() - t0, 3), cache_hit=info.cache_hit,
                   describe={k: v for k, v in eng.describe().items() if k not in ("options",)})
        rtol, atol = eng.tolerance
        row["tolerance"] = {"rtol": rtol, "atol": atol}
        samples: dict[str, Any] = {}
        for n in sorted(inputs):
            got = _output(eng, inputs[n], stream)
            want = reference[n]
            diff = float(np.max(np.abs(got - want)))
            row[f"max_abs_diff_b{n}"] = diff
            row[f"equal_b{n}"] = bool(np.allclose(got, want, rtol=rtol, atol=atol))
            t = _timed(eng, inputs[n], stream, iters, device)
            samples[f"b{n}"] = t
            for key, vals in (("device", t["device_ms"]), ("wall", t["wall_ms"])):
                pct = percentiles(vals, (50, 99))
                row[f"{key}_p50_ms_b{n}"] = round(pct["p50"], 4)
                row[f"{key}_p99_ms_b{n}"] = round(pct["p99"], 4)
        row["equal"] = all(row[f"equal_b{n}"] for n in inputs)
        row["samples"] = samples
    except EngineError as e:
        row["skipped" if type(e).__name__ == "EngineUnavailable" else "error"] = f"{type(e).__name__}: {e}"
    except Exception as e:  # a failed engine is a finding of the run, not its end
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        if eng is not None:
            try:
                eng.close()
            except Exception as e:
                row.setdefault("error", f"close: {type(e).__name__}: {e}")
        if hasattr(stream, "close"):
            stream.close()
    return row


def run(models: list[str], *, shape: tuple[int, int, int], max_batch: int, iters: int, cache: EngineCache,
        device: int = 0, engines: list[str] | None = None) -> dict[str, Any]:
    """Every engine on every model; returns {"summary": ..., "samples": ...}."""
    import torch

    from gpuprims.gather import torch_device

    names = engines or list(ENGINES)
    summary: dict[str, Any] = {}
    samples: dict[str, Any] = {}
    tdev = torch_device("cuda", device)
    for model in models:
        rng = torch.Generator().manual_seed(0)
        batches = sorted({1, max_batch})
        inputs = {n: torch.rand((n, *shape), generator=rng).to(tdev) for n in batches}
        if not runtime.is_fake():
            torch.cuda.synchronize(device)  # the inputs are complete before any engine's stream reads them
        ref_module = ModelSource(model, shape, max_batch=max_batch).build_module(tdev)
        with torch.no_grad():
            reference = {n: ref_module(inputs[n]).float().cpu().numpy() for n in batches}
        del ref_module
        rows = {}
        for name in names:
            kind, options = ENGINES[name]
            row = measure(model, name, kind, options, shape=shape, max_batch=max_batch, iters=iters, cache=cache,
                          device=device, reference=reference, inputs=inputs)
            samples[f"{model}/{name}"] = row.pop("samples", {})
            rows[name] = row
        eager = rows.get("eager", {})
        for row in rows.values():
            for n in batches:
                base, mine = eager.get(f"device_p50_ms_b{n}"), row.get(f"device_p50_ms_b{n}")
                if base and mine:
                    row[f"speedup_vs_eager_b{n}"] = round(base / mine, 3)
        best: dict[str, Any] = {}
        for n in batches:  # the fastest engine (device p50) among those equal to eager
            ok = {k: r[f"device_p50_ms_b{n}"] for k, r in rows.items() if r.get("equal") and f"device_p50_ms_b{n}" in r}
            best[f"best_b{n}"] = min(ok, key=ok.__getitem__) if ok else None
        summary[model] = {**rows, **best}
    return {"summary": summary, "samples": samples}


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one small model, few iterations (a smoke run)")
    ap.add_argument("--fake", action="store_true", help="run on the fake CUDA runtime (no GPU; proves the paths)")
    ap.add_argument("--models", default=None, help=f"comma-separated zoo models (default {','.join(MODELS)})")
    ap.add_argument("--engines", default=None, help=f"comma-separated, of {','.join(ENGINES)} (default all)")
    ap.add_argument("--max-batch", type=int, default=None, help="max batch (default 8; --quick 4)")
    ap.add_argument("--iters", type=int, default=None, help="timed runs per engine and batch (default 50; --quick 5)")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--cache", type=Path, default=None, help="engine cache directory (default the per-user one)")
    ap.add_argument("--out", type=Path, default=None, help="directory for the JSON (default bench/results/<gpu>/)")
    args = ap.parse_args(argv)
    if args.fake:
        os.environ[runtime.FAKE_ENV] = os.environ.get(runtime.FAKE_ENV) or "1"
    elif not runtime.is_fake():
        from gpuprims.backend import cuda_available

        if not cuda_available():
            ap.error("no CUDA GPU is usable here; run on a GPU host, or with --fake to exercise the paths")
    models = args.models.split(",") if args.models else (["mobilenet_v2"] if args.quick else list(MODELS))
    engines = args.engines.split(",") if args.engines else None
    for e in engines or []:
        if e not in ENGINES:
            ap.error(f"unknown engine {e!r}; choose from {', '.join(ENGINES)}")
    max_batch = args.max_batch or (4 if args.quick else 8)
    if max_batch < 1:
        ap.error(f"--max-batch must be >= 1, got {max_batch}")
    iters = args.iters or (5 if args.quick else 50)
    shape = (3, 64, 64) if args.quick else (3, 224, 224)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    result = run(models, shape=shape, max_batch=max_batch, iters=iters, cache=EngineCache(args.cache),
                 device=args.device, engines=engines)
    is_fake = runtime.is_fake()
    machine = machine_info("cuda") if not is_fake else {"cpu_count": os.cpu_count(), "python": platform.python_version()}
    machine.update(fake_runtime=is_fake, load_avg_before=[round(x, 2) for x in load_before],
                   load_avg_after=[round(x, 2) for x in os.getloadavg()])
    doc = {"experiment": "engines_gpu", "command": " ".join(["python3 -m bench.engines_gpu", *(argv or sys.argv[1:])]),
           "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(), "git": git_commit(),
           "machine": machine, "settings": {"models": models, "input_shape": list(shape), "max_batch": max_batch,
                                            "iters": iters, "engines": engines or list(ENGINES)},
           "seconds": round(time.perf_counter() - t0, 1), "summary": result["summary"], "samples": result["samples"]}
    if is_fake:
        doc["notes"] = ("FAKE CUDA RUNTIME: no GPU was used; the times are the CPU's and mean nothing. This run "
                        "proves the script and the engines' code paths end to end.")
    out_dir = args.out or ROOT / "bench" / "results" / (f"cpu-{os.cpu_count()}core" if is_fake else machine_name("cuda"))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / ("engines_gpu-fake.json" if is_fake else "engines_gpu.json")
    path.write_text(json.dumps(doc, indent=1, default=str))
    for model, rows in result["summary"].items():
        for name, row in rows.items():
            if not isinstance(row, dict):
                continue
            state = row.get("skipped") or row.get("error") or (
                f"equal={row.get('equal')} b1 {row.get('device_p50_ms_b1')} ms, b{max_batch} "
                f"{row.get(f'device_p50_ms_b{max_batch}')} ms")
            print(f"  {model:14s} {name:22s} {state}")
    print(f"engines_gpu: wrote {path}")
    return path


if __name__ == "__main__":
    main()
