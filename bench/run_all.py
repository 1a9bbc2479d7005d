"""Run every benchmark in turn (``make bench``), each in its own process, and say which failed.

``python -m bench.run_all [--quick] [--only a,b]``. Benchmarks report; this only runs them.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

ORDER = ["gather", "ingest", "traffic", "e2e", "dma", "sync", "share", "overlap", "multi", "css", "knee", "sched", "coexec",
         "opara"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated benchmark names")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or ORDER
    unknown = sorted(set(names) - set(ORDER))
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; known: {ORDER}")
    failed = []
    for name in names:
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", f"bench.{name}", *(["--quick"] if args.quick else [])]
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
