"""bench/footprint: what the node process and the CLI cost before any model runs: memory and start time.

The node process (``gpuprims-orchestrator start``) never runs a model (its instances do), and the
CLI's ``status`` and ``stop`` only talk to it, so neither needs torch. This measures:

- ``node_rss_mb``: the node process's resident memory (VmRSS, and its peak VmHWM) once it is up and
  serving one small app (MobileNetV2 at 3x32x32; the instance is a process of its own, not counted);
- ``status_wall_s`` / ``stop_wall_s``: the wall time of ``python -m orchestrator.cli status`` and
  ``stop`` against that node, from exec to exit (median of ``--repeats`` for status; stop runs once);
- ``status_nonode_wall_s`` / ``stop_nonode_wall_s``: the same two commands when no node runs (they
  answer "no running node" and exit 1): the CLI's start alone, exec to exit (median of ``--repeats``);
- ``status_heavy_modules``: which heavy modules (torch, numpy, aiohttp, grpc, pydantic, the node, ...)
  a ``status`` run has in ``sys.modules`` when it exits (none since the lazy command group);
- ``cli_import_s``: ``python -X importtime -c "import orchestrator.cli"``'s cumulative time of the
  ``orchestrator.cli`` import (median of ``--repeats``), and whether torch was imported. Since the
  commands load lazily this is the group alone; ``status`` adds its control client to it.

``--no-node`` measures only what needs no node (the no-node walls, the heavy modules, the import).

``--python`` runs the node and the CLI with another interpreter (for example a checkout of an
older commit whose venv resolves ``orchestrator`` to that checkout) so a before/after pair is taken
side by side on the same machine at the same load. The figures are the CLI's and the node's own;
the load average before and after is in the result.

    python -m bench.footprint [--quick] [--no-node] [--python PY --cwd DIR] [--name footprint] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import load_note, write_result

ROOT = Path(__file__).resolve().parent.parent

CONFIG = """
node:
  listen: {host: 127.0.0.1, port: 0}
  backend: cpu
  pool: {slot_count: 256, max_chunks: 16, record_count: 64}
apps:
  - {name: cls, model: mobilenet_v2, input_shape: [3, 32, 32], slo_ms: 1000, gpu_pct: 50, max_batch: 4,
     app_id: 1, num_classes: 10}
"""
#: Modules a control-socket command (status, stop) has no use for; `status_heavy_modules` lists those it loaded.
HEAVY = ("torch", "numpy", "aiohttp", "grpc", "pydantic", "yaml", "prometheus_client", "gpuprims._native",
         "orchestrator.node", "orchestrator.config", "orchestrator.frontdoor", "orchestrator.metrics")
#: Runs the CLI as the console script does, then prints which HEAVY modules it loaded (on stderr, last line).
PROBE = f"""
import json, sys
from orchestrator import cli
try:
    cli.main(sys.argv[1:], prog_name="gpuprims-orchestrator")
    code = 0
except SystemExit as e:
    code = e.code
print("HEAVY=" + json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)), file=sys.stderr)
sys.exit(code)
"""


def _proc_kb(pid: int, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _cli(python: str, env: dict[str, str], cwd: Path, *args: str, timeout_s: float = 120.0) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = subprocess.run([python, "-m", "orchestrator.cli", *args], env=env, cwd=cwd, capture_output=True, text=True,
                       timeout=timeout_s)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"orchestrator.cli {' '.join(args)} failed ({r.returncode}): {r.stderr[-2000:]}")
    return wall, r.stdout


def _cli_no_node(python: str, env: dict[str, str], cwd: Path, *args: str,
                 timeout_s: float = 120.0) -> float:
    """Wall time of one CLI command that finds no node (it must say so and exit 1)."""
    t0 = time.perf_counter()
    r = subprocess.run([python, "-m", "orchestrator.cli", *args], env=env, cwd=cwd, capture_output=True, text=True,
                       timeout=timeout_s)
    wall = time.perf_counter() - t0
    if r.returncode != 1 or "no running node" not in r.stderr:
        raise RuntimeError(f"orchestrator.cli {' '.join(args)} with no node: exit {r.returncode}, {r.stderr[-2000:]}")
    return wall


def status_heavy_modules(python: str, env: dict[str, str], cwd: Path, timeout_s: float = 120.0) -> list[str]:
    """The HEAVY modules a ``status`` that finds no node has loaded when it exits."""
    r = subprocess.run([python, "-c", PROBE, "status"], env=env, cwd=cwd, capture_output=True, text=True,
                       timeout=timeout_s)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("HEAVY=")]
    if not lines:
        raise RuntimeError(f"the status probe printed no module list (exit {r.returncode}): {r.stderr[-2000:]}")
    return list(json.loads(lines[-1][len("HEAVY="):]))


def no_node(python: str, cwd: Path, repeats: int) -> dict[str, Any]:
    """The CLI's start alone: ``status`` and ``stop`` against no node, interleaved, in a private runtime base."""
    with tempfile.TemporaryDirectory(prefix="gpuprims-footprint-") as tmp:
        xdg = Path(tmp) / "xdg"
        xdg.mkdir(mode=0o700)
        env = {**os.environ, "XDG_RUNTIME_DIR": str(xdg)}
        status_s, stop_s = [], []
        for _ in range(repeats):
            status_s.append(_cli_no_node(python, env, cwd, "status"))
            stop_s.append(_cli_no_node(python, env, cwd, "stop"))
        heavy = status_heavy_modules(python, env, cwd)
    return {
        "summary": {"status_nonode_wall_s": round(statistics.median(status_s), 3),
                    "stop_nonode_wall_s": round(statistics.median(stop_s), 3), "status_heavy_modules": heavy},
        "samples": {"status_nonode_wall_s": status_s, "stop_nonode_wall_s": stop_s},
    }


def imports(python: str, cwd: Path, repeats: int) -> dict[str, Any]:
    """``import orchestrator.cli``'s cumulative time (median of ``repeats``) and whether torch came with it."""
    runs = [import_time_s(python, cwd) for _ in range(repeats)]
    return {
        "summary": {"cli_import_s": round(statistics.median(t for t, _ in runs), 3),
                    "cli_imports_torch": any(t for _, t in runs)},
        "samples": {"cli_import_s": [t for t, _ in runs]},
    }


def import_time_s(python: str, cwd: Path, module: str = "orchestrator.cli") -> tuple[float, bool]:
    """Cumulative import time of ``module`` in a fresh interpreter (-X importtime), and whether torch came."""
    r = subprocess.run([python, "-X", "importtime", "-c", f"import {module}"], cwd=cwd, capture_output=True,
                       text=True, timeout=300)
    us = None
    torch = False
    for line in r.stderr.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) != 3:
            continue
        if parts[2] == module:
            us = int(parts[1])
        if parts[2] == "torch":
            torch = True
    if us is None:
        raise RuntimeError(f"no import time of {module} in: {r.stderr[-2000:]}")
    return us / 1e6, torch


def with_node(python: str, cwd: Path, repeats: int, ready_timeout_s: float) -> dict[str, Any]:
    """The node's memory once up, and ``status``/``stop`` against it (private runtime base, node reaped)."""
    with tempfile.TemporaryDirectory(prefix="gpuprims-footprint-") as tmp:
        xdg = Path(tmp) / "xdg"
        xdg.mkdir(mode=0o700)
        cfg = Path(tmp) / "apps.yaml"
        cfg.write_text(CONFIG)
        env = {**os.environ, "XDG_RUNTIME_DIR": str(xdg), "PYTHONUNBUFFERED": "1"}
        log = (Path(tmp) / "node.log").open("w")
        node = subprocess.Popen([python, "-m", "orchestrator.cli", "start", "--name", "fp", str(cfg)], env=env,
                                cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + ready_timeout_s
            while "node fp up" not in (Path(tmp) / "node.log").read_text():
                if node.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the node did not come up: " + (Path(tmp) / "node.log").read_text()[-3000:])
                time.sleep(0.2)
            time.sleep(1.0)  # a few loop passes and heartbeats after READY
            rss_kb, hwm_kb = _proc_kb(node.pid, "VmRSS"), _proc_kb(node.pid, "VmHWM")
            node_torch = "torch" in Path(f"/proc/{node.pid}/maps").read_text()
            status_s = [_cli(python, env, cwd, "status", "--name", "fp")[0] for _ in range(repeats)]
            stop_s, _ = _cli(python, env, cwd, "stop", "--name", "fp")
            node.wait(timeout=60)
        finally:
            if node.poll() is None:
                node.kill()
                node.wait()
            log.close()
    return {
        "summary": {
            "node_rss_mb": round((rss_kb or 0) / 1024, 1), "node_peak_rss_mb": round((hwm_kb or 0) / 1024, 1),
            "node_maps_torch": node_torch,
            "status_wall_s": round(statistics.median(status_s), 3), "stop_wall_s": round(stop_s, 3),
        },
        "samples": {"status_wall_s": status_s, "stop_wall_s": [stop_s]},
    }


def run(python: str, cwd: Path, repeats: int, ready_timeout_s: float, *, node: bool = True) -> dict[str, Any]:
    """Every figure: the CLI with no node, then (with ``node``) a node and the CLI against it, then imports."""
    parts = [no_node(python, cwd, repeats)]
    if node:
        parts.append(with_node(python, cwd, repeats, ready_timeout_s))
    parts.append(imports(python, cwd, repeats))
    return {key: {k: v for p in parts for k, v in p[key].items()} for key in ("summary", "samples")}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one repeat of each timing")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--python", default=sys.executable, help="interpreter that runs the node and the CLI")
    ap.add_argument("--cwd", default=str(ROOT), help="directory the node and the CLI run in")
    ap.add_argument("--name", default="footprint", help="result file stem (e.g. footprint-before)")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--no-node", action="store_true", help="only the figures that need no node (CLI start, imports)")
    ap.add_argument("--out-dir", type=Path, default=None, help="directory for the JSON (default bench/results/<machine>/)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    load_before = os.getloadavg()
    res = run(args.python, Path(args.cwd), 1 if args.quick else args.repeats, args.ready_timeout, node=not args.no_node)
    notes = f"interpreter {args.python}, in {args.cwd}." + load_note(load_before)
    path = write_result("footprint", "cpu", res["summary"], res["samples"], notes=notes,
                        load_avg_before=load_before, name=args.name, out_dir=args.out_dir)
    print(path)
    for k, v in res["summary"].items():
        print(f"{k:>20}: {v}")


if __name__ == "__main__":
    main()
