"""bench/fuzz: coverage-guided fuzzing of the native ingest (wire checks and reassembly) with sanitizers.

The libFuzzer harness ``native/fuzz/fuzz_ingest.cpp`` drives the ingest's per-datagram step
(``Ingest::feed``/``housekeeping`` on a fake clock, no receive thread) with raw datagrams, plausible
request chunks, coalesced GRO buffers, duplicates, releases (also double and foreign ones), dead
consumers and route changes, and from the consumers' side the answer rings: answers through
``Pool::answer`` (right and stale generations), raw bytes and tails written into a ring, and answers
a client refuses as a full send buffer would (held, then sent or expired). After every step it checks
the slot/record/request accounting, that every delivered request ends once (released, answered or
failed at a reclaim), that each published answer is counted once (sent or refused), that a request
a consumer holds ends only through that consumer's answer, and at the end of an input that nothing
is left held. It is
built with clang, ``-fsanitize=fuzzer,address,undefined`` (leak checking on; UBSan aborts on the
first finding) by ``scripts/build-fuzz.sh``.

This runs ``--jobs`` fuzzer processes on one working corpus (seeded from ``tests/fuzz/corpus``) until
``--runs`` inputs in all, then measures the edges the merged corpus covers (in the ingest and pool
code only; the harness is not instrumented) and writes ``bench/results/<machine>/fuzz.json``. A
crash, sanitizer report or broken invariant leaves its input under ``build/fuzz/crashes/`` and is
counted. ``--update-corpus`` merges what the run found into the committed seed corpus (kept small).

Run: ``python -m bench.fuzz [--runs 10000000] [--jobs 2] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, write_result

SOURCES = [ROOT / "native" / "src" / n for n in ("ingest.cpp", "ingest.h", "ingest_check.cpp", "pool.cpp",
                                                  "pool_impl.h")] + \
          [ROOT / "native" / "include" / "gpuprims" / n for n in ("wire.h", "pool.h")] + \
          [ROOT / "native" / "fuzz" / "fuzz_ingest.cpp", ROOT / "scripts" / "build-fuzz.sh"]
CORPUS = ROOT / "tests" / "fuzz" / "corpus"
SANITIZERS = ["address", "undefined", "leak"]


class FuzzerUnavailable(RuntimeError):
    """clang++ with libFuzzer is not installed (scripts/install-tools.sh installs it)."""


def runtime_package(cxx: str | None = None) -> str:
    """The Debian package with clang's sanitizer and libFuzzer runtime for the clang++ that is there
    (``libclang-rt-<major>-dev``; only a Recommends of Debian's clang)."""
    cxx = cxx or os.environ.get("CXX", "clang++")
    try:
        out = subprocess.run([cxx, "-dumpversion"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    major = out.split(".")[0]
    return f"libclang-rt-{major}-dev" if major.isdigit() else "libclang-rt-<clang major>-dev"


def build(out_dir: Path = ROOT / "build" / "fuzz") -> Path:
    """Build the harness unless the binary is newer than every source; returns its path."""
    exe = out_dir / "fuzz_ingest"
    if exe.exists() and exe.stat().st_mtime >= max(p.stat().st_mtime for p in SOURCES):
        return exe
    if shutil.which(os.environ.get("CXX", "clang++")) is None:
        raise FuzzerUnavailable("clang++ not found; scripts/install-tools.sh installs clang (with libFuzzer)")
    r = subprocess.run([str(ROOT / "scripts" / "build-fuzz.sh"), str(out_dir)], capture_output=True, text=True)
    if r.returncode != 0:
        if "libclang_rt.fuzzer" in r.stderr or "fsanitize=fuzzer" in r.stderr:
            pkg = runtime_package()
            raise FuzzerUnavailable(f"clang++ has no libFuzzer runtime: install {pkg} (apt-get install {pkg}, "
                                    f"as root; scripts/install-tools.sh does it): {r.stderr.strip()[-300:]}")
        raise RuntimeError(f"building the fuzz harness failed:\n{r.stderr[-3000:]}")
    return exe


def parse_log(text: str) -> dict[str, Any]:
    """The figures a libFuzzer run prints: inputs executed, final coverage, and whether it crashed."""
    runs = [int(m) for m in re.findall(r"stat::number_of_executed_units:\s+(\d+)", text)]
    done = [int(m) for m in re.findall(r"Done (\d+) runs", text)]
    cov = [int(m) for m in re.findall(r"\bcov: (\d+)", text)]
    ft = [int(m) for m in re.findall(r"\bft: (\d+)", text)]
    # Sanitizer reports start "==PID==ERROR: AddressSanitizer/LeakSanitizer/libFuzzer: ..." (libFuzzer's
    # own INFO lines mention LeakSanitizer without reporting anything).
    crashed = bool(re.search(r"==\d+==ERROR|runtime error:|deadly signal|invariant broken|Test unit written to",
                             text))
    return {"inputs": (runs or done or [0])[-1], "cov": max(cov, default=0), "ft": max(ft, default=0),
            "crashed": crashed}


def run_fuzzer(exe: Path, corpus: Path, *, runs: int | None = None, seconds: float | None = None,
               crash_dir: Path, extra: list[str] | None = None, log: Path | None = None) -> dict[str, Any]:
    """One libFuzzer process over `corpus` (it adds what it finds there); returns parse_log's figures."""
    crash_dir.mkdir(parents=True, exist_ok=True)
    cmd = [str(exe), "-print_final_stats=1", "-max_len=1024", "-rss_limit_mb=4096", "-timeout=20",
           f"-artifact_prefix={crash_dir}/"]
    if runs is not None:
        cmd.append(f"-runs={runs}")
    if seconds is not None:
        cmd.append(f"-max_total_time={max(1, round(seconds))}")
    cmd += (extra or []) + [str(corpus)]
    with tempfile.TemporaryFile("w+") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
        out.seek(0)
        text = out.read()
    if log is not None:
        log.write_text(text)
    res = parse_log(text)
    res["returncode"] = rc
    res["crashed"] = res["crashed"] or rc != 0
    res["tail"] = ""
    if res["crashed"]:
        # The report's head (which signal, which invariant, the first frames) and its end; the whole log is
        # kept beside the crash artifacts, as a crash that does not replay alone can only be read there.
        m = re.search(r"==\d+==ERROR|runtime error:|deadly signal|invariant broken", text)
        start = max(0, m.start() - 1000) if m else max(0, len(text) - 4000)
        res["tail"] = text[start:start + 4000]
        kept = crash_dir / f"log-{os.getpid()}-{time.time_ns()}.txt"
        kept.write_text(text)
        res["log"] = str(kept)
    return res


def corpus_coverage(exe: Path, corpus: Path) -> dict[str, int]:
    """Edges and features the inputs in `corpus` reach together (a run that only loads them)."""
    r = subprocess.run([str(exe), "-runs=0", str(corpus)], capture_output=True, text=True)
    m = re.findall(r"INITED cov: (\d+) ft: (\d+)", r.stderr + r.stdout)
    if not m:
        raise RuntimeError(f"no coverage line from the fuzzer:\n{(r.stderr + r.stdout)[-2000:]}")
    return {"edges": int(m[-1][0]), "features": int(m[-1][1])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10_000_000, help="Inputs in all (split over the jobs).")
    ap.add_argument("--jobs", type=int, default=2, help="Fuzzer processes at once.")
    ap.add_argument("--quick", action="store_true", help="200,000 inputs.")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="Stop by this time even if fewer inputs ran (the JSON says how many did).")
    ap.add_argument("--update-corpus", action="store_true",
                    help="Merge what the run found into tests/fuzz/corpus (a minimal covering set).")
    args = ap.parse_args()
    runs = 200_000 if args.quick else args.runs
    load0 = os.getloadavg()
    exe = build()
    crash_dir = ROOT / "build" / "fuzz" / "crashes"
    with tempfile.TemporaryDirectory(prefix="gpuprims-fuzz-") as tmp:
        work = Path(tmp) / "corpus"
        shutil.copytree(CORPUS, work)
        seeds = len(list(work.iterdir()))
        start = corpus_coverage(exe, work)
        t0 = time.monotonic()
        per_job = -(-runs // args.jobs)
        procs = []
        for j in range(args.jobs):
            cmd = [sys.executable, "-c", "import json, sys; from pathlib import Path; from bench.fuzz import run_fuzzer; "
                   "print(json.dumps(run_fuzzer(Path(sys.argv[1]), Path(sys.argv[2]), runs=int(sys.argv[3]), "
                   "seconds=float(sys.argv[7]) or None, crash_dir=Path(sys.argv[4]), extra=[f'-seed={sys.argv[5]}'], "
                   "log=Path(sys.argv[6]))))",
                   str(exe), str(work), str(per_job), str(crash_dir), str(1000 + j), str(Path(tmp) / f"job{j}.log"),
                   str(args.max_seconds or 0)]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True))
        jobs = [json.loads(p.communicate()[0]) for p in procs]
        wall_s = time.monotonic() - t0
        end = corpus_coverage(exe, work)
        found = len(list(work.iterdir()))
        if args.update_corpus:
            merged = Path(tmp) / "merged"
            merged.mkdir()
            # Edges only (no hit counts or comparison features): a few dozen files cover what the run reached.
            subprocess.run([str(exe), "-merge=1", "-use_counters=0", "-use_value_profile=0", str(merged), str(work)],
                           capture_output=True)
            for f in CORPUS.iterdir():
                f.unlink()
            for f in merged.iterdir():
                shutil.copy(f, CORPUS / f.name)
    inputs = sum(j["inputs"] for j in jobs)
    crashes = sum(1 for j in jobs if j["crashed"])
    summary = {"inputs": inputs, "inputs_target": runs, "crashes": crashes, "sanitizers": SANITIZERS, "coverage_edges": end["edges"],
               "coverage_features": end["features"], "coverage_edges_seed_corpus": start["edges"],
               "corpus_files_start": seeds, "corpus_files_end": found, "jobs": args.jobs, "wall_s": round(wall_s, 1),
               "inputs_per_s": round(inputs / wall_s), "target": "native/fuzz/fuzz_ingest.cpp (Ingest::feed, "
               "housekeeping, reclaim, set_route; wire::check_request; answer rings: Pool::answer, raw ring "
               "bytes and tails, held answers)",
               "clang": subprocess.run(["clang++", "--version"], capture_output=True, text=True).stdout.splitlines()[0]}
    print(f"fuzz: {inputs:,} inputs in {wall_s:.0f} s ({summary['inputs_per_s']:,}/s), {crashes} crashed job(s), "
          f"{end['edges']} edges covered ({start['edges']} by the seeds)", flush=True)
    for j in jobs:
        if j["crashed"]:
            print(j["tail"], file=sys.stderr)
    write_result("fuzz", "cpu", summary, {"jobs": [{k: v for k, v in j.items()} for j in jobs]},
                 load_avg_before=load0,
                 notes="Edges are those of the instrumented ingest and pool code (the harness and the invariant "
                       "check are not instrumented), reached by the merged corpus after the run.")
    return 1 if crashes else 0


if __name__ == "__main__":
    sys.exit(main())
