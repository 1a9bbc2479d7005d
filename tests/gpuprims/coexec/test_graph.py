from __future__ import annotations

import pytest

from gpuprims.coexec.graph import CPU, GPU, Link, Task, TaskGraph, gpu_memory_mb, schedule


def _chain() -> TaskGraph:
    return TaskGraph((
        Task("a", {GPU: 1.0, CPU: 2.0}, (), out_mb=12.0, mem_mb=5.0),
        Task("b", {GPU: 3.0, CPU: 1.0}, ("a",), out_mb=1.0, mem_mb=7.0),
    ))


def test_schedule_adds_the_transfer_of_an_input_made_on_the_other_device() -> None:
    g = _chain()
    link = Link(bandwidth_gbps=12.0, latency_ms=0.5)
    s = schedule(g, {"a": GPU, "b": CPU}, link=link)
    # a: 0..1 on the GPU; its 12 MB cross at 12 GB/s (1 ms) + 0.5 ms; b: 2.5..3.5 on the CPU.
    assert s.finish_ms["a"] == 1.0
    assert s.start_ms["b"] == pytest.approx(2.5)
    assert s.makespan_ms == pytest.approx(3.5)
    assert s.transfer_ms == pytest.approx(1.5)
    assert schedule(g, {"a": GPU, "b": GPU}, link=link).makespan_ms == 4.0


def test_gpu_memory_is_chrions_eq4() -> None:
    g = _chain()
    assert gpu_memory_mb(g, {"a": GPU, "b": GPU}) == 5 + 12 + 7 + 1
    # b on the GPU with a on the CPU: b's memory and output plus a's output copied in.
    assert gpu_memory_mb(g, {"a": CPU, "b": GPU}) == 7 + 1 + 12
    assert gpu_memory_mb(g, {"a": CPU, "b": CPU}) == 0


def test_parallel_tasks_share_the_cpu_slots() -> None:
    g = TaskGraph(tuple(Task(f"t{i}", {CPU: 2.0}) for i in range(4)))
    assert schedule(g, g.single_device(CPU), cpu_slots=1).makespan_ms == 8.0
    assert schedule(g, g.single_device(CPU), cpu_slots=2).makespan_ms == 4.0
    assert schedule(g, g.single_device(CPU), cpu_slots=2, cpu_latency_scale=1.5).makespan_ms == 6.0


@pytest.mark.parametrize(("tasks", "match"), [
    ((), "at least one task"),
    ((Task("a", {GPU: 1}), Task("a", {GPU: 1})), "duplicate"),
    ((Task("a", {GPU: 1}, ("zz",)),), "unknown task"),
    ((Task("a", {GPU: 1}, ("b",)), Task("b", {GPU: 1}, ("a",))), "cycle"),
])
def test_bad_graphs_are_refused(tasks: tuple[Task, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TaskGraph(tasks)


@pytest.mark.parametrize(("kw", "match"), [
    ({"latency_ms": {"tpu": 1.0}}, "unknown device"),
    ({"latency_ms": {GPU: -1.0}}, "finite and >= 0"),
    ({"latency_ms": {}}, "at least one device"),
    ({"latency_ms": {GPU: 1.0}, "out_mb": float("nan")}, "out_mb"),
])
def test_bad_tasks_are_refused(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Task("x", **kw)


def test_bad_placements_and_orders_are_refused() -> None:
    g = TaskGraph((Task("a", {GPU: 1.0}), Task("b", {GPU: 1.0, CPU: 1.0}, ("a",))))
    with pytest.raises(ValueError, match="misses"):
        schedule(g, {"a": GPU})
    with pytest.raises(ValueError, match="no cpu latency"):
        schedule(g, {"a": CPU, "b": CPU})
    with pytest.raises(ValueError, match="not topological"):
        schedule(g, {"a": GPU, "b": GPU}, order=["b", "a"])
    with pytest.raises(ValueError, match="bandwidth"):
        Link(bandwidth_gbps=0)
