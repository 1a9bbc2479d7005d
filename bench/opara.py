"""bench/opara: Opara's planner and its CPU stream executor, with the paper's figures beside ours (issue 24).

For GoogLeNet (224x224), Inception-v3 (299x299) and the BERT-base-like encoder (32 tokens) of the zoo:

- **Planning**: the operator graph (``gpuprims.opara.op_graph``: the fx trace, one run of the model for
  the shapes, the operators' classes and demands, the graph's integer index; built once, not timed) is
  planned ``--plan-repeats`` times by ``plan_streams``. The paper's Table I ("computation time of the
  stream allocation algorithm", Sec. 5.3: GoogLeNet 0.27 ms, Inception-v3 0.50 ms, BERT 0.58 ms, T5
  2.8 ms) times Algorithm 1 alone, on a graph already built, and leaves out profiling (its 4.25 ms,
  reported apart) and capture. Ours to compare with it is ``<m>_allocation_ms``: Algorithm 1 alone
  (``StreamPlan.allocation_ms``, ``perf_counter_ns`` around it inside ``plan_streams``), beside
  ``<m>_paper_allocation_ms``. ``<m>_planning_ms`` is the whole plan, which the paper does not time:
  Algorithm 2's launch order, Algorithm 1, the cap, the minimal waits and the plan's fields by name.
  Medians and minima of both, and the plan's streams, events and waits (the paper: 28 streams for
  GoogLeNet).
- **CPU**: at batch 1 and 8, the median latency of eager torch, of the CPU stream executor
  (``gpuprims.opara.cpu_exec``) on the uncapped plan with eager's intra-op threads (bit-identical to
  eager), and on a plan capped to the cores with one intra-op thread per stream, and of ONNX Runtime
  (the model exported with ``torch.onnx.export``) in its sequential and its parallel execution mode
  (``ExecutionMode.ORT_PARALLEL``, inter-op threads = cores) when ``onnxruntime`` is installed
  (``pip install -e '.[onnx]'``). The modes run interleaved, one call each per round, so a busy
  machine slows them alike; each timed call follows an untimed one of the same mode, so a mode is not
  timed while the previous mode's idle workers still spin. Whether each output equals eager is
  recorded beside it.
- **GPU rows** (eager, single-stream CUDA graph, Opara at 100 % and 25 % MPS share) are ``null`` here:
  the GPU host script of the engines issue fills them on a GPU.

**Bounded time.** ``--max-seconds`` (default 900) bounds the whole run: it is shared out over the
(model, batch) rows still to run, so time a fast row leaves passes on to the slower ones. A row stops
timing once its share is spent and it has ``MIN_TIMED`` timed rounds (its ``<m>_b<B>_stopped_by_budget``
says so); a row whose turn comes after the limit is skipped (null figures). Rows at batch > 1 take
``--repeats-batched`` rounds (default 8; BERT and Inception-v3 at batch 8 take seconds per call), rows
at batch 1 ``--repeats`` (default 30). A progress line goes to stdout as each row starts and ends, and
at most every 10 s within it.

``--quick`` runs tiny variants (width 0.125, 32x32 and 75x75 inputs, BERT at 8 tokens of 48, few repeats) to check that the
script works; its figures mean nothing, so it writes ``opara-quick.json`` (never over ``opara.json``).
Writes ``bench/results/<machine>/opara.json`` and ``.png`` (``--out DIR``: elsewhere). Reports, never
asserts.

Run: ``python -m bench.opara [--quick] [--batches 1,8] [--max-seconds 900]``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.common import load_note, write_result

#: The paper's Table I (Alg. 1 computation time, ms) and its stream counts (Sec. 5.2).
PAPER_ALLOCATION_MS: Mapping[str, float] = {"googlenet": 0.27, "inception_v3": 0.50, "bert": 0.58, "t5": 2.8}
PAPER_STREAMS: Mapping[str, int | None] = {"googlenet": 28, "inception_v3": None, "bert": None, "t5": 6}
#: The paper's batch-1 speed-ups of Opara (GPU): over eager 1.85-4.18x, over one CUDA graph up to 1.68x.
PAPER_NOTES = ("paper (RTX 2080 SUPER / A100): Opara 1.85-4.18x over PyTorch eager and up to 1.68x over a "
               "single-stream CUDA graph at batch 1; Inception-v3 1.41x over the CUDA graph at batch 1, 1.09x at 32")

#: (model, full input shape, quick input shape).
MODELS: tuple[tuple[str, tuple[int, int, int], tuple[int, int, int]], ...] = (
    ("googlenet", (3, 224, 224), (3, 32, 32)),
    ("inception_v3", (3, 299, 299), (3, 75, 75)),
    ("bert", (1, 32, 768), (1, 8, 48)),
)

#: CPU modes in the order each round runs them.
CPU_MODES = ("eager", "streams", "streams_capped", "ort_sequential", "ort_parallel")
#: GPU rows the GPU host script fills.
GPU_MODES = ("gpu_eager", "gpu_graph", "gpu_opara_100pct", "gpu_opara_25pct")
#: Timed rounds a row keeps even when its share of --max-seconds is spent.
MIN_TIMED = 3
#: Seconds between progress lines within a row.
PROGRESS_EVERY_S = 10.0


class Budget:
    """The run's time limit (``--max-seconds``) shared out over the (model, batch) rows still to run."""

    def __init__(self, max_seconds: float, rows: int, clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(max_seconds, bool) or not (math.isfinite(max_seconds) and max_seconds > 0):
            raise ValueError(f"max_seconds must be a positive finite number, got {max_seconds!r}")
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows!r}")
        self.clock = clock
        self.start = clock()
        self.deadline = self.start + max_seconds
        self.rows_left = rows

    def elapsed_s(self) -> float:
        """Seconds since the run began."""
        return self.clock() - self.start

    def next_row(self) -> float | None:
        """The clock time by which the next row should stop timing (an equal share of what is left of
        the limit), or None when the limit is spent (the row is skipped)."""
        now = self.clock()
        rows, self.rows_left = max(self.rows_left, 1), self.rows_left - 1
        left = self.deadline - now
        return None if left <= 0 else now + left / rows


def timed_rounds(warmup: int, repeats: int, row_deadline: float,
                 clock: Callable[[], float] = time.monotonic) -> Iterator[tuple[int, bool]]:
    """Rounds of a row as ``(round, timed)``: ``warmup`` untimed, then up to ``repeats`` timed ones,
    ending early once ``row_deadline`` has passed and ``MIN_TIMED`` timed rounds are in."""
    for i in range(warmup + repeats):
        timed = i - warmup
        if timed >= MIN_TIMED and clock() > row_deadline:
            return
        yield i, i >= warmup


def timing_summary(samples_ms: Sequence[float]) -> dict[str, float | None]:
    """Median and minimum of a list of times (ms); None for an empty list."""
    if not samples_ms:
        return {"median": None, "min": None}
    return {"median": float(statistics.median(samples_ms)), "min": float(min(samples_ms))}


def planning_rows(model: str, planning_ms: Sequence[float], allocation_ms: Sequence[float],
                  plan: Mapping[str, Any]) -> dict[str, Any]:
    """Flat summary keys of one model's planning, the paper's figures beside ours."""
    p, a = timing_summary(planning_ms), timing_summary(allocation_ms)
    return {
        f"{model}_planning_ms": p["median"],
        f"{model}_planning_min_ms": p["min"],
        f"{model}_allocation_ms": a["median"],
        f"{model}_allocation_min_ms": a["min"],
        f"{model}_paper_allocation_ms": PAPER_ALLOCATION_MS.get(model),
        f"{model}_streams": plan["num_streams"],
        f"{model}_paper_streams": PAPER_STREAMS.get(model),
        f"{model}_events": plan["num_events"],
        f"{model}_waits": plan["num_waits"],
        f"{model}_ops": plan["ops"],
    }


def latency_rows(model: str, batch: int, samples: Mapping[str, Sequence[float]],
                 equal: Mapping[str, bool | None]) -> dict[str, Any]:
    """Flat summary keys of one model and batch: median ms per mode, speed-up over eager, equality."""
    out: dict[str, Any] = {}
    eager = timing_summary(samples.get("eager", ()))["median"]
    for mode in CPU_MODES:
        med = timing_summary(samples.get(mode, ()))["median"]
        out[f"{model}_b{batch}_{mode}_ms"] = med
        if mode != "eager":
            out[f"{model}_b{batch}_{mode}_speedup"] = (eager / med) if eager and med else None
            out[f"{model}_b{batch}_{mode}_equal_eager"] = equal.get(mode)
    for mode in GPU_MODES:
        out[f"{model}_b{batch}_{mode}_ms"] = None
    return out


def _onnx_sessions(model: Any, x: Any, cores: int, tmp: Path) -> dict[str, Callable[[Any], Any]]:
    """ONNX Runtime sessions of ``model`` (sequential and parallel), or {} when onnxruntime is missing."""
    try:
        import onnxruntime as ort
    except ImportError:
        return {}
    import torch

    path = tmp / "model.onnx"
    torch.onnx.export(model, (x,), str(path), input_names=["input"], output_names=["logits"], dynamo=False)
    sessions: dict[str, Callable[[Any], Any]] = {}
    for mode, execution in (("ort_sequential", ort.ExecutionMode.ORT_SEQUENTIAL),
                            ("ort_parallel", ort.ExecutionMode.ORT_PARALLEL)):
        opts = ort.SessionOptions()
        opts.execution_mode = execution
        opts.intra_op_num_threads = cores
        # ORT's pools spin after a run by default, taking the cores from whatever runs next (the other
        # modes run interleaved): off, as on a shared edge server.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
        if execution == ort.ExecutionMode.ORT_PARALLEL:
            opts.inter_op_num_threads = cores
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])

        def run(arr: Any, sess: Any = sess) -> Any:
            return sess.run(None, {"input": arr})[0]

        sessions[mode] = run
    return sessions


def bench_model(name: str, shape: tuple[int, int, int], *, width: float, batches: Sequence[int],
                plan_repeats: int, repeats: int, repeats_batched: int, warmup: int, cores: int,
                budget: Budget) -> tuple[dict[str, Any], dict[str, Any]]:
    """Planning and CPU latency of one model within ``budget``; returns (summary keys, raw samples)."""
    import numpy as np
    import torch

    from apps.zoo import build_model
    from gpuprims.opara import op_graph, plan_streams
    from gpuprims.opara.cpu_exec import StreamExecutor

    model = build_model(name, input_shape=shape, width=width)
    summary: dict[str, Any] = {}
    samples: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(0)
    for batch in batches:
        row_deadline = budget.next_row()
        first = batch == batches[0]
        if row_deadline is None and not first:
            _skip_row(summary, name, batch, budget)
            continue
        x = torch.randn(batch, *shape, generator=gen)
        graph = op_graph(model, x)
        if first:  # planning takes a second at most: it runs even when the latency row is skipped
            planning, allocation = [], []
            for _ in range(plan_repeats):
                p = plan_streams(graph)
                planning.append(p.planning_ms)
                allocation.append(p.allocation_ms)
            summary.update(planning_rows(name, planning, allocation, p.describe()))
            capped = plan_streams(graph, max_streams=cores)
            summary[f"{name}_capped_streams"] = capped.num_streams
            summary[f"{name}_capped_events"] = capped.num_events
            summary[f"{name}_first_free_streams"] = plan_streams(graph, rule="first_free").num_streams
            samples[f"{name}_planning_ms"] = planning
            samples[f"{name}_allocation_ms"] = allocation
        if row_deadline is None:
            _skip_row(summary, name, batch, budget)
            continue
        n_rounds = repeats if batch == 1 else repeats_batched
        print(f"[{budget.elapsed_s():7.1f} s] {name} b{batch}: up to {n_rounds} rounds, "
              f"{max(row_deadline - time.monotonic(), 0.0):.0f} s of the budget left", flush=True)
        plan = plan_streams(graph)
        capped = plan_streams(graph, max_streams=cores)
        with torch.inference_mode():
            want = model(x)
        arr = x.numpy()
        with tempfile.TemporaryDirectory() as tmp, \
                StreamExecutor(graph, plan) as streams, \
                StreamExecutor(graph, capped, intra_op_threads=1) as streams_capped:
            ort_runs = _onnx_sessions(model, x, cores, Path(tmp))
            runs: dict[str, Callable[[], Any]] = {
                "eager": lambda x=x: model(x),
                "streams": lambda x=x: streams(x),
                "streams_capped": lambda x=x: streams_capped(x),
            }
            for mode, fn in ort_runs.items():
                runs[mode] = lambda fn=fn, arr=arr: fn(arr)
            equal: dict[str, bool | None] = {}
            with torch.inference_mode():
                for mode, fn in runs.items():
                    out = fn()
                    got = torch.from_numpy(np.asarray(out)) if not isinstance(out, torch.Tensor) else out
                    equal[mode] = bool(torch.equal(got, want))
                    samples[f"{name}_b{batch}_{mode}_max_abs_diff"] = float((got - want).abs().max())
                times: dict[str, list[float]] = {m: [] for m in runs}
                said = time.monotonic()
                for i, timed in timed_rounds(warmup if batch == 1 else 1, n_rounds, row_deadline):
                    if time.monotonic() - said >= PROGRESS_EVERY_S:
                        said = time.monotonic()
                        print(f"[{budget.elapsed_s():7.1f} s] {name} b{batch}: round {i + 1}, "
                              f"{len(times['eager'])} timed", flush=True)
                    for mode, fn in runs.items():
                        # One untimed call first: the previous mode's idle OpenMP or ORT workers may still
                        # be spinning on the cores right after it (28-36 of them for the stream executor).
                        fn()
                        t0 = time.perf_counter_ns()
                        fn()
                        if timed:
                            times[mode].append((time.perf_counter_ns() - t0) / 1e6)
        summary.update(latency_rows(name, batch, times, equal))
        done = len(times["eager"])
        summary[f"{name}_b{batch}_rounds"] = done
        summary[f"{name}_b{batch}_stopped_by_budget"] = done < n_rounds
        samples[f"{name}_b{batch}_ms"] = times
        print(f"[{budget.elapsed_s():7.1f} s] {name} b{batch}: {done} timed rounds: " + ", ".join(
            f"{m} {statistics.median(t):.2f} ms" for m, t in times.items() if t), flush=True)
    return summary, samples


def _skip_row(summary: dict[str, Any], name: str, batch: int, budget: Budget) -> None:
    """A latency row left out because --max-seconds is spent: null figures, 0 rounds, said so."""
    print(f"[{budget.elapsed_s():7.1f} s] {name} b{batch}: skipped (--max-seconds spent)", flush=True)
    summary.update(latency_rows(name, batch, {}, {}))
    summary[f"{name}_b{batch}_rounds"] = 0
    summary[f"{name}_b{batch}_stopped_by_budget"] = True


def plot(path: Path, summary: Mapping[str, Any], models: Sequence[str], batches: Sequence[int]) -> None:
    """Planning time beside the paper's, and CPU latency per mode, model and batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    xs = range(len(models))
    ours = [summary.get(f"{m}_allocation_ms") or 0.0 for m in models]
    whole = [summary.get(f"{m}_planning_ms") or 0.0 for m in models]
    paper = [summary.get(f"{m}_paper_allocation_ms") or 0.0 for m in models]
    ax1.bar([x - 0.27 for x in xs], paper, 0.27, label="paper, Alg. 1")
    ax1.bar(list(xs), ours, 0.27, label="ours, Alg. 1")
    ax1.bar([x + 0.27 for x in xs], whole, 0.27, label="ours, whole plan")
    ax1.set_xticks(list(xs), models)
    ax1.set_ylabel("planning time (ms, median)")
    ax1.legend()
    groups = [(m, b) for m in models for b in batches]
    width = 0.8 / len(CPU_MODES)
    for k, mode in enumerate(CPU_MODES):
        vals = [summary.get(f"{m}_b{b}_{mode}_ms") or 0.0 for m, b in groups]
        ax2.bar([i + (k - len(CPU_MODES) / 2 + 0.5) * width for i in range(len(groups))], vals, width, label=mode)
    ax2.set_xticks(range(len(groups)), [f"{m}\nbatch {b}" for m, b in groups])
    ax2.set_ylabel("CPU latency (ms, median)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny variants and few repeats: checks the script works")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds per row at batch 1 (default 30)")
    ap.add_argument("--repeats-batched", type=int, default=None,
                    help="timed rounds per row at batch > 1 (default 8)")
    ap.add_argument("--plan-repeats", type=int, default=None)
    ap.add_argument("--max-seconds", type=float, default=900.0,
                    help="bound on the whole run, shared out over the rows (default 900)")
    ap.add_argument("--out", type=Path, default=None, help="write the results here instead of bench/results/")
    args = ap.parse_args(argv)
    import torch

    batches = [int(b) for b in args.batches.split(",") if b]
    if not batches or any(b < 1 for b in batches):
        ap.error(f"--batches must list positive integers, got {args.batches!r}")
    for label, v in (("--repeats", args.repeats), ("--repeats-batched", args.repeats_batched),
                     ("--plan-repeats", args.plan_repeats)):
        if v is not None and v < 1:
            ap.error(f"{label} must be >= 1, got {v}")
    if not (math.isfinite(args.max_seconds) and args.max_seconds > 0):
        ap.error(f"--max-seconds must be a positive number, got {args.max_seconds}")
    repeats = args.repeats or (3 if args.quick else 30)
    repeats_batched = args.repeats_batched or (2 if args.quick else 8)
    plan_repeats = args.plan_repeats or (5 if args.quick else 200)
    budget = Budget(args.max_seconds, len(MODELS) * len(batches))
    cores = len(os.sched_getaffinity(0))
    before = os.getloadavg()
    summary: dict[str, Any] = {"cores": cores, "torch_threads": torch.get_num_threads(), "quick": args.quick,
                               "max_seconds": args.max_seconds}
    samples: dict[str, Any] = {}
    for name, full, small in MODELS:
        s, raw = bench_model(name, small if args.quick else full,
                             width=0.125 if args.quick and name != "bert" else 1.0,
                             batches=batches, plan_repeats=plan_repeats, repeats=repeats,
                             repeats_batched=repeats_batched, warmup=1 if args.quick else 3, cores=cores,
                             budget=budget)
        summary.update(s)
        samples.update(raw)
    for name in ("t5",):
        summary[f"{name}_allocation_ms"] = None
        summary[f"{name}_planning_ms"] = None
        summary[f"{name}_paper_allocation_ms"] = PAPER_ALLOCATION_MS[name]
    summary["elapsed_s"] = round(budget.elapsed_s(), 1)
    notes = (
        "Planning: allocation_ms is Algorithm 1 alone on the built graph, what the paper's Table I times "
        "(paper_allocation_ms); planning_ms is the whole plan, which the paper does not time (Alg. 2 launch "
        "order, Alg. 1, the minimal waits, the plan by name); neither includes building the graph (fx trace, "
        "one run for the shapes). CPU: 'streams' is the uncapped plan on one thread "
        "per stream with eager's intra-op threads (bit-identical to eager); 'streams_capped' is the plan capped "
        "to the cores with one intra-op thread per stream (equal within float rounding); ort_* are ONNX "
        "Runtime's sequential and parallel execution modes (null when onnxruntime is not installed). GPU rows "
        "are null: the GPU host script of the engines issue fills them (eager, single-stream CUDA graph, Opara "
        f"at 100 % and 25 % MPS share). BERT is the zoo's BERT-base-like encoder at 32 tokens; no T5 in the zoo: its "
        f"row is null. {PAPER_NOTES}."
    )
    if args.quick:
        notes = "QUICK RUN (tiny variants, few repeats): checks the script; the figures mean nothing. " + notes
    notes += load_note(before)
    path = write_result("opara", "cpu", summary, samples, notes=notes, load_avg_before=before,
                        name="opara-quick" if args.quick else None, out_dir=args.out)
    plot(path.with_suffix(".png"), summary, [m for m, _, _ in MODELS], batches)
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
