"""The GPU-DMA kernel source run on the host, full sweep: native/cuda/dma.cu built unchanged with g++
against the host shim of the CUDA runtime, plainly and with ASan+UBSan, compared case by case with
the CPU reference (gpuprims.testing.hostsim: shapes around chunk boundaries, chunk payloads, copy and
uint8->float32 with 1/3/4 channels, misaligned destinations, row padding, blocks per row; every
header field corrupted at several chunks; bad records).

    python3 -m bench.kernel_host [--quick]

Writes bench/results/cpu-<N>core/kernel_host.json. It reports; it asserts nothing (the quick set
runs in the test suite, tests/gpuprims/testing/test_hostsim.py). The sanitized build runs in a child
Python with the sanitizer runtimes preloaded; a sanitizer report aborts that child, and its exit
status and the report's tail are recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import write_result
from gpuprims.testing import hostsim

_CHILD = """
import json, sys, time
from pathlib import Path
from gpuprims.testing import hostsim
k = hostsim.HostKernel(Path(sys.argv[1]))
t = time.perf_counter()
r = hostsim.run_all(k, quick=sys.argv[2] == "quick")
r["seconds"] = time.perf_counter() - t
print(json.dumps(r))
"""


def run_config(lib: Path, quick: bool, env: dict[str, str] | None) -> dict[str, Any]:
    """One sweep in a child Python (so a sanitizer abort is contained)."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", _CHILD, str(lib), "quick" if quick else "full"], env=env,
                       capture_output=True, text=True, timeout=3600)
    out: dict[str, Any] = {"exit_status": r.returncode, "wall_s": time.perf_counter() - t0}
    try:
        out.update(json.loads(r.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        out["cases"] = 0
        out["failures"] = {}
    if r.returncode != 0:
        # The report's first lines say what and where; the stack after them is long.
        at = max(r.stderr.find("ERROR: AddressSanitizer"), r.stderr.find("runtime error"), 0)
        out["report"] = r.stderr[max(0, at - 500):at + 3000]
    return out


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the quick case set (as in the test suite)")
    args = ap.parse_args(argv)
    if hostsim.compiler() is None:
        raise SystemExit("bench.kernel_host: no g++ on PATH")
    load_before = os.getloadavg()
    summary: dict[str, Any] = {}
    samples: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, sanitize in (("plain", False), ("asan_ubsan", True)):
            t0 = time.perf_counter()
            lib = hostsim.build(Path(tmp), sanitize=sanitize)
            build_s = time.perf_counter() - t0
            env = hostsim.sanitizer_env() if sanitize else dict(os.environ)
            res = run_config(lib, args.quick, env)
            res["build_s"] = build_s
            samples[name] = res
            summary[f"{name}_cases"] = res["cases"]
            summary[f"{name}_failures"] = len(res["failures"])
            summary[f"{name}_exit_status"] = res["exit_status"]
            summary[f"{name}_run_s"] = res.get("seconds", float("nan"))
            print(f"  {name}: {res['cases']} cases, {len(res['failures'])} failing, exit {res['exit_status']}, "
                  f"{res.get('seconds', float('nan')):.1f} s")
    summary["sanitizers"] = "address,undefined"
    summary["load_avg_before"] = list(load_before)
    summary["load_avg_after"] = list(os.getloadavg())
    path = write_result("kernel_host", "cpu", summary, samples,
                        notes="native/cuda/dma.cu compiled unchanged with g++ and native/host_shim (threads of a "
                              "block are real threads; blocks run in turn), compared byte for byte and verdict "
                              "for verdict with _native.dma_gather_cpu. No GPU used.")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
