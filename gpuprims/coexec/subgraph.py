"""DUET (Zhang et al., IPDPS'21): place a multi-branch model's subgraphs on the accelerator and the CPU.

The model is a graph of coarse subgraphs (``TaskGraph``; ``gpuprims.coexec.fx_exec`` cuts a torch
model into one). ``phases`` splits it into DUET's phased schedule: a *sequential* phase is a run of
subgraphs every other subgraph comes before or after; a *multi-path* phase is the set of mutually
independent subgraphs between two sequential ones (e.g. Wide&Deep's four encoders).

``greedy_placement`` is the paper's steps 1 and 2: every subgraph of a sequential phase, and the
costliest subgraph of each multi-path phase (cost = its faster time: the critical path), go to their
faster device; the other subgraphs of a multi-path phase, longest first, each go to the device that
raises the phase's critical path least (each device runs its subgraphs one after another, as DUET's
executor does). ``correct`` is step 3: per multi-path phase, Kernighan-Lin-style passes that pick
the swap of a CPU subgraph and an accelerator subgraph (either may be empty: a single move) the cost
model expects to help most, *measure* the result with the caller's callback, and keep it only if the
measured latency drops; a pass locks the subgraphs it tried, and passes repeat while one improved.
``duet`` runs both and falls back to the faster single device when that measures better.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gpuprims.coexec.graph import CPU, DEVICES, GPU, PCIE, Link, Plan, TaskGraph, schedule

Measure = Callable[[dict[str, str]], float]


@dataclass(frozen=True)
class Phase:
    """One phase: ``kind`` is ``"sequential"`` or ``"multipath"``; ``tasks`` in topological order."""

    kind: str
    tasks: tuple[str, ...]


def _ancestors(graph: TaskGraph) -> dict[str, set[str]]:
    anc: dict[str, set[str]] = {}
    for n in graph.topo_order():
        s: set[str] = set()
        for p in graph.preds(n):
            s.add(p)
            s |= anc[p]
        anc[n] = s
    return anc


def phases(graph: TaskGraph) -> list[Phase]:
    """DUET's phased schedule of ``graph`` (module docstring); consecutive phases differ in kind."""
    anc = _ancestors(graph)
    names = graph.topo_order()
    comparable = {n: all(m == n or m in anc[n] or n in anc[m] for m in names) for n in names}
    out: list[Phase] = []
    for n in names:
        kind = "sequential" if comparable[n] else "multipath"
        if out and out[-1].kind == kind:
            out[-1] = Phase(kind, (*out[-1].tasks, n))
        else:
            out.append(Phase(kind, (n,)))
    return out


def _phase_span(graph: TaskGraph, tasks: tuple[str, ...], place: Mapping[str, str]) -> float:
    """The critical path of a multi-path phase: the busier device's summed time."""
    load = dict.fromkeys(DEVICES, 0.0)
    for n in tasks:
        load[place[n]] += graph.task(n).latency_ms[place[n]]
    return max(load.values())


def greedy_placement(graph: TaskGraph) -> dict[str, str]:
    """Steps 1 and 2 of DUET's greedy-correction scheduling (module docstring)."""
    place: dict[str, str] = {}
    for ph in phases(graph):
        if ph.kind == "sequential":
            for n in ph.tasks:
                place[n] = graph.task(n).fastest()
            continue
        ts = [graph.task(n) for n in ph.tasks]
        crit = max(ts, key=lambda t: t.latency_ms[t.fastest()])  # first of equals: topological order
        place[crit.name] = crit.fastest()
        rest = sorted((t for t in ts if t.name != crit.name), key=lambda t: -t.latency_ms[t.fastest()])
        for t in rest:
            best = None
            for dev in (t.fastest(), *(d for d in DEVICES if d != t.fastest())):
                if not t.runs_on(dev):
                    continue
                trial = {**place, t.name: dev}
                span = _phase_span(graph, tuple(n for n in ph.tasks if n in trial), trial)
                if best is None or span < best[0] - 1e-12:
                    best = (span, dev)
            assert best is not None
            place[t.name] = best[1]
    return place


def correct(graph: TaskGraph, place: Mapping[str, str], measure: Measure, *,
            estimate: Measure | None = None, max_passes: int = 10) -> tuple[dict[str, str], float, int]:
    """Step 3: swap-based correction judged on ``measure`` (module docstring).

    ``estimate`` ranks candidate swaps (default: ``measure`` itself, fine when it is a model rather
    than a real run). Returns (placement, measured latency, number of ``measure`` calls).
    """
    if max_passes < 1:
        raise ValueError(f"max_passes must be >= 1, got {max_passes}")
    rank = estimate or measure
    cur = dict(place)
    t_old = measure(cur)
    calls = 1
    for ph in phases(graph):
        if ph.kind != "multipath":
            continue
        for _ in range(max_passes):
            improved = False
            free_cpu = [n for n in ph.tasks if cur[n] == CPU]
            free_gpu = [n for n in ph.tasks if cur[n] == GPU]
            while free_cpu or free_gpu:
                cands: list[tuple[float, str | None, str | None, dict[str, str]]] = []
                for a in [*free_cpu, None]:
                    for b in [*free_gpu, None]:
                        if a is None and b is None:
                            continue
                        trial = dict(cur)
                        if a is not None:
                            if not graph.task(a).runs_on(GPU):
                                continue
                            trial[a] = GPU
                        if b is not None:
                            if not graph.task(b).runs_on(CPU):
                                continue
                            trial[b] = CPU
                        cands.append((rank(trial), a, b, trial))
                if not cands:
                    break
                _, a, b, trial = min(cands, key=lambda c: c[0])
                if a is not None:
                    free_cpu.remove(a)
                if b is not None:
                    free_gpu.remove(b)
                t_new = measure(trial)
                calls += 1
                if t_new < t_old - 1e-12:
                    cur, t_old, improved = trial, t_new, True
            if not improved:
                break
    return cur, t_old, calls


def duet(graph: TaskGraph, *, link: Link = PCIE, measure: Measure | None = None, max_passes: int = 10) -> Plan:
    """DUET's greedy-correction placement; ``measure`` defaults to the cost model (one CPU slot).

    The plan's ``cost`` is the measured latency of the chosen placement; ``baselines`` the measured
    latencies of the single-device placements, and ``fallback`` names the device when one of those
    wins (DUET falls back to the best single device).
    """
    def model(p: dict[str, str]) -> float:
        return schedule(graph, p, link=link, cpu_slots=1).makespan_ms

    meas = measure or model
    greedy = greedy_placement(graph)
    place, cost, calls = correct(graph, greedy, meas, estimate=model, max_passes=max_passes)
    baselines = {d: meas(graph.single_device(d)) for d in DEVICES if all(t.runs_on(d) for t in graph.tasks)}
    calls += len(baselines)
    fallback = None
    for d, c in sorted(baselines.items(), key=lambda kv: kv[1]):
        if c < cost - 1e-12:
            place, cost, fallback = graph.single_device(d), c, d
            break
    s = schedule(graph, place, link=link, cpu_slots=1)
    return Plan(place, cost, s.makespan_ms, s.gpu_mem_mb, baselines, fallback,
                {"greedy": greedy, "measure_calls": calls, "phases": [(p.kind, p.tasks) for p in phases(graph)]})
