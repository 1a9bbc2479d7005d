from __future__ import annotations

import pytest
from hypothesis import given, settings

from gpuprims.coexec.graph import CPU, GPU, Link, Task, TaskGraph, schedule
from gpuprims.coexec.subgraph import correct, duet, greedy_placement, phases

from ._graphs import task_graphs

#: Small outputs (batch 1 features): transfers barely matter, as in the paper's Table II.
LINK = Link(bandwidth_gbps=12.0, latency_ms=0.01)


def _wide_deep() -> TaskGraph:
    # DUET Table II, Wide-and-Deep: (CPU ms, GPU ms) per subgraph.
    branches = {"wide": (0.03, 0.05), "ffn": (0.07, 0.07), "rnn": (2.4, 6.4), "cnn": (14.9, 0.9)}
    tasks = [Task(n, {CPU: c, GPU: g}, out_mb=0.001) for n, (c, g) in branches.items()]
    tasks.append(Task("merge", {CPU: 0.03, GPU: 0.06}, tuple(branches)))
    return TaskGraph(tuple(tasks))


def _siamese() -> TaskGraph:
    return TaskGraph((
        Task("rnn1", {CPU: 2.74, GPU: 3.22}, out_mb=0.001),
        Task("rnn2", {CPU: 2.72, GPU: 3.24}, out_mb=0.001),
        Task("merge3", {CPU: 0.03, GPU: 0.05}, ("rnn1", "rnn2")),
    ))


def test_phases_split_sequential_and_multipath() -> None:
    ph = phases(_wide_deep())
    assert [(p.kind, p.tasks) for p in ph] == [("multipath", ("wide", "ffn", "rnn", "cnn")), ("sequential", ("merge",))]
    chain = TaskGraph((Task("a", {GPU: 1}), Task("b", {GPU: 1}, ("a",)), Task("c", {GPU: 1}, ("a",)),
                       Task("d", {GPU: 1}, ("b", "c"))))
    assert [p.kind for p in phases(chain)] == ["sequential", "multipath", "sequential"]


def test_wide_and_deep_greedy_gives_the_papers_table2_placement() -> None:
    # Step 1: the RNN (2.4 ms at best) is the multi-path phase's critical subgraph -> CPU; merge -> CPU.
    # Step 2, longest first: CNN -> GPU (0.9 vs 17.3), FFN -> GPU (2.4 vs 2.47), Wide -> GPU (2.4 vs 2.43).
    g = _wide_deep()
    place = greedy_placement(g)
    assert place == {"wide": GPU, "ffn": GPU, "rnn": CPU, "cnn": GPU, "merge": CPU}
    plan = duet(g, link=LINK)
    assert plan.placement == place and plan.fallback is None
    assert plan.cost < min(plan.baselines.values())


def test_siamese_greedy_is_mirrored_and_the_correction_swaps_it_to_the_papers_placement() -> None:
    g = _siamese()
    # Step 1: rnn1 (2.74 at best) is critical -> CPU; step 2: rnn2 -> GPU (3.24 vs 5.46 on the CPU).
    greedy = greedy_placement(g)
    assert greedy == {"rnn1": CPU, "rnn2": GPU, "merge3": CPU}
    # Step 3 measures the swap: rnn1 on the GPU (3.22) beside rnn2 on the CPU (2.72) ends sooner
    # than 3.24, so it is kept: the paper's Table II (Stacked-RNN-1 GPU, Stacked-RNN-2 CPU).
    measured: list[dict[str, str]] = []

    def measure(p: dict[str, str]) -> float:
        measured.append(dict(p))
        return schedule(g, p, link=LINK).makespan_ms

    place, t, calls = correct(g, greedy, measure, estimate=lambda p: schedule(g, p, link=LINK).makespan_ms)
    assert place == {"rnn1": GPU, "rnn2": CPU, "merge3": CPU}
    assert t == pytest.approx(3.22 + 0.01 + 0.001 / 12 + 0.03)
    assert calls == len(measured) and measured[0] == greedy


def test_the_correction_trusts_the_measurement_over_the_model() -> None:
    g = _siamese()

    def measure(p: dict[str, str]) -> float:  # the model's favourite swap runs badly in reality
        base = schedule(g, p, link=LINK).makespan_ms
        return base + (5.0 if p["rnn1"] == GPU else 0.0)

    place, _, _ = correct(g, greedy_placement(g), measure, estimate=lambda p: schedule(g, p, link=LINK).makespan_ms)
    assert place["rnn1"] == CPU


def test_mt_dnn_splits_the_ten_heads_six_to_four() -> None:
    heads = [(3.18, 2.04), (3.21, 2.03), (3.2, 2.03), (3.19, 2.05), (3.18, 2.03), (3.19, 2.04), (3.17, 2.05),
             (3.18, 2.04), (3.19, 2.03), (3.2, 2.04)]
    tasks = [Task("bert", {CPU: 289.7, GPU: 7.8}, out_mb=0.1)]
    tasks += [Task(f"head{i + 1}", {CPU: c, GPU: gg}, ("bert",)) for i, (c, gg) in enumerate(heads)]
    plan = duet(TaskGraph(tuple(tasks)), link=LINK)
    assert plan.placement["bert"] == GPU
    # Table II: 6 heads on the GPU (~12.2 ms), 4 on the CPU (~12.7 ms).
    assert len([n for n in plan.on(GPU) if n != "bert"]) == 6 and len(plan.on(CPU)) == 4
    assert plan.cost < plan.baselines[GPU]


def test_a_sequential_model_falls_back_to_the_best_single_device() -> None:
    # ResNet-18-like chain (paper Table III): nothing runs in parallel, DUET keeps the GPU.
    g = TaskGraph((Task("stem", {CPU: 1.0, GPU: 0.9}, out_mb=3.0), Task("body", {CPU: 14.0, GPU: 0.1}, ("stem",))))
    plan = duet(g, link=LINK)
    assert set(plan.placement.values()) == {GPU}


@settings(max_examples=60, deadline=None)
@given(task_graphs())
def test_duet_is_never_rated_worse_than_one_device(g: TaskGraph) -> None:
    plan = duet(g, link=LINK)
    assert plan.cost <= min(plan.baselines.values()) + 1e-9
