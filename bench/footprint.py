"""bench/footprint: what the node process and the CLI cost before any model runs: memory and start time.

The node process (``gpuprims-orchestrator start``) never runs a model (its instances do), and the
CLI's ``status`` and ``stop`` only talk to it, so neither needs torch. This measures:

- ``node_rss_mb``: the node process's resident memory (VmRSS, and its peak VmHWM) once it is up and
  serving one small app (MobileNetV2 at 3x32x32; the instance is a process of its own, not counted);
- ``status_wall_s`` / ``stop_wall_s``: the wall time of ``python -m orchestrator.cli.main status`` and
  ``stop`` against that node, from exec to exit (median of ``--repeats`` for status; stop runs once);
- ``status_nonode_wall_s`` / ``stop_nonode_wall_s``: the same two commands when no node runs (they
  answer "no running node" and exit 1): the CLI's start alone, exec to exit (median of ``--repeats``);
- ``status_heavy_modules``: which heavy modules (torch, numpy, aiohttp, grpc, pydantic, the node, ...)
  a ``status`` run has in ``sys.modules`` when it exits (none since the lazy command group);
- ``cli_import_s``: ``python -X importtime -c "import orchestrator.cli.main"``'s cumulative time of the
  ``orchestrator.cli.main`` import (median of ``--repeats``), and whether torch was imported. Since the
  commands load lazily this is the group alone; ``status`` adds its control client to it.

``--no-node`` measures only what needs no node (the no-node walls, the heavy modules, the import).

**The per-app sweep** (issue 46; ``--sweep-apps``, ``--sweep-engines``, ``--sweep-shadows``, on by default,
``--no-sweep`` to skip): for each engine (``eager``, ``onnxruntime``), shadow mode (``warm``: a shadow
per app kept loaded; ``cold``: none, docs/apps-yaml.md) and app count (1, 4, 8 copies of the example's
classify app: MobileNetV2 at 3x64x64, 1000 classes), a node is started on the cpu backend and, once every
app's active is READY and every warm shadow has pre-warmed, each process's proportional set size (PSS,
``/proc/<pid>/smaps_rollup``) is read: the node, its fork servers, each active and shadow (and any
Param-Share holder), with each process's biggest mapped files by PSS (``/proc/<pid>/smaps``) so a miss
names what holds the memory. Figures per run, in the summary as ``sweep_<engine>_<shadow>_<n>_<figure>``:
``node_pss_mb``, ``fork_servers_pss_mb``, ``actives_pss_mb``, ``shadows_pss_mb``, ``total_pss_mb``,
``start_s`` (exec of ``start`` to its "up" line: every active READY), ``settled_s`` (to every warm
shadow pre-warmed); per engine and shadow mode ``..._per_added_app_mb`` (total of the most apps minus
that of the fewest, over the apps added) and, for onnxruntime, the issue's goals as ``goal_*`` booleans
(node <= 100 MB; each added app <= its ONNX file + 60 MB; 8 apps <= 900 MB in total) with the files
that hold the most memory where a goal is missed. The processes and their mapped files are in
``samples.sweep``. The engine cache is one private directory per engine for the whole sweep, so only
its first run builds the ONNX file (that run's start time is a cold build; the rest are cache hits).

``--python`` runs the node and the CLI with another interpreter (for example a checkout of an
older commit whose venv resolves ``orchestrator`` to that checkout) so a before/after pair is taken
side by side on the same machine at the same load. The figures are the CLI's and the node's own;
the load average before and after is in the result.

    python -m bench.footprint [--quick] [--no-node] [--python PY --cwd DIR] [--name footprint] [--out-dir DIR]
                              [--no-sweep | --sweep-apps 1,4,8 --sweep-engines eager,onnxruntime
                               --sweep-shadows warm,cold]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.common import load_note, write_result
from orchestrator.control.channel import ControlError, connect_command, control_address, read_token
from orchestrator.control.memory import mapped_files, read_pss
from orchestrator.control.messages import StatusRequest

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
         "orchestrator.node.node", "orchestrator.config.schema", "orchestrator.frontdoor", "orchestrator.node.metrics")
#: Runs the CLI as the console script does, then prints which HEAVY modules it loaded (on stderr, last line).
PROBE = f"""
import json, sys
from orchestrator.cli import main as cli
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
    r = subprocess.run([python, "-m", "orchestrator.cli.main", *args], env=env, cwd=cwd, capture_output=True, text=True,
                       timeout=timeout_s)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"orchestrator.cli.main {' '.join(args)} failed ({r.returncode}): {r.stderr[-2000:]}")
    return wall, r.stdout


def _cli_no_node(python: str, env: dict[str, str], cwd: Path, *args: str,
                 timeout_s: float = 120.0) -> float:
    """Wall time of one CLI command that finds no node (it must say so and exit 1)."""
    t0 = time.perf_counter()
    r = subprocess.run([python, "-m", "orchestrator.cli.main", *args], env=env, cwd=cwd, capture_output=True, text=True,
                       timeout=timeout_s)
    wall = time.perf_counter() - t0
    if r.returncode != 1 or "no running node" not in r.stderr:
        raise RuntimeError(f"orchestrator.cli.main {' '.join(args)} with no node: exit {r.returncode}, {r.stderr[-2000:]}")
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
    """``import orchestrator.cli.main``'s cumulative time (median of ``repeats``) and whether torch came with it."""
    runs = [import_time_s(python, cwd) for _ in range(repeats)]
    return {
        "summary": {"cli_import_s": round(statistics.median(t for t, _ in runs), 3),
                    "cli_imports_torch": any(t for _, t in runs)},
        "samples": {"cli_import_s": [t for t, _ in runs]},
    }


def import_time_s(python: str, cwd: Path, module: str = "orchestrator.cli.main") -> tuple[float, bool]:
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
        node = subprocess.Popen([python, "-m", "orchestrator.cli.main", "start", "--name", "fp", str(cfg)], env=env,
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


# ---- the per-app sweep (issue 46)

#: One app of the sweep: the example's classify app (MobileNetV2 at 3x64x64, 1000 classes: a 14 MB ONNX file).
SWEEP_APP = ("  - {{name: cls{i}, model: mobilenet_v2, input_shape: [3, 64, 64], slo_ms: 2000, gpu_pct: {pct}, "
             "max_batch: 4, app_id: {i}, engine: {engine}, shadow: {shadow}}}\n")
SWEEP_NODE = """node:
  listen: {{host: 127.0.0.1, port: 0}}
  backend: cpu
  engine_cache: {cache}
  pool: {{slot_count: 2048, max_chunks: 64, record_count: 256}}
apps:
"""
#: How many of each process's mapped files (by PSS) the sweep keeps.
TOP_FILES = 8
#: The issue's goals on onnxruntime (MB): the node; an added app beyond its model file; 8 apps in total.
GOAL_NODE_MB, GOAL_APP_OVER_FILE_MB, GOAL_TOTAL_8_MB = 100.0, 60.0, 900.0
_UP = re.compile(r"node \S+ up \(pid")
_MB = 2**20


@dataclass
class ProcessFootprint:
    """One process of a swept node: its role (node, fork_server, param_holder, active, shadow...), app,
    PSS and the files holding most of it."""

    role: str
    pid: int
    pss_mb: float | None
    app: str | None = None
    top: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class SweepRun:
    """One node of the sweep: its settings, start times and every process's footprint."""

    engine: str
    shadow: str
    apps: int
    start_s: float
    settled_s: float
    processes: list[ProcessFootprint]
    status_memory: dict[str, Any] | None  # what the node's own status said (orchestrator/control/memory.py)

    def pss_of(self, *roles: str) -> float:
        return round(sum(p.pss_mb or 0.0 for p in self.processes if p.role in roles), 1)

    def figures(self) -> dict[str, float]:
        return {"node_pss_mb": self.pss_of("node"), "fork_servers_pss_mb": self.pss_of("fork_server"),
                "actives_pss_mb": self.pss_of("active"), "shadows_pss_mb": self.pss_of("shadow"),
                "holders_pss_mb": self.pss_of("param_holder"),
                "total_pss_mb": round(sum(p.pss_mb or 0.0 for p in self.processes), 1),
                "start_s": round(self.start_s, 2), "settled_s": round(self.settled_s, 2)}


def sweep_config(n: int, engine: str, shadow: str, cache: Path) -> str:
    """apps.yaml of ``n`` copies of the classify app on ``engine``, sharing the cores evenly."""
    pct = max(1, 100 // n)
    return SWEEP_NODE.format(cache=json.dumps(str(cache))) + "".join(
        SWEEP_APP.format(i=i, pct=pct, engine=engine, shadow=shadow) for i in range(1, n + 1))


def _status(run_dir: Path, timeout_ms: float = 10_000) -> dict[str, Any]:
    with connect_command(control_address("zmq", run_dir), read_token(run_dir)) as cli:
        return dict(cli.request(StatusRequest(), timeout_ms=timeout_ms).status)


def _settled(st: dict[str, Any], shadow: str) -> bool:
    """Every app has a READY active and, with warm shadows, a shadow whose pre-warm ended."""
    for a in st.get("apps", {}).values():
        insts = a.get("instances") or []
        if not any(i.get("role") == "active" and i.get("ready") for i in insts):
            return False
        if shadow == "warm" and not any(i.get("role") == "shadow" and i.get("prewarm") in ("warm", "failed")
                                        for i in insts):
            return False
    return True


def _footprint(role: str, pid: int, app: str | None = None) -> ProcessFootprint:
    pss = read_pss(pid)
    top = [{"path": m.path, "pss_mb": round(m.pss_bytes / _MB, 1)} for m in mapped_files(pid, TOP_FILES)]
    return ProcessFootprint(role, pid, None if pss is None else round(pss / _MB, 1), app, top)


def sweep_one(python: str, cwd: Path, tmp: Path, n: int, engine: str, shadow: str, cache: Path,
              ready_timeout_s: float) -> SweepRun:
    """Start a node of ``n`` apps, wait until it settles, read every process's footprint, stop it (reaped)."""
    run_dir = tmp / f"run-{engine}-{shadow}-{n}"
    cfg = tmp / f"apps-{engine}-{shadow}-{n}.yaml"
    cfg.write_text(sweep_config(n, engine, shadow, cache))
    log_path = tmp / f"node-{engine}-{shadow}-{n}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log_path.open("w") as log:
        t0 = time.monotonic()
        node = subprocess.Popen([python, "-m", "orchestrator.cli.main", "start", "--run-dir", str(run_dir), str(cfg)],
                                env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = t0 + ready_timeout_s
            while not _UP.search(log_path.read_text()):
                if node.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the node ({engine}, {n} apps) did not come up: "
                                       + log_path.read_text()[-3000:])
                time.sleep(0.1)
            start_s = time.monotonic() - t0
            while True:
                try:
                    st = _status(run_dir)
                except (ControlError, OSError):  # busy past the timeout: asked again
                    st = {}
                if st and _settled(st, shadow):
                    break
                if node.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the node ({engine}, {n} apps) did not settle: " + log_path.read_text()[-3000:])
                time.sleep(0.5)
            settled_s = time.monotonic() - t0
            time.sleep(2.0)  # a few loop passes and heartbeats after the last pre-warm
            st = _status(run_dir)
            procs = [_footprint("node", node.pid)]
            procs += [_footprint("fork_server", int(f["pid"])) for f in st["node"].get("fork_servers") or []]
            mem = st["node"].get("memory") or {}
            procs += [_footprint(p["kind"], int(p["pid"])) for p in mem.get("processes") or []
                      if p.get("kind") not in ("node", "fork_server")]
            for app, a in st["apps"].items():
                procs += [_footprint(str(i.get("role")), int(i["pid"]), app) for i in a.get("instances") or []
                          if isinstance(i.get("pid"), int)]
        finally:
            _stop(node)
    return SweepRun(engine, shadow, n, start_s, settled_s, procs, mem or None)


def _stop(node: subprocess.Popen[Any], timeout_s: float = 60.0) -> None:
    """SIGTERM the node (it drains and reaps its instances and fork servers), then SIGKILL its session."""
    if node.poll() is None:
        node.send_signal(signal.SIGTERM)
        try:
            node.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(node.pid, signal.SIGKILL)  # the session this bench started: anything left in it
    except (ProcessLookupError, PermissionError):
        pass
    if node.poll() is None:
        node.wait()


def _holders(run: SweepRun, roles: tuple[str, ...], n: int = 3) -> list[str]:
    """The files holding the most PSS summed over the run's processes of ``roles``."""
    by: dict[str, float] = {}
    for p in run.processes:
        if p.role in roles:
            for t in p.top:
                by[t["path"]] = by.get(t["path"], 0.0) + t["pss_mb"]
    return [f"{path} {mb:.0f} MB" for path, mb in sorted(by.items(), key=lambda kv: -kv[1])[:n]]


def sweep(python: str, cwd: Path, apps: list[int], engines: list[str], shadows: list[str],
          ready_timeout_s: float) -> dict[str, Any]:
    """Every (engine, shadow, app count) node of the sweep, one at a time; summary and samples."""
    summary: dict[str, Any] = {}
    runs: list[SweepRun] = []
    with tempfile.TemporaryDirectory(prefix="gpuprims-footprint-sweep-") as tmp_s:
        tmp = Path(tmp_s)
        for engine in engines:
            cache = tmp / f"cache-{engine}"
            cache.mkdir()
            for shadow in shadows:
                mine = [sweep_one(python, cwd, tmp, n, engine, shadow, cache, ready_timeout_s) for n in apps]
                runs += mine
                for r in mine:
                    for k, v in r.figures().items():
                        summary[f"sweep_{engine}_{shadow}_{r.apps}_{k}"] = v
                lo, hi = mine[0], mine[-1]
                per_app = None
                if hi.apps > lo.apps:
                    per_app = round((hi.figures()["total_pss_mb"] - lo.figures()["total_pss_mb"]) / (hi.apps - lo.apps), 1)
                    summary[f"sweep_{engine}_{shadow}_per_added_app_mb"] = per_app
                if engine == "onnxruntime":
                    _goals(summary, f"sweep_{engine}_{shadow}", mine, per_app, cache)
    return {"summary": summary, "samples": {"sweep": [asdict(r) for r in runs]}}


def _goals(summary: dict[str, Any], key: str, runs: list[SweepRun], per_app: float | None, cache: Path) -> None:
    """The issue's goals on onnxruntime, and what holds the memory where one is missed."""
    onnx = [p.stat().st_size for p in cache.rglob("*.onnx")]
    file_mb = round(max(onnx) / _MB, 1) if onnx else None
    summary[f"{key}_model_file_mb"] = file_mb
    node_mb = max(r.figures()["node_pss_mb"] for r in runs)
    summary[f"{key}_goal_node_le_100mb"] = ok = node_mb <= GOAL_NODE_MB
    if not ok:
        summary[f"{key}_node_held_by"] = _holders(runs[-1], ("node",))
    if per_app is not None and file_mb is not None:
        summary[f"{key}_goal_added_app_le_file_plus_60mb"] = ok = per_app <= file_mb + GOAL_APP_OVER_FILE_MB
        if not ok:
            summary[f"{key}_added_app_held_by"] = _holders(runs[-1], ("active", "shadow"))
    eight = [r for r in runs if r.apps == 8]
    if eight:
        summary[f"{key}_goal_8_apps_le_900mb"] = ok = eight[0].figures()["total_pss_mb"] <= GOAL_TOTAL_8_MB
        if not ok:
            summary[f"{key}_8_apps_held_by"] = _holders(eight[0], ("node", "fork_server", "active", "shadow"))


def _ints(text: str) -> list[int]:
    try:
        out = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of app counts, got {text!r}") from None
    if not out or out[0] < 1 or out[-1] > 64:
        raise argparse.ArgumentTypeError(f"app counts must be 1..64, got {text!r}")
    return out


def _names(allowed: tuple[str, ...]) -> Any:
    def parse(text: str) -> list[str]:
        out = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in out if x not in allowed]
        if not out or bad:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)} (comma-separated), got {text!r}")
        return out
    return parse


def run(python: str, cwd: Path, repeats: int, ready_timeout_s: float, *, node: bool = True,
        sweep_apps: list[int] | None = None, sweep_engines: list[str] | None = None,
        sweep_shadows: list[str] | None = None) -> dict[str, Any]:
    """Every figure: the CLI with no node, then (with ``node``) a node and the CLI against it, then imports,
    then (with ``sweep_apps``) the per-app sweep."""
    parts = [no_node(python, cwd, repeats)]
    if node:
        parts.append(with_node(python, cwd, repeats, ready_timeout_s))
    parts.append(imports(python, cwd, repeats))
    if node and sweep_apps:
        parts.append(sweep(python, cwd, sweep_apps, sweep_engines or ["eager", "onnxruntime"],
                           sweep_shadows or ["warm", "cold"], ready_timeout_s))
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
    ap.add_argument("--no-sweep", action="store_true", help="skip the per-app sweep")
    ap.add_argument("--sweep-apps", type=_ints, default=None,
                    help="app counts of the sweep (default 1,4,8; with --quick 1,2)")
    ap.add_argument("--sweep-engines", type=_names(("eager", "onnxruntime")), default=["eager", "onnxruntime"],
                    help="engines of the sweep (default eager,onnxruntime)")
    ap.add_argument("--sweep-shadows", type=_names(("warm", "cold")), default=["warm", "cold"],
                    help="shadow modes of the sweep (default warm,cold)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    load_before = os.getloadavg()
    res = run(args.python, Path(args.cwd), 1 if args.quick else args.repeats, args.ready_timeout, node=not args.no_node,
              sweep_apps=None if args.no_sweep else args.sweep_apps or ([1, 2] if args.quick else [1, 4, 8]),
              sweep_engines=args.sweep_engines,
              sweep_shadows=args.sweep_shadows)
    notes = f"interpreter {args.python}, in {args.cwd}." + load_note(load_before)
    path = write_result("footprint", "cpu", res["summary"], res["samples"], notes=notes,
                        load_avg_before=load_before, name=args.name, out_dir=args.out_dir)
    print(path)
    for k, v in res["summary"].items():
        print(f"{k:>20}: {v}")


if __name__ == "__main__":
    main()
