from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuprims.coexec.graph import CPU, GPU, Link, Task, TaskGraph, schedule
from gpuprims.coexec.overflow import (
    OverflowRouter,
    comm_sd,
    comm_sd_placement,
    sd_placement,
    simulate_overflow,
)

from ._graphs import task_graphs

LINK = Link(bandwidth_gbps=12.0, latency_ms=0.01)


def test_the_qd_rule_overflows_only_when_the_cpu_finishes_sooner() -> None:
    r = OverflowRouter(10.0, 25.0, alpha_ms=0.1)
    assert r.route(accel_queue=0, cpu_queue=0).device == GPU  # 10 < 25.1
    assert r.route(accel_queue=1, cpu_queue=0).device == GPU  # 20 < 25.1
    d = r.route(accel_queue=2, cpu_queue=0)  # 30 > 25.1: the wait for the accelerator is longer
    assert d.overflow and d.accel_finish_ms == 30.0 and d.cpu_finish_ms == 25.0
    assert r.route(accel_queue=2, cpu_queue=1).device == GPU  # the CPU is busy too: 50.1 > 30
    assert r.decisions == {GPU: 3, CPU: 1}


def test_alpha_keeps_a_near_tie_on_the_accelerator() -> None:
    assert OverflowRouter(10.0, 19.95, alpha_ms=0.1).predict(accel_queue=1, cpu_queue=0).device == GPU
    assert OverflowRouter(10.0, 19.95, alpha_ms=0.0).predict(accel_queue=1, cpu_queue=0).device == CPU


def test_workers_transfer_and_batches_enter_the_prediction() -> None:
    r = OverflowRouter(lambda b: 4.0 + 2.0 * b, 15.0, transfer_ms=1.0, accel_workers=2, cpu_workers=2)
    d = r.predict(accel_queue=2, cpu_queue=1, batch=2)
    assert d.accel_finish_ms == 2 * (4.0 + 4.0)  # two service rounds of a batch of 2
    assert d.cpu_finish_ms == 30.0 + 1.0  # one round of 2 x 15 ms, plus the transfer
    assert d.device == GPU


def test_observed_latencies_move_the_prediction() -> None:
    r = OverflowRouter(10.0, 25.0, learn_rate=0.5)
    r.observe(GPU, 20.0)  # the accelerator runs slower than profiled (e.g. shared with another app)
    assert r.service_ms(GPU) == pytest.approx(15.0)
    assert r.predict(accel_queue=1, cpu_queue=0).device == CPU  # 30 > 25.1


@pytest.mark.parametrize(("kw", "match"), [
    ({"alpha_ms": -1}, "alpha_ms"), ({"transfer_ms": math.inf}, "transfer_ms"),
    ({"cpu_workers": 0}, "workers"), ({"learn_rate": 2}, "learn_rate"),
])
def test_bad_router_settings_are_refused(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OverflowRouter(1.0, 2.0, **kw)


def test_bad_router_inputs_are_refused() -> None:
    r = OverflowRouter(1.0, 2.0)
    with pytest.raises(ValueError, match="queue"):
        r.predict(accel_queue=-1, cpu_queue=0)
    with pytest.raises(ValueError, match="measured_ms"):
        r.observe(GPU, float("nan"))
    with pytest.raises(ValueError, match="device"):
        r.observe("tpu", 1.0)
    with pytest.raises(ValueError, match="positive"):
        OverflowRouter(0.0, 1.0)


def _sir_graph() -> TaskGraph:
    # d: GPU-heavy; a: light on both (SD candidate); b: light but with a big output; c joins on the GPU.
    return TaskGraph((
        Task("d", {GPU: 1.0, CPU: 20.0}, (), out_mb=0.0),
        Task("a", {GPU: 1.0, CPU: 1.05}, (), out_mb=0.01),
        Task("b", {GPU: 0.02, CPU: 0.05}, ("a",), out_mb=12.0),
        Task("c", {GPU: 1.0, CPU: 10.0}, ("b", "d")),
    ))


def test_sd_then_comm_sd_as_the_paper_works_it() -> None:
    g = _sir_graph()
    all_gpu = schedule(g, g.single_device(GPU), link=LINK).makespan_ms
    assert all_gpu == pytest.approx(3.02)
    # SD (4.2): a and b slow down by less than 100 us, so both go to the CPU ...
    sd = sd_placement(g, alpha_ms=0.1)
    assert sd == {"d": GPU, "a": CPU, "b": CPU, "c": GPU}
    # ... and b's 12 MB output then crosses PCIe (1.01 ms): worse than the GPU alone (paper Table 2).
    assert schedule(g, sd, link=LINK).makespan_ms == pytest.approx(1.05 + 0.05 + 1.01 + 1.0)
    assert schedule(g, sd, link=LINK).makespan_ms > all_gpu
    # Comm+SD (Algorithm 1): b costs 0.05 + 1.01 > 0.02 + 0.1 on the CPU, so it returns to the GPU;
    # a stays (1.05 + 0.0108 < 1.0 + 0.1). The second pass changes nothing.
    place, iters = comm_sd_placement(g, link=LINK, alpha_ms=0.1)
    assert place == {"d": GPU, "a": CPU, "b": GPU, "c": GPU}
    assert iters == 2
    plan = comm_sd(g, link=LINK, alpha_ms=0.1)
    assert plan.placement == place and plan.fallback is None
    # a on the CPU beside d on the GPU: 1.05 + transfer(0.01 MB) + 0.02 + 1.0.
    assert plan.makespan_ms == pytest.approx(1.05 + 0.01 + 0.01 / 12 + 0.02 + 1.0)
    assert plan.baselines[GPU] == pytest.approx(all_gpu)


def test_comm_sd_falls_back_to_the_accelerator_on_a_chain() -> None:
    g = TaskGraph((Task("a", {GPU: 1.0, CPU: 1.05}), Task("b", {GPU: 1.0, CPU: 9.0}, ("a",))))
    plan = comm_sd(g, link=LINK)
    # a stays on the CPU by Algorithm 1 (1.05 < 1.0 + 0.1), but on a chain that only adds 50 us.
    assert plan.notes["candidate"] == {"a": CPU, "b": GPU}
    assert plan.fallback == GPU and set(plan.placement.values()) == {GPU}


def test_overflow_helps_at_high_load_and_not_at_low_load() -> None:
    kw = {"duration_s": 60.0, "accel_ms": 10.0, "cpu_ms": 30.0, "cpu_workers": 2, "seed": 3, "warmup_s": 5.0}
    low = simulate_overflow(rate_rps=20.0, router=OverflowRouter(10.0, 30.0, cpu_workers=2), **kw)
    assert low["overflow_share"] < 0.01
    base_hi = simulate_overflow(rate_rps=95.0, router=None, **kw)
    over_hi = simulate_overflow(rate_rps=95.0, router=OverflowRouter(10.0, 30.0, cpu_workers=2), **kw)
    assert over_hi["simulated"] and over_hi["overflow_share"] > 0.05
    assert over_hi["latency_mean_ms"] < base_hi["latency_mean_ms"]
    assert over_hi["latency_p99_ms"] < base_hi["latency_p99_ms"]
    # Overloaded: the GPU alone serves ~100 rps, with two CPU workers at 30 ms up to ~166 rps.
    sat_base = simulate_overflow(rate_rps=160.0, router=None, **kw)
    sat_over = simulate_overflow(rate_rps=160.0, router=OverflowRouter(10.0, 30.0, cpu_workers=2), **kw)
    assert sat_base["throughput_rps"] < 102
    assert sat_over["throughput_rps"] > 1.3 * sat_base["throughput_rps"]


def test_simulate_overflow_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError):
        simulate_overflow(rate_rps=0, duration_s=1, accel_ms=1, cpu_ms=1, router=None)
    with pytest.raises(ValueError, match="warmup"):
        simulate_overflow(rate_rps=1, duration_s=1, accel_ms=1, cpu_ms=1, router=None, warmup_s=1)


@settings(max_examples=60, deadline=None)
@given(task_graphs(), st.integers(1, 3), st.floats(0.0, 1.0))
def test_comm_sd_is_never_rated_worse_than_one_device(g: TaskGraph, slots: int, alpha: float) -> None:
    plan = comm_sd(g, link=LINK, alpha_ms=alpha, cpu_slots=slots)
    assert plan.cost <= min(plan.baselines.values()) + 1e-9
    assert plan.cost == pytest.approx(schedule(g, plan.placement, link=LINK, cpu_slots=slots).makespan_ms)
