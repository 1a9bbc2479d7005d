"""A few seconds of the libFuzzer harness of the native ingest (bench/fuzz.py runs it for 10^7 inputs).

The harness (native/fuzz/fuzz_ingest.cpp) checks the ingest's slot, record and request accounting
after every step and aborts on a broken invariant; ASan and UBSan abort on memory errors and undefined
behaviour. Here it replays the committed corpus (regressions) and then fuzzes from it briefly.
"""

from __future__ import annotations

import shutil

import pytest

from bench.fuzz import CORPUS, FuzzerUnavailable, build, corpus_coverage, run_fuzzer

pytestmark = pytest.mark.tools


@pytest.fixture(scope="module")
def fuzzer(tmp_path_factory: pytest.TempPathFactory):
    try:
        return build()
    except FuzzerUnavailable as e:
        pytest.skip(f"{e}")


def test_corpus_replays_clean_and_covers_the_ingest(fuzzer, tmp_path) -> None:
    res = run_fuzzer(fuzzer, CORPUS, runs=0, crash_dir=tmp_path / "crashes")
    assert not res["crashed"], res["tail"]
    cov = corpus_coverage(fuzzer, CORPUS)
    # The corpus reaches most of the ingest: header checks, reassembly, admission, expiry, reclaim.
    assert cov["edges"] > 400


def test_a_short_fuzz_run_finds_nothing(fuzzer, tmp_path) -> None:
    work = tmp_path / "corpus"
    shutil.copytree(CORPUS, work)
    res = run_fuzzer(fuzzer, work, seconds=3, crash_dir=tmp_path / "crashes")
    assert not res["crashed"], res["tail"]
    assert res["inputs"] > 1000
    assert not list((tmp_path / "crashes").iterdir())


def test_the_ingest_reads_time_only_through_its_clock() -> None:
    # The fuzz harness drives the ingest on a fake clock (set_clock). A read of the wall clock in the
    # ingest made its behaviour depend on how fast the machine ran: a refused request's key was
    # remembered for 20 ms of wall time, so on a busy machine its next datagram was refused (and
    # answered) again, and a long run aborted in a way its input never replayed. Every read goes
    # through clock_ (whose default is now_ns).
    src = (CORPUS.parents[2] / "native" / "src" / "ingest.cpp").read_text()
    assert "now_ns()" not in src and "clock_gettime" not in src
