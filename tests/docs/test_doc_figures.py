"""Every figure docs/ quote from a results file agrees with that file: each entry below names a doc,
a line of it (by a piece of text the line holds: a table row's first cell, a sentence's words), the
results JSON under bench/results/, and the summary keys whose values, formatted as the doc prints them,
must appear in that line. A new run of a benchmark that moves a figure fails this test until the doc
is updated (or the entry, when the doc stops quoting the figure)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "cpu-2core"


@dataclass(frozen=True)
class Quoted:
    """Figures a doc's line quotes from one results file."""

    doc: str
    line: str  # text the line holds (the first line holding it is checked)
    results: str  # file under RESULTS
    figures: tuple[tuple[str, str], ...]  # (summary key (see _value), format the doc prints it in)


def _ms(keys: str, fmt: str = "{:.1f}") -> tuple[tuple[str, str], ...]:
    return tuple((k, fmt) for k in keys.split())


OPARA = "docs/opara.md"
ENGINES = "docs/engines.md"
COEXEC = "docs/cpu-coexecution.md"
QUOTED = (
    Quoted(OPARA, "the whole plan 1.", "opara.json",
           _ms("googlenet_planning_ms inception_v3_planning_ms bert_planning_ms", "{:.2f}")),
    Quoted(OPARA, "Algorithm 1 alone 0.", "opara.json",
           _ms("googlenet_allocation_ms inception_v3_allocation_ms bert_allocation_ms", "{:.2f}")),
    Quoted(OPARA, "GoogLeNet 95.0 ms against", "opara.json",
           (*_ms("googlenet_b1_streams_ms googlenet_b1_eager_ms"), ("googlenet_b1_streams_speedup", "({:.2f}x)"))),
    Quoted(OPARA, "(1.32x), and lost on BERT", "opara.json",
           (("inception_v3_b1_streams_speedup", "({:.2f}x)"),)),
    Quoted(OPARA, "branchy CNNs, GoogLeNet", "opara.json", _ms("inception_v3_b1_streams_ms inception_v3_b1_eager_ms")),
    Quoted(OPARA, "and lost on BERT", "opara.json", _ms("bert_b1_streams_ms bert_b1_eager_ms")),
    Quoted(OPARA, "capped one (two streams", "opara.json",
           _ms("googlenet_b1_streams_capped_speedup inception_v3_b1_streams_capped_speedup "
               "bert_b1_streams_capped_speedup", "{:.2f}x")),
    Quoted(OPARA, "At batch 8, where each operator", "opara.json",
           _ms("googlenet_b8_streams_speedup", "{:.2f}x")),
    Quoted(OPARA, "1.04x and 1.03x, capped", "opara.json",
           _ms("inception_v3_b8_streams_speedup bert_b8_streams_speedup googlenet_b8_streams_capped_speedup inception_v3_b8_streams_capped_speedup "
               "bert_b8_streams_capped_speedup", "{:.2f}x")),
    Quoted(OPARA, "sequential mode ran the same models in", "opara.json",
           _ms("googlenet_b1_ort_sequential_ms inception_v3_b1_ort_sequential_ms bert_b1_ort_sequential_ms")),
    Quoted(OPARA, "at batch 1 (4.72x", "opara.json",
           _ms("googlenet_b1_ort_sequential_speedup inception_v3_b1_ort_sequential_speedup "
               "bert_b1_ort_sequential_speedup", "{:.2f}x")),
    Quoted(OPARA, "and 181.0 / 672.5", "opara.json",
           _ms("googlenet_b8_ort_sequential_ms inception_v3_b8_ort_sequential_ms bert_b8_ort_sequential_ms")),
    Quoted(OPARA, "sequential one on all three at both batches", "opara.json",
           _ms("googlenet_b1_ort_parallel_ms inception_v3_b1_ort_parallel_ms bert_b1_ort_parallel_ms")),
    *(Quoted(COEXEC, f"| {m} (", "coexec.json",
             (*((f"sir.{m}.{k}", "{:.1f}") for k in (
                 "mean_latency_ms_gpu_only", "mean_latency_ms_overflow", "p99_ms_gpu_only", "p99_ms_overflow",
                 "throughput_rps_gpu_only", "throughput_rps_overflow")), (f"sir.{m}.cpu_ms", "{:.1f} ms")))
      for m in ("resnet50", "mt_dnn", "siamese")),
    *(Quoted(COEXEC, f"| {m} | ", "coexec.json",
             tuple((f"duet.{m}.{k}", "{:.2f}") for k in ("gpu_only_ms", "cpu_only_ms", "latency_ms",
                                                          "paper_pair_latency_ms"))
             + tuple((f"duet.{m}.{k}", "{:.2f}x") for k in ("speedup_vs_gpu", "speedup_vs_cpu")))
      for m in ("wide_deep", "siamese", "mt_dnn")),
    Quoted(COEXEC, "| latency-optimal (alpha 0)", "coexec.json",
           (("chrion.latency_optimal_latency_ms", "{:.1f}"), ("chrion.latency_optimal_mem_mb", "{:.1f}"),
            ("chrion.paper_latency_optimal_latency_ms", "{:.1f}"), ("chrion.paper_latency_optimal_mem_mb", "{:.1f}"))),
    Quoted(COEXEC, "| memory-optimal (alpha", "coexec.json",
           (("chrion.memory_optimal_latency_ms", "{:.1f}"), ("chrion.memory_optimal_mem_mb", "{:.1f}"),
            ("chrion.paper_memory_optimal_latency_ms", "{:.1f}"), ("chrion.paper_memory_optimal_mem_mb", "{:.1f}"))),
    Quoted(COEXEC, "| CPU only |", "coexec.json", (("chrion.cpu_latency_ms", "{:.1f}"),)),
    Quoted(ENGINES, "first start and, measured here, is well behind", "engines-compile.json",
           (("mobilenet_v2_64_compile_t1_b1_speedup", "{:.2f}x eager"),)),
    Quoted(ENGINES, "at batch 1 against ONNX Runtime's", "engines.json",
           (("mobilenet_v2_64_onnxruntime_t1_b1_speedup", "ONNX Runtime's {:.2f}x"),)),
    Quoted(ENGINES, "at batch 1 against ONNX Runtime's", "engines-compile.json",
           (("mobilenet_v2_64_compile_build_cold_ms/1000", "{:.0f} s cold build"),)),
    *(Quoted(COEXEC, f"| overflow {state} |", "coexec.json#live_overflow",
             (*((f"{k}_{state}", "{:.1f}") for k in ("throughput_rps", "p50_ms", "p99_ms")),
              (f"slo_attainment_{state}", "{:.1%}"), (f"lost_{state}", "| {:d} |")))
      for state in ("off", "on")),
    Quoted(COEXEC, "| overflow on |", "coexec.json#live_overflow",
           (("split_routed_accelerator", "{:d} / "), ("split_routed_cpu", " / {:d}"))),
    Quoted(COEXEC, "capacity as estimated in-process just before", "coexec.json#live_overflow",
           (("accel_capacity_rps", "({:.0f} rps"),)),
)


@cache
def _summary(name: str) -> dict[str, Any]:
    """A results file's summary; ``file.json#section``: the summary of a section run apart."""
    file, _, section = name.partition("#")
    doc = json.loads((RESULTS / file).read_text())
    return (doc[section] if section else doc)["summary"]


def _value(summary: dict[str, Any], key: str) -> Any:
    """``a.b``: nested; ``key/1000``: the value divided (ms quoted in s)."""
    key, _, div = key.partition("/")
    v: Any = summary
    for part in key.split("."):
        v = v[part]
    return v / float(div) if div else v


@pytest.mark.parametrize("q", QUOTED, ids=lambda q: f"{q.doc}:{q.line.strip('| (')[:30]}")
def test_a_quoted_figure_is_its_results_files(q: Quoted) -> None:
    lines = [ln for ln in (ROOT / q.doc).read_text().splitlines() if q.line in ln]
    assert lines, f"{q.doc} has no line holding {q.line!r} (update the entry if the doc changed)"
    summary = _summary(q.results)
    missing = [f"{key} = {fmt.format(_value(summary, key))}" for key, fmt in q.figures
               if fmt.format(_value(summary, key)) not in lines[0]]
    assert not missing, f"{q.doc}: the line {lines[0]!r} does not quote {q.results}'s {missing}"


def test_every_results_file_named_exists() -> None:
    for name in {q.results for q in QUOTED}:
        assert (RESULTS / name.partition("#")[0]).is_file(), name
