"""Chrion (Ma et al. 2023): operator partition of an RNN between the accelerator and k CPU cores.

``chrion_order`` is the paper's Algorithm 1: breadth-first over ready operators (parallel branches
reach different devices), except that an operator whose only input is the one just ordered follows
it at once when moving that input would cost more than the operator's mean execution time over the
devices (depth-first locality). ``chrion_plan`` is Algorithm 2: for every number of cores ``k'`` in
0..k, each operator in that order goes to the processor (the accelerator ``p0``, or one of ``k'``
cores) with the least ``EFT + alpha * M``, where (Eqs. 2-3)

    EST(v, p) = max(avail[p], max over inputs u of AFT(u) + transfer(u) if u ran on the other device)
    EFT(v, p) = EST(v, p) + W(v, p)      (on a core, W is the CPU time scaled for k' busy cores)

and ``M`` is the accelerator memory the choice adds (Eq. 4: the operator's memory and output, plus
inputs copied in from the CPU). The configuration with the least ``L + alpha * M`` wins (L, the
latency, is the last finish). ``alpha`` (ms per MB) trades latency for accelerator memory:
``alpha = 0`` is the latency-optimal mode; ``memory_optimal`` raises alpha over a grid and keeps the
plan with the least memory whose latency stays within the accelerator-only latency. The result is
never one the cost model rates worse than running everything on one device.

``lstm_graph`` unfolds a stacked LSTM into its cells: cell (l, t) needs (l, t-1) and (l-1, t), so
cells on a wavefront run in parallel (Chrion Fig. 4).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from gpuprims.coexec.graph import CPU, GPU, PCIE, Link, Plan, Task, TaskGraph, gpu_memory_mb, schedule


def chrion_order(graph: TaskGraph, *, link: Link = PCIE) -> list[str]:
    """Algorithm 1: BFS with depth-first merging of expensive-to-move single-input successors."""
    marked: set[str] = set()
    order: list[str] = []
    q: deque[str] = deque(n for n in graph.topo_order() if not graph.preds(n))
    queued = set(q)

    def take(n: str) -> None:
        marked.add(n)
        order.append(n)
        for c in graph.succs(n):
            ct = graph.task(c)
            mean_ms = sum(ct.latency_ms.values()) / len(ct.latency_ms)
            if graph.preds(c) == (n,) and c not in marked and link.transfer_ms(graph.task(n).out_mb) > mean_ms:
                queued.add(c)
                take(c)

    while q:
        n = q.popleft()
        if n in marked:
            continue
        before = len(order)
        take(n)  # only ready operators are ever queued
        for m in order[before:]:
            for c in graph.succs(m):
                if c not in queued and all(p in marked for p in graph.preds(c)):
                    q.append(c)
                    queued.add(c)
    return order


@dataclass(frozen=True)
class CpuCores:
    """The CPU side: up to ``cores`` cores; ``slowdown[k]`` scales a core's time when k are in use
    (shared caches and memory bandwidth; Chrion Fig. 6). Missing entries repeat the last one."""

    cores: int
    slowdown: tuple[float, ...] = (1.0,)

    def __post_init__(self) -> None:
        if self.cores < 0:
            raise ValueError(f"cores must be >= 0, got {self.cores}")
        if not self.slowdown or any(not (math.isfinite(s) and s > 0) for s in self.slowdown):
            raise ValueError(f"slowdown factors must be positive and finite, got {self.slowdown}")

    def scale(self, k: int) -> float:
        """The factor on CPU times when ``k`` cores are in use (k >= 1)."""
        if k < 1:
            return 1.0
        return self.slowdown[min(k, len(self.slowdown)) - 1]


def _select(graph: TaskGraph, order: Sequence[str], k: int, alpha: float, link: Link,
            scale: float) -> dict[str, str]:
    avail = [0.0] * (k + 1)  # avail[0]: the accelerator; 1..k the cores
    aft: dict[str, float] = {}
    proc: dict[str, int] = {}
    for n in order:
        t = graph.task(n)
        best: tuple[float, int, float] | None = None
        for j in range(k + 1):
            dev = GPU if j == 0 else CPU
            if not t.runs_on(dev):
                continue
            ready = 0.0
            for p in graph.preds(n):
                pdev = GPU if proc[p] == 0 else CPU
                ready = max(ready, aft[p] + (link.transfer_ms(graph.task(p).out_mb) if pdev != dev else 0.0))
            est = max(avail[j], ready)
            w = t.latency_ms[dev] * (scale if dev == CPU else 1.0)
            eft = est + w
            mem = 0.0
            if dev == GPU:
                mem = t.mem_mb + t.out_mb + sum(graph.task(p).out_mb for p in graph.preds(n) if proc[p] != 0)
            cost = eft + alpha * mem
            if best is None or cost < best[0] - 1e-12:
                best = (cost, j, eft)
        if best is None:
            raise ValueError(f"task {n!r} can run on no processor with {k} cores")
        _, j, eft = best
        proc[n], aft[n] = j, eft
        avail[j] = eft
    return {n: (GPU if proc[n] == 0 else CPU) for n in order}


def chrion_plan(graph: TaskGraph, cpu: CpuCores, *, alpha: float = 0.0, link: Link = PCIE,
                order: Sequence[str] | None = None) -> Plan:
    """Algorithm 2 (module docstring); ``cost`` is ``L + alpha * M`` of the plan, in ms.

    ``notes["cores"]`` is the chosen k*, ``notes["order"]`` the operator order; ``baselines`` hold
    the same objective for accelerator-only and (if ``cpu.cores`` > 0) CPU-only on all cores.
    """
    if not (math.isfinite(alpha) and alpha >= 0):
        raise ValueError(f"alpha must be finite and >= 0, got {alpha}")
    seq = list(order) if order is not None else chrion_order(graph, link=link)

    def rate(place: dict[str, str], k: int) -> tuple[float, float, float]:
        s = schedule(graph, place, link=link, cpu_slots=max(k, 1), order=seq, cpu_latency_scale=cpu.scale(k))
        return s.makespan_ms + alpha * s.gpu_mem_mb, s.makespan_ms, s.gpu_mem_mb

    best: tuple[float, int, dict[str, str], float, float] | None = None
    per_k = {}
    for k in range(cpu.cores + 1):
        if k == 0 and not all(t.runs_on(GPU) for t in graph.tasks):
            continue
        place = _select(graph, seq, k, alpha, link, cpu.scale(k))
        c, lat, mem = rate(place, k)
        per_k[k] = c
        if best is None or c < best[0] - 1e-12:
            best = (c, k, place, lat, mem)
    if best is None:
        raise ValueError("no configuration can run every task (some need the CPU but cpu.cores == 0)")
    baselines: dict[str, float] = {}
    if all(t.runs_on(GPU) for t in graph.tasks):
        baselines[GPU] = rate(graph.single_device(GPU), 0)[0]
    if cpu.cores > 0 and all(t.runs_on(CPU) for t in graph.tasks):
        baselines[CPU] = rate(graph.single_device(CPU), cpu.cores)[0]
    c, k, place, lat, mem = best
    fallback = None
    for dev, bc in sorted(baselines.items(), key=lambda kv: kv[1]):
        if bc < c - 1e-12:
            k = 0 if dev == GPU else cpu.cores
            place = graph.single_device(dev)
            c, lat, mem = rate(place, k)
            fallback = dev
            break
    return Plan(place, c, lat, mem, baselines, fallback, {"cores": k, "order": seq, "cost_per_cores": per_k,
                                                         "alpha": alpha})


def memory_optimal(graph: TaskGraph, cpu: CpuCores, *, alphas: Sequence[float], link: Link = PCIE,
                   latency_bound_ms: float | None = None) -> Plan:
    """The plan with the least accelerator memory over ``alphas`` whose latency is within
    ``latency_bound_ms`` (default: the accelerator-only latency); ties go to the lower latency."""
    if not alphas:
        raise ValueError("alphas must not be empty")
    seq = chrion_order(graph, link=link)
    if latency_bound_ms is None:
        latency_bound_ms = schedule(graph, graph.single_device(GPU), link=link, order=seq).makespan_ms
    best: Plan | None = None
    for a in alphas:
        p = chrion_plan(graph, cpu, alpha=a, link=link, order=seq)
        if p.makespan_ms > latency_bound_ms + 1e-9:
            continue
        if best is None or (p.gpu_mem_mb, p.makespan_ms) < (best.gpu_mem_mb, best.makespan_ms):
            best = p
    if best is None:  # alpha = 0 is latency-optimal, so only a bound below the accelerator's fails here
        raise ValueError(f"no alpha in {list(alphas)} keeps the latency within {latency_bound_ms:g} ms")
    return best


def lstm_graph(layers: int, seq_len: int, *, gpu_cell_ms: float, cpu_cell_ms: float, out_mb: float,
               weight_mb_per_layer: float, act_mb: float = 0.0, head_gpu_ms: float | None = None,
               head_cpu_ms: float | None = None) -> TaskGraph:
    """A stacked LSTM unfolded into cells ``L{l}T{t}`` (module docstring), plus an optional ``head``.

    A cell's ``mem_mb`` is its layer's weights spread over the sequence (``weight_mb_per_layer /
    seq_len``: Eq. 4 counts memory per operator) plus ``act_mb`` of ephemeral tensors; ``out_mb`` is
    its hidden and cell state.
    """
    if layers < 1 or seq_len < 1:
        raise ValueError(f"layers and seq_len must be >= 1, got {layers}, {seq_len}")
    tasks = []
    for layer in range(layers):
        for t in range(seq_len):
            deps = []
            if t > 0:
                deps.append(f"L{layer}T{t - 1}")
            if layer > 0:
                deps.append(f"L{layer - 1}T{t}")
            tasks.append(Task(f"L{layer}T{t}", {GPU: gpu_cell_ms, CPU: cpu_cell_ms}, tuple(deps), out_mb,
                              weight_mb_per_layer / seq_len + act_mb))
    if head_gpu_ms is not None or head_cpu_ms is not None:
        lat = {d: v for d, v in ((GPU, head_gpu_ms), (CPU, head_cpu_ms)) if v is not None}
        tasks.append(Task("head", lat, (f"L{layers - 1}T{seq_len - 1}",), out_mb, 0.0))
    return TaskGraph(tuple(tasks))


__all__ = ["CpuCores", "chrion_order", "chrion_plan", "gpu_memory_mb", "lstm_graph", "memory_optimal"]
