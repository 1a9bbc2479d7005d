"""bench/footprint: what the node process and the CLI cost before any model runs: memory and start time.

The node process (``gpuprims-orchestrator start``) never runs a model (its instances do), and the
CLI's ``status`` and ``stop`` only talk to it, so neither needs torch. This measures:

- ``node_rss_mb``: the node process's resident memory (VmRSS, and its peak VmHWM) once it is up and
  serving one small app (MobileNetV2 at 3x32x32; the instance is a process of its own, not counted);
- ``status_wall_s`` / ``stop_wall_s``: the wall time of ``python -m orchestrator.cli status`` and
  ``stop`` against that node, from exec to exit (median of ``--repeats`` for status; stop runs once);
- ``cli_import_s``: ``python -X importtime -c "import orchestrator.cli"``'s cumulative time of the
  ``orchestrator.cli`` import (median of ``--repeats``), and whether torch was imported.

``--python`` runs the node and the CLI with another interpreter (for example a checkout of an
older commit whose venv resolves ``orchestrator`` to that checkout) so a before/after pair is taken
side by side on the same machine at the same load. The figures are the CLI's and the node's own;
the load average before and after is in the result.

    python -m bench.footprint [--quick] [--python PY] [--name footprint]
"""

from __future__ import annotations

import argparse
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


def run(python: str, cwd: Path, repeats: int, ready_timeout_s: float) -> dict[str, Any]:
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
    imports = [import_time_s(python, cwd) for _ in range(repeats)]
    return {
        "summary": {
            "node_rss_mb": round((rss_kb or 0) / 1024, 1), "node_peak_rss_mb": round((hwm_kb or 0) / 1024, 1),
            "node_maps_torch": node_torch,
            "status_wall_s": round(statistics.median(status_s), 3), "stop_wall_s": round(stop_s, 3),
            "cli_import_s": round(statistics.median(t for t, _ in imports), 3),
            "cli_imports_torch": any(t for _, t in imports),
        },
        "samples": {"status_wall_s": status_s, "stop_wall_s": [stop_s], "cli_import_s": [t for t, _ in imports]},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one repeat of each timing")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--python", default=sys.executable, help="interpreter that runs the node and the CLI")
    ap.add_argument("--cwd", default=str(ROOT), help="directory the node and the CLI run in")
    ap.add_argument("--name", default="footprint", help="result file stem (e.g. footprint-before)")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    args = ap.parse_args()
    load_before = os.getloadavg()
    res = run(args.python, Path(args.cwd), 1 if args.quick else args.repeats, args.ready_timeout)
    notes = f"interpreter {args.python}, in {args.cwd}." + load_note(load_before)
    path = write_result("footprint", "cpu", res["summary"], res["samples"], notes=notes,
                        load_avg_before=load_before, name=args.name)
    print(path)
    for k, v in res["summary"].items():
        print(f"{k:>20}: {v}")


if __name__ == "__main__":
    main()
