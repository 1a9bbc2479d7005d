"""Run every benchmark in turn (``make bench``), each in its own process, and say which failed.

``python -m bench.run_all [--quick] [--only a,b] [--list]``. Every experiment of bench/README.md is
here; one whose prerequisite is missing (an optional extra, a compiler, a GPU) or that runs for an hour is
skipped with the reason printed, and ``--only`` runs it anyway. Benchmarks report; this only runs them.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


def _missing_modules(*names: str, extra: str = "peer") -> str | None:
    gone = [n for n in names if importlib.util.find_spec(n) is None]
    return f"needs {', '.join(gone)} (pip install -e '.[{extra}]')" if gone else None


def _missing_peers() -> str | None:
    """bench.peer's peers: Ray Serve and LitServe from the `peer` extra, MLServer from its own environment."""
    from bench.peer import MLSERVER_VENV

    venv = Path(os.environ.get("GPUPRIMS_MLSERVER_VENV") or MLSERVER_VENV)
    missing = [] if (venv / "bin" / "mlserver").exists() else [f"MLServer's environment (scripts/setup-mlserver.sh makes {venv})"]
    why = _missing_modules("ray", "litserve")
    return "; ".join([*([why] if why else []), *missing]) or None


def _missing_clang() -> str | None:
    return None if shutil.which("clang") or shutil.which("clang++") else \
        "needs clang with libFuzzer and the sanitizer runtimes (scripts/build-fuzz.sh)"


@dataclass(frozen=True)
class Experiment:
    name: str
    skip: Callable[[], str | None] = lambda: None  # why it does not run by default, or None


#: Every experiment, in the order make bench runs them (cheap and library-level first).
EXPERIMENTS = (
    Experiment("gather"), Experiment("ingest"), Experiment("traffic"), Experiment("kernel_host"),
    Experiment("footprint"), Experiment("stage_cost"), Experiment("e2e"), Experiment("model_inside"),
    Experiment("dma"), Experiment("sync"), Experiment("share"), Experiment("overlap"), Experiment("launch"),
    Experiment("monitor"),
    Experiment("multi"), Experiment("css"), Experiment("knee"), Experiment("sched"), Experiment("sched_live"),
    Experiment("coexec"), Experiment("opara"), Experiment("oip"), Experiment("overload"), Experiment("forward"), Experiment("flood"), Experiment("chaos"),
    Experiment("engines", lambda: _missing_modules("onnxruntime", extra="onnx")),
    Experiment("engines_node", lambda: _missing_modules("onnxruntime", extra="onnx")),
    Experiment("single_stream", lambda: _missing_modules("onnxruntime", extra="onnx")),
    Experiment("repository", lambda: _missing_modules("onnxruntime", "onnx", extra="onnx")),
    Experiment("engines_gpu", lambda: "needs a GPU: run it on a GPU host (scripts/gpu-engines.sh); "
               "python -m bench.engines_gpu --quick --fake checks the script here"),
    Experiment("fleet", lambda: _missing_modules("ray", extra="fleet")),
    Experiment("fleet_plan"),
    Experiment("fuzz", _missing_clang),
    Experiment("peer", _missing_peers),
    Experiment("soak", lambda: "runs for an hour; run it alone: python -m bench.soak (smoke: --duration 60 --sample-s 5)"),
)
ORDER = [e.name for e in EXPERIMENTS]
#: Experiments without a --quick mode of their own (soak is shortened with --duration instead).
NO_QUICK = {"soak"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated benchmark names (run even if skipped by default)")
    ap.add_argument("--list", action="store_true", help="list the experiments and whether each would run")
    args = ap.parse_args()
    only = [n for n in args.only.split(",") if n]
    unknown = sorted(set(only) - set(ORDER))
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; known: {ORDER}")
    todo: list[str] = []
    for e in EXPERIMENTS:
        if only and e.name not in only:
            continue
        why = None if only else e.skip()
        if args.list or why:
            print(f"{e.name:>12}: {'skipped: ' + why if why else 'runs'}", flush=True)
        if why is None:
            todo.append(e.name)
    if args.list:
        return 0
    failed = []
    for name in todo:
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", f"bench.{name}", *(["--quick"] if args.quick and name not in NO_QUICK else [])]
        print(f"== {' '.join(cmd[1:])}", flush=True)
        rc = subprocess.run(cmd).returncode
        print(f"== {name}: {'ok' if rc == 0 else f'FAILED ({rc})'} in {time.monotonic() - t0:.0f} s", flush=True)
        if rc:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
