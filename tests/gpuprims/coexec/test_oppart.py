from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuprims.coexec.graph import CPU, GPU, Link, Task, TaskGraph, schedule
from gpuprims.coexec.oppart import CpuCores, chrion_order, chrion_plan, lstm_graph, memory_optimal

from ._graphs import task_graphs

FREE = Link(bandwidth_gbps=1e9, latency_ms=0.0)


def _fig8(out_mb: float) -> TaskGraph:
    # Chrion Fig. 8: A feeds B and C; B feeds D, C feeds E; F joins D and E.
    lat = {GPU: 1.0, CPU: 1.0}
    return TaskGraph((
        Task("A", lat, (), out_mb), Task("B", lat, ("A",), out_mb), Task("C", lat, ("A",), out_mb),
        Task("D", lat, ("B",), out_mb), Task("E", lat, ("C",), out_mb), Task("F", lat, ("D", "E"), out_mb),
    ))


def test_order_is_bfs_unless_moving_a_lone_input_costs_more_than_running_its_consumer() -> None:
    assert chrion_order(_fig8(0.0)) == ["A", "B", "C", "D", "E", "F"]  # BFS
    # 24 MB at 12 GB/s is 2 ms > 1 ms mean: D follows B and E follows C ("Ours" in Fig. 8).
    assert chrion_order(_fig8(24.0), link=Link(12.0, 0.0)) == ["A", "B", "D", "C", "E", "F"]


def _diamond(d_mem_mb: float = 0.0) -> TaskGraph:
    return TaskGraph((
        Task("A", {GPU: 2.0, CPU: 3.0}),
        Task("B", {GPU: 2.0, CPU: 3.0}, ("A",)),
        Task("C", {GPU: 2.0, CPU: 3.0}, ("A",)),
        Task("D", {GPU: 1.0, CPU: 5.0}, ("B", "C"), mem_mb=d_mem_mb),
    ))


def test_eft_selection_worked_by_hand() -> None:
    # k'=1: A GPU (EFT 2 < 3); B GPU (4 < 5); C CPU (5 < GPU 6); D GPU (EST max(4, 4, 5) = 5, EFT 6 < 10).
    g = _diamond()
    plan = chrion_plan(g, CpuCores(1), alpha=0.0, link=FREE)
    assert plan.placement == {"A": GPU, "B": GPU, "C": CPU, "D": GPU}
    assert plan.notes["cores"] == 1 and plan.makespan_ms == 6.0
    assert plan.notes["cost_per_cores"] == {0: 7.0, 1: 6.0}  # k'=0 is the GPU alone: 2+2+2+1
    s = schedule(g, plan.placement, link=FREE, order=plan.notes["order"])
    assert (s.start_ms["C"], s.finish_ms["C"], s.start_ms["D"]) == (2.0, 5.0, 5.0)


def test_alpha_trades_latency_for_accelerator_memory() -> None:
    g = _diamond(d_mem_mb=4.0)
    fast = chrion_plan(g, CpuCores(1), alpha=0.0, link=FREE)
    assert fast.placement["D"] == GPU and fast.gpu_mem_mb == 4.0 and fast.makespan_ms == 6.0
    # alpha = 1.5 ms/MB: D on the GPU costs 6 + 1.5 * 4 = 12 > 10 on the core.
    lean = chrion_plan(g, CpuCores(1), alpha=1.5, link=FREE)
    assert lean.placement["D"] == CPU and lean.gpu_mem_mb == 0.0 and lean.makespan_ms == 10.0
    assert lean.cost == 10.0 and lean.baselines[GPU] == 7.0 + 1.5 * 4.0
    # Memory-optimal keeps the latency within the GPU-only 7 ms, so D stays.
    assert memory_optimal(g, CpuCores(1), alphas=[0.0, 1.5], link=FREE).placement["D"] == GPU
    assert memory_optimal(g, CpuCores(1), alphas=[0.0, 1.5], link=FREE, latency_bound_ms=10).gpu_mem_mb == 0.0


def test_lstm_wavefront_runs_cells_in_parallel_on_the_cores() -> None:
    g = lstm_graph(4, 8, gpu_cell_ms=1.0, cpu_cell_ms=1.3, out_mb=0.01, weight_mb_per_layer=8.0)
    gpu_only = schedule(g, g.single_device(GPU)).makespan_ms
    assert gpu_only == pytest.approx(32.0)
    plan = chrion_plan(g, CpuCores(2), alpha=0.0)
    assert plan.makespan_ms < gpu_only and plan.on(CPU)
    assert plan.gpu_mem_mb < schedule(g, g.single_device(GPU)).gpu_mem_mb
    lean = memory_optimal(g, CpuCores(2), alphas=[0.0, 0.05, 0.1, 0.2, 0.5, 1.0])
    assert lean.gpu_mem_mb <= plan.gpu_mem_mb and lean.makespan_ms <= gpu_only


def test_core_contention_makes_more_cores_worth_less() -> None:
    g = lstm_graph(3, 3, gpu_cell_ms=1.0, cpu_cell_ms=1.0, out_mb=0.0, weight_mb_per_layer=0.0)
    free = chrion_plan(g, CpuCores(3), link=FREE)
    crowded = chrion_plan(g, CpuCores(3, slowdown=(1.0, 3.0, 5.0)), link=FREE)
    assert crowded.notes["cores"] <= free.notes["cores"]
    assert crowded.makespan_ms >= free.makespan_ms


@pytest.mark.parametrize(("call", "match"), [
    (lambda: CpuCores(-1), "cores"), (lambda: CpuCores(1, slowdown=(0.0,)), "slowdown"),
    (lambda: chrion_plan(_diamond(), CpuCores(1), alpha=-1), "alpha"),
    (lambda: memory_optimal(_diamond(), CpuCores(1), alphas=[]), "alphas"),
    (lambda: memory_optimal(_diamond(), CpuCores(1), alphas=[0.0], latency_bound_ms=1.0), "within"),
    (lambda: lstm_graph(0, 1, gpu_cell_ms=1, cpu_cell_ms=1, out_mb=0, weight_mb_per_layer=0), "layers"),
])
def test_bad_arguments_are_refused(call, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        call()


@settings(max_examples=60, deadline=None)
@given(task_graphs(), st.integers(0, 3), st.floats(0.0, 2.0))
def test_chrion_is_never_rated_worse_than_one_device(g: TaskGraph, cores: int, alpha: float) -> None:
    plan = chrion_plan(g, CpuCores(cores, slowdown=(1.0, 1.2, 1.5)), alpha=alpha)
    assert plan.cost <= min(plan.baselines.values()) + 1e-9
