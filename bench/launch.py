"""bench/launch: how long a node takes to start its instances and to replace a killed one, with
instances started as processes (``python -m orchestrator.worker.launch``, `SubprocessLauncher`) and forked
from a ready fork server (`ForkLauncher`, the node's default; orchestrator/worker/forkserver.py).

Each round starts a node on a copy of ``examples/apps.yaml`` (private run dir, free UDP port, no
front door), once per launcher, interleaved so both see the same machine: the start (``Node.start``
until every active instance is READY), then a SIGKILL of the first app's active instance and the time
until its replacement is READY, then the stop. The fork servers are made ready before the first
round (their one import is not what is compared; it is reported as ``fork_server_import_ms``).

Writes ``bench/results/<machine>/launch.json``: per launcher the start and replacement times (p50,
max, raw samples) and their ratios (process / fork: above 1 means forking is faster), with the load
average before and after.

Run: ``python -m bench.launch [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.chaos import private_config
from bench.common import ROOT, load_note, write_result
from orchestrator.node.launcher import ForkLauncher, Launcher, SubprocessLauncher
from orchestrator.node.node import Node


def _until(node: Node, cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:g} s")
        node.step(10)


def one_round(cfg: Any, launcher: Launcher, app: str, timeout_s: float) -> dict[str, float]:
    t0 = time.monotonic()
    node = Node(cfg, warmup=False, launcher=launcher).start()
    started = time.monotonic() - t0
    try:
        victim = next(st for st in node.instances.values() if st.app == app and st.role == "active")
        t1 = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        _until(node, lambda: any(st.app == app and st.role == "active" and st.ready and st.name != victim.name
                                 for st in node.instances.values()), timeout_s, "the replacement's READY")
        replaced = time.monotonic() - t1
    finally:
        t2 = time.monotonic()
        node.stop()
    return {"start_s": started, "replace_s": replaced, "stop_s": time.monotonic() - t2}


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="launch-", dir="/tmp"))
    _, cfg = private_config(Path(args.config), tmp)
    app = cfg.apps[0].name
    fork = ForkLauncher(sys.executable)
    process = SubprocessLauncher(sys.executable)
    # Make the fork servers ready: one node started and kept until they have imported.
    node = Node(cfg, warmup=False, launcher=fork).start()
    try:
        _until(node, lambda: not ForkLauncher.starting(), args.timeout, "the fork servers' import")
    finally:
        node.stop()
    imports = [s["import_ms"] for s in ForkLauncher.describe()]
    samples: dict[str, list[dict[str, float]]] = {"process": [], "fork": []}
    for i in range(args.rounds):
        order = [("process", process), ("fork", fork)] if i % 2 == 0 else [("fork", fork), ("process", process)]
        for name, launcher in order:
            samples[name].append(one_round(cfg, launcher, app, args.timeout))
            print(f"round {i + 1}/{args.rounds} {name}: {samples[name][-1]}", flush=True)
    summary: dict[str, Any] = {"rounds": args.rounds, "app_killed": app, "instances": len(cfg.apps),
                               "fork_server_import_ms": imports}
    for name, rows in samples.items():
        for key in ("start_s", "replace_s", "stop_s"):
            vals = [r[key] for r in rows]
            summary[f"{name}_{key}_p50"] = round(statistics.median(vals), 3)
            summary[f"{name}_{key}_max"] = round(max(vals), 3)
    for key in ("start_s", "replace_s"):
        summary[f"{key}_ratio"] = round(summary[f"process_{key}_p50"] / summary[f"fork_{key}_p50"], 2)
    return {"summary": summary, "samples": samples}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--config", default=str(ROOT / "examples" / "apps.yaml"))
    ap.add_argument("--timeout", type=float, default=300.0, help="Seconds any one wait may take.")
    ap.add_argument("--out-dir", type=Path, default=None, help="Write the result here (default bench/results).")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    load_before = os.getloadavg()
    try:
        res = run(args)
    finally:
        ForkLauncher.close_all()
    notes = ("Node start (until every active is READY) and replacement of a SIGKILLed active (until the new one "
             "is READY), instances started as processes vs forked from a ready fork server; interleaved rounds."
             + load_note(load_before))
    path = write_result("launch", "cpu", res["summary"], res["samples"], notes=notes, load_avg_before=load_before,
                        out_dir=args.out_dir)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
