"""The papers' headline comparisons, simulated from profiles: ``gpuprims-sim --scenario paper-sir|paper-duet|paper-chrion``.

Accelerator profiles come from the papers' tables (``gpuprims/coexec/profiles/paper/*.json``, ``source: "paper"``,
each stage naming its table row); CPU profiles were measured on this machine's cores
(``gpuprims/coexec/profiles/cpu/*.json``, made by ``gpuprims-profile --device cpu --stages`` and, for the LSTM cell,
``fx_exec.measure_lstm_cell_ms``; see docs/cpu-coexecution.md). A scenario pairs the two, runs the
planner on the pair, and reports beside it what the paper reports (``paper_*`` keys) and, where the
paper gives CPU times too, the same planner on the paper's own pair (``paper_pair``). Our CPU cores
run our scaled zoo models, the papers' accelerators ran theirs; the pairing is what an operator with
that accelerator and this CPU would get from the planner, not a re-measurement of the paper.

Every figure here is simulated or planned (``"simulated": true``), none is a live run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

from gpuprims.coexec.graph import CPU, GPU, PCIE, Link, TaskGraph, schedule
from gpuprims.coexec.oppart import CpuCores, chrion_plan, lstm_graph, memory_optimal
from gpuprims.coexec.overflow import DEFAULT_ALPHA_MS, OverflowRouter, simulate_overflow
from gpuprims.coexec.subgraph import duet
from gpuprims.profile.format import Profile, load_profile, merge_stage_latencies, paper_profile

#: SIR+ (SYSTOR'22) on PF1 (Titan RTX + Xeon Gold 6230), FasterRCNN: Table 6 (mean latency savings at
#: high load, RPS=15), section 7.1 (P99 at 15 RPS), Table 7 (peak throughput, 1 GPU).
PAPER_SIR = {"model": "FasterRCNN (PF1)", "mean_latency_saving_pct_high_load": 51.9, "p99_saving_pct_high_load": 45.0,
             "throughput_rps_gpu_only": 15.6, "throughput_rps_overflow": 18.7, "throughput_gain_pct": 19.9}

#: DUET (IPDPS'21): Table II placements and the abstract's speed-up ranges (Fig. 11 gives no numbers).
PAPER_DUET = {
    "wide_deep": {"gpu": ["wide", "deep", "cnn"], "cpu": ["rnn", "merge"]},
    "siamese": {"gpu": ["left"], "cpu": ["right", "merge"]},
    "mt_dnn": {"gpu": ["encoder", "heads.0", "heads.1", "heads.2", "heads.3", "heads.7", "heads.9"],
               "cpu": ["heads.4", "heads.5", "heads.6", "heads.8"]},
    "speedup_vs_gpu_range": [1.5, 2.3], "speedup_vs_cpu_range": [1.3, 6.4],
}

#: Chrion Table 6, baseline LSTM (12 layers, batch 8, io 64, seq 96) on a 1080 Ti + Xeon E5-2685 v3.
PAPER_CHRION = {"gpu_latency_ms": 59.3, "gpu_mem_mb": 1643.0, "cpu_latency_ms": 70.6,
                "latency_optimal_latency_ms": 52.0, "latency_optimal_mem_mb": 948.1,
                "memory_optimal_latency_ms": 58.4, "memory_optimal_mem_mb": 629.0,
                "latency_optimal_latency_reduction_pct": 12.3, "latency_optimal_mem_reduction_pct": 42.3,
                "memory_optimal_mem_reduction_pct": 61.7}

#: The alpha grid (ms per MB) of the memory-optimal search.
CHRION_ALPHAS = (0.0, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def bundled(kind: str, model: str) -> Profile:
    """A committed profile: ``kind`` is ``"paper"`` (accelerator, from a paper) or ``"cpu"`` (measured here)."""
    if kind not in ("paper", "cpu"):
        raise ValueError(f"kind must be 'paper' or 'cpu', got {kind!r}")
    ref = resources.files("gpuprims.coexec").joinpath("profiles", kind, f"{model}.json")
    if not ref.is_file():
        raise ValueError(f"no bundled {kind} profile for {model!r}")
    with resources.as_file(ref) as f:
        return load_profile(f)


def _cell_profile() -> dict[str, Any]:
    ref = resources.files("gpuprims.coexec").joinpath("profiles", "cpu", "lstm_cell.json")
    with resources.as_file(ref) as f:
        return json.loads(f.read_text())


# ---- SIR+ ----------------------------------------------------------------------------------------------


def _sir_model(model: str, accel_ms: float, accel_src: str, cpu: Profile, *, loads: Sequence[float],
               requests: int, seed: int, alpha_ms: float) -> dict[str, Any]:
    cores = cpu.cpu_cores or 1
    one_core_pct = min(cpu.gpu_pcts, key=lambda g: abs(g - 100.0 / cores))
    cpu_ms = cpu.latency_ms(1, one_core_pct)
    cap = 1000.0 / accel_ms
    rows = []
    for load in loads:
        rate = load * cap
        kw = {"rate_rps": rate, "duration_s": requests / rate, "warmup_s": 0.1 * requests / rate,
              "accel_ms": accel_ms, "cpu_ms": cpu_ms, "cpu_workers": cores, "seed": seed}
        base = simulate_overflow(router=None, **kw)
        over = simulate_overflow(router=OverflowRouter(accel_ms, cpu_ms, alpha_ms=alpha_ms, cpu_workers=cores), **kw)
        rows.append({"load": load, "offered_rps": rate,
                     "gpu_only": {k: v for k, v in base.items() if k != "latencies_ms"},
                     "overflow": {k: v for k, v in over.items() if k != "latencies_ms"}})
    high = max((r for r in rows if r["load"] <= 1.0), key=lambda r: r["load"])
    # Throughput is what each serves when offered more than both devices together can take.
    sat_rate = 1.5 * (cap + cores * 1000.0 / cpu_ms)
    kw = {"rate_rps": sat_rate, "duration_s": requests / sat_rate, "warmup_s": 0.1 * requests / sat_rate,
          "accel_ms": accel_ms, "cpu_ms": cpu_ms, "cpu_workers": cores, "seed": seed}
    sat = {"gpu_only": simulate_overflow(router=None, **kw),
           "overflow": simulate_overflow(router=OverflowRouter(accel_ms, cpu_ms, alpha_ms=alpha_ms, cpu_workers=cores),
                                         **kw)}

    def saving(key: str) -> float:
        b, o = high["gpu_only"][key], high["overflow"][key]
        return 100.0 * (b - o) / b

    tb, to = sat["gpu_only"]["throughput_rps"], sat["overflow"]["throughput_rps"]
    return {
        "accel_ms": accel_ms, "accel_source": accel_src, "cpu_ms": cpu_ms, "cpu_workers": cores,
        "cpu_source": f"measured here: {cpu.device}, {cpu.conditions.date}", "alpha_ms": alpha_ms,
        "high_load": high["load"], "mean_latency_saving_pct": saving("latency_mean_ms"),
        "p99_saving_pct": saving("latency_p99_ms"), "mean_latency_ms_gpu_only": high["gpu_only"]["latency_mean_ms"],
        "mean_latency_ms_overflow": high["overflow"]["latency_mean_ms"],
        "p99_ms_gpu_only": high["gpu_only"]["latency_p99_ms"], "p99_ms_overflow": high["overflow"]["latency_p99_ms"],
        "overflow_share_high_load": high["overflow"]["overflow_share"],
        "throughput_rps_gpu_only": tb, "throughput_rps_overflow": to,
        "throughput_gain_pct": 100.0 * (to - tb) / tb if tb else math.nan, "saturation_offered_rps": sat_rate,
        "by_load": rows,
    }


def paper_sir(*, loads: Sequence[float] = (0.5, 0.8, 0.96, 1.3), requests: int = 20000, seed: int = 0,
              alpha_ms: float = DEFAULT_ALPHA_MS) -> dict[str, Any]:
    """Request overflow at rising load with and without the router, for three models.

    ``resnet50``: accelerator = the bundled paper profile of the GPU runtime primitives paper (V100,
    batch 1 at 100%); ``siamese`` and ``mt_dnn``: the DUET TITAN V times of their subgraphs, run one
    after another. (The CPU runs resnet50 ~100x slower than the V100, mt_dnn a few times slower, the
    small siamese LSTMs faster: the three regimes of request overflow.)
    CPU: this machine's measured latency on one core, one CPU worker per core. ``loads`` are
    fractions of the accelerator's capacity; the highest at most 1.0 is "high load" (SIR+'s 15 RPS
    against a 15.6 RPS peak is 0.96). Throughput is measured offered 1.5x what both devices can serve.
    """
    r50 = paper_profile("resnet50")
    sia = bundled("paper", "siamese")
    mt = bundled("paper", "mt_dnn")
    models = {
        "resnet50": (r50.latency_ms(1, 100), f"paper: {r50.device}, batch 1 at 100% (gpu-runtime-primitives)",
                     bundled("cpu", "resnet50")),
        "siamese": (sum(s.latency_ms[GPU] for s in sia.stages), f"paper: {sia.device}, DUET Table II subgraphs in sequence",
                    bundled("cpu", "siamese")),
        "mt_dnn": (sum(s.latency_ms[GPU] for s in mt.stages), f"paper: {mt.device}, DUET Table II subgraphs in sequence",
                   bundled("cpu", "mt_dnn")),
    }
    out: dict[str, Any] = {"simulated": True, "scenario": "paper-sir", "models": {}}
    for name, (accel, src, cpu) in models.items():
        out["models"][name] = _sir_model(name, accel, src, cpu, loads=loads, requests=requests, seed=seed,
                                         alpha_ms=alpha_ms)
    out["paper"] = PAPER_SIR
    return out


# ---- DUET ------------------------------------------------------------------------------------------------


def _duet_summary(graph: TaskGraph, link: Link) -> dict[str, Any]:
    plan = duet(graph, link=link)
    gpu_ms = schedule(graph, graph.single_device(GPU), link=link).makespan_ms
    cpu_ms = schedule(graph, graph.single_device(CPU), link=link).makespan_ms
    return {"latency_ms": plan.cost, "gpu_only_ms": gpu_ms, "cpu_only_ms": cpu_ms,
            "speedup_vs_gpu": gpu_ms / plan.cost, "speedup_vs_cpu": cpu_ms / plan.cost,
            "fallback": plan.fallback, "gpu": plan.on(GPU), "cpu": plan.on(CPU),
            "greedy": plan.notes["greedy"], "measure_calls": plan.notes["measure_calls"]}


def paper_duet(*, link: Link = PCIE) -> dict[str, Any]:
    """DUET at batch 1 for Wide&Deep, Siamese and MT-DNN: greedy-correction vs GPU-only and CPU-only.

    ``ours``: the paper's GPU subgraph times with this machine's measured CPU subgraph times;
    ``paper_pair``: the paper's GPU and CPU times (Table II), which the planner should place as the
    paper did (``paper_placement``). The correction step measures with the cost model here (no GPU).
    """
    out: dict[str, Any] = {"simulated": True, "scenario": "paper-duet", "models": {}}
    for model in ("wide_deep", "siamese", "mt_dnn"):
        paper = bundled("paper", model)
        cpu = bundled("cpu", model)
        gpu_only = paper.model_copy(update={"stages": tuple(
            s.model_copy(update={"latency_ms": {GPU: s.latency_ms[GPU]}}) for s in paper.stages)})
        ours = merge_stage_latencies(gpu_only, cpu).task_graph()
        out["models"][model] = {
            "ours": _duet_summary(ours, link), "paper_pair": _duet_summary(paper.task_graph(), link),
            "paper_placement": PAPER_DUET[model],
            "cpu_source": f"measured here: {cpu.device}, {cpu.conditions.date}",
            "cpu_stage_ms": {s.name: s.latency_ms[CPU] for s in cpu.stages},
            "gpu_stage_ms": {s.name: s.latency_ms[GPU] for s in paper.stages},
        }
    out["paper"] = {"speedup_vs_gpu_range": PAPER_DUET["speedup_vs_gpu_range"],
                    "speedup_vs_cpu_range": PAPER_DUET["speedup_vs_cpu_range"]}
    return out


# ---- Chrion ----------------------------------------------------------------------------------------------


def paper_chrion(*, link: Link = PCIE, alphas: Sequence[float] = CHRION_ALPHAS) -> dict[str, Any]:
    """Chrion's baseline LSTM: GPU-only, CPU-only, latency-optimal and memory-optimal partitions.

    Accelerator: Chrion Table 6's GPU pattern spread over the 1152 cells; CPU: this machine's
    measured cell time with 1..k busy cores (``lstm_cell.json``).
    """
    acc = bundled("paper", "lstm")
    cell = acc.stages[0]
    meas = _cell_profile()
    per_k = {int(k): float(v) for k, v in meas["cell_ms_by_busy_cores"].items()}
    cores = max(per_k)
    cpu = CpuCores(cores, tuple(per_k[k] / per_k[1] for k in range(1, cores + 1)))
    layers, steps = 12, 96
    g = lstm_graph(layers, steps, gpu_cell_ms=cell.latency_ms[GPU], cpu_cell_ms=per_k[1], out_mb=cell.out_mb,
                   weight_mb_per_layer=(cell.mem_mb - cell.out_mb) * steps)
    gpu = schedule(g, g.single_device(GPU), link=link)
    # CPU only on the best number of cores (more busy cores are each slower: the measured slowdown)
    cpu_only = min((schedule(g, g.single_device(CPU), link=link, cpu_slots=k, cpu_latency_scale=cpu.scale(k))
                    for k in range(1, cores + 1)), key=lambda s: s.makespan_ms)
    lat = chrion_plan(g, cpu, alpha=0.0, link=link)
    mem = memory_optimal(g, cpu, alphas=alphas, link=link)

    def red(a: float, b: float) -> float:
        return 100.0 * (a - b) / a

    return {
        "simulated": True, "scenario": "paper-chrion",
        "accel_source": acc.source_note, "cpu_source": meas["source"],
        "cpu_cell_ms_by_busy_cores": per_k, "gpu_cell_ms": cell.latency_ms[GPU],
        "gpu_latency_ms": gpu.makespan_ms, "gpu_mem_mb": gpu.gpu_mem_mb, "cpu_latency_ms": cpu_only.makespan_ms,
        "latency_optimal_latency_ms": lat.makespan_ms, "latency_optimal_mem_mb": lat.gpu_mem_mb,
        "latency_optimal_cores": lat.notes["cores"], "latency_optimal_cpu_cells": len(lat.on(CPU)),
        "memory_optimal_latency_ms": mem.makespan_ms, "memory_optimal_mem_mb": mem.gpu_mem_mb,
        "memory_optimal_alpha": mem.notes["alpha"], "memory_optimal_cpu_cells": len(mem.on(CPU)),
        "latency_optimal_latency_reduction_pct": red(gpu.makespan_ms, lat.makespan_ms),
        "latency_optimal_mem_reduction_pct": red(gpu.gpu_mem_mb, lat.gpu_mem_mb),
        "memory_optimal_mem_reduction_pct": red(gpu.gpu_mem_mb, mem.gpu_mem_mb),
        "paper": PAPER_CHRION,
    }


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "paper-sir": paper_sir, "paper-duet": paper_duet, "paper-chrion": paper_chrion,
}
