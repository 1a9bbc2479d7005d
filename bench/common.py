"""Shared helpers for benchmarks: machine description, result files as CONTRIBUTING.md (Benchmarks) describes, stats.

A benchmark reports; it never asserts a speed.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return 0.0


def gpu_info() -> dict[str, Any]:
    """GPU name/count/driver/CUDA runtime via torch, or an empty description without a GPU."""
    from gpuprims.backend import cuda_available

    if not cuda_available():
        return {"gpu_name": None, "gpu_count": 0, "driver": None, "cuda_runtime": None}
    import torch

    name = torch.cuda.get_device_name(0)
    driver = None
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return {"gpu_name": name, "gpu_count": torch.cuda.device_count(), "driver": driver,
            "cuda_runtime": torch.version.cuda}


def machine_name(backend: str) -> str:
    """`h100`/`h200`/... for a GPU run, else `cpu-<N>core` (CONTRIBUTING.md, Benchmarks)."""
    if backend == "cuda":
        name = (gpu_info()["gpu_name"] or "gpu").lower()
        for short in ("h200", "h100", "a100", "l4", "t4", "a10", "l40"):
            if short in name:
                return short
        return name.split()[-1]
    return f"cpu-{os.cpu_count()}core"


def machine_info(backend: str) -> dict[str, Any]:
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    info = {"cpu": _cpu_model(), "cores": os.cpu_count(), "mem_gib": _mem_gib(), "torch": torch_version,
            "python": platform.python_version(), "backend": backend, "kernel": platform.release()}
    info.update(gpu_info() if backend == "cuda" else
                {"gpu_name": None, "gpu_count": 0, "driver": None, "cuda_runtime": None})
    return info


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def percentiles(samples: Any, ps: tuple[float, ...] = (50, 99, 99.9)) -> dict[str, float]:
    """Percentiles of samples as {'p50': .., 'p99': .., 'p99.9': ..}; NaN where there are none."""
    a = np.asarray(samples, dtype=float)
    if a.size == 0:
        return {f"p{p:g}": float("nan") for p in ps}
    return {f"p{p:g}": float(np.percentile(a, p)) for p in ps}


def results_dir(backend: str) -> Path:
    d = ROOT / "bench" / "results" / machine_name(backend)
    d.mkdir(parents=True, exist_ok=True)
    return d


def load_note(load_avg_before: Any, busy: float = 1.5) -> str:
    """A sentence for a result's notes when the 1-minute load average, before or now, is above `busy`."""
    now = os.getloadavg()[0]
    was = float(load_avg_before[0])
    if max(was, now) <= busy:
        return ""
    return (f" BUSY MACHINE: the 1-minute load average was {was:.1f} before the run and {now:.1f} after it "
            f"(above {busy:g} on {os.cpu_count()} cores, other work shared them), so absolute times are inflated "
            "and noisy; compare only figures taken interleaved in the same run.")


def write_result(experiment: str, backend: str, summary: dict[str, Any], samples: dict[str, Any],
                 *, notes: str = "", large_samples: bool = False, load_avg_before: Any = None,
                 name: str | None = None, out_dir: Path | None = None) -> Path:
    """Write bench/results/<machine>/<experiment>.json (and .samples.json when large) and return it.

    `load_avg_before`: os.getloadavg() taken when the run began; the load now is recorded beside it.
    `name`: the file's stem when it differs from the experiment (e.g. a run kept apart).
    `out_dir`: another directory than bench/results/<machine> (a test's tmp_path, a trial run).
    """
    if out_dir is None:
        out_dir = results_dir(backend)
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
    machine = machine_info(backend)
    if load_avg_before is not None:
        machine["load_avg_before"] = [round(x, 2) for x in load_avg_before]
        machine["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    doc: dict[str, Any] = {
        "experiment": experiment,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "git": git_commit(),
        "machine": machine,
        "summary": summary,
    }
    experiment = name or experiment
    if notes:
        doc["notes"] = notes
    path = out_dir / f"{experiment}.json"
    if large_samples:
        (out_dir / f"{experiment}.samples.json").write_text(json.dumps(samples, default=_jsonable))
        doc["samples"] = f"{experiment}.samples.json"
    else:
        doc["samples"] = samples
    path.write_text(json.dumps(doc, indent=1, default=_jsonable))
    return path


def _jsonable(o: Any) -> Any:
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o)}")


def peer_server_parser(description: str) -> argparse.ArgumentParser:
    """The arguments every peer server of bench/peer takes (bench.peer_ray, bench.peer_litserve): where to
    listen, which zoo model at which input shape, the instance's cores and torch threads, and the
    node's max batch size and wait."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--shape", type=int, nargs="+", required=True)
    ap.add_argument("--cores", type=int, nargs="+", required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--max-batch", type=int, required=True)
    ap.add_argument("--wait-ms", type=float, required=True)
    return ap
