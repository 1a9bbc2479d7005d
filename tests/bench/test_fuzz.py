"""bench/fuzz's reading of libFuzzer's output (the fuzzer itself runs in tests/gpuprims/test_ingest_fuzz.py)."""

from __future__ import annotations

from pathlib import Path

from bench import fuzz
from bench.fuzz import parse_log

CLEAN = """INFO: Seed: 1000
#85	INITED cov: 668 ft: 2232 corp: 61/734b exec/s: 0 rss: 40Mb
#4096	pulse  cov: 690 ft: 4000 corp: 300/9Kb lim: 1024 exec/s: 2048 rss: 300Mb
INFO: libFuzzer disabled leak detection after every mutation.
      Most likely the target function accumulates allocated
      memory in a global state w/o actually leaking it.
      If LeakSanitizer is enabled in this process it will still
      run on the process shutdown.
Done 5000000 runs in 2528 second(s)
stat::number_of_executed_units: 5000000
"""


def test_a_clean_run_is_counted_and_not_a_crash() -> None:
    assert parse_log(CLEAN) == {"inputs": 5000000, "cov": 690, "ft": 4000, "crashed": False}


def test_sanitizer_reports_and_broken_invariants_are_crashes() -> None:
    for report in ("==123==ERROR: AddressSanitizer: heap-buffer-overflow on address 0x6",
                   "native/src/ingest.cpp:501:7: runtime error: shift exponent 64 is too large",
                   "==9==ERROR: LeakSanitizer: detected memory leaks",
                   "fuzz_ingest: invariant broken: slot 3 is neither free nor held (leaked)",
                   "==1== ERROR: libFuzzer: deadly signal"):
        assert parse_log(CLEAN + report + "\n")["crashed"], report


def test_runtime_package_names_the_debian_package_of_the_clang_there(tmp_path: Path) -> None:
    fake = tmp_path / "clang++"
    fake.write_text("#!/bin/sh\necho 19.1.7\n")
    fake.chmod(0o755)
    assert fuzz.runtime_package(str(fake)) == "libclang-rt-19-dev"
    assert fuzz.runtime_package(str(tmp_path / "absent")) == "libclang-rt-<clang major>-dev"  # said, not raised
