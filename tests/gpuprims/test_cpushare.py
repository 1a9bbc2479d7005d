from __future__ import annotations

import logging
import multiprocessing as mp
import os
from typing import Any

import pytest

from gpuprims.cpushare import CpuShare, apply_cpu_share, available_cores, cores_for_pct, plan_cpu_shares


def test_two_cores_two_halves_get_one_core_each() -> None:
    plan = plan_cpu_shares([("a", 50), ("b", 50)], cores=[0, 1])
    assert plan == {
        "a": CpuShare(cores=[0], threads=1, gpu_pct=50),
        "b": CpuShare(cores=[1], threads=1, gpu_pct=50),
    }
    assert list(plan) == ["a", "b"]


def test_disjoint_contiguous_blocks_while_they_fit() -> None:
    plan = plan_cpu_shares([("small", 25), ("big", 50), ("rest", 25)], cores=list(range(8)))
    assert plan["big"].cores == [0, 1, 2, 3]  # the largest is placed first
    assert plan["small"].cores == [4, 5]
    assert plan["rest"].cores == [6, 7]
    assert [s.threads for s in plan.values()] == [2, 4, 2]


def test_core_counts_round_half_up_and_are_at_least_one() -> None:
    assert cores_for_pct(50, 3) == 2  # 1.5 rounds up
    assert cores_for_pct(25, 2) == 1  # 0.5 rounds up
    assert cores_for_pct(1, 16) == 1
    assert cores_for_pct(24, 2) == 1  # 0.48 rounds down, then the floor of one core
    assert cores_for_pct(100, 16) == 16
    assert cores_for_pct(70, 10) == 7


def test_small_shares_share_the_least_loaded_core() -> None:
    plan = plan_cpu_shares([("a", 60), ("b", 20), ("c", 20)], cores=[0, 1])
    # a: round(1.2) = 1 core, load 1.2; b and c: one core each. b takes core 1 (load 0),
    # c then takes core 1 again (load 0.4 < 1.2).
    assert plan["a"].cores == [0]
    assert plan["b"].cores == [1]
    assert plan["c"].cores == [1]


def test_oversubscription_is_refused_naming_instances_and_sum() -> None:
    with pytest.raises(ValueError, match=r"a=60%, b=50% sums to 110%"):
        plan_cpu_shares([("a", 60), ("b", 50)], cores=[0, 1])


def test_oversubscription_when_allowed_spreads_load() -> None:
    plan = plan_cpu_shares([("a", 100), ("b", 50), ("c", 50)], cores=[0, 1], allow_oversubscribe=True)
    assert plan["a"].cores == [0, 1] and plan["a"].threads == 2
    assert plan["b"].cores == [0]
    assert plan["c"].cores == [1]


def test_default_cores_are_this_process_affinity() -> None:
    plan = plan_cpu_shares([("only", 100)])
    assert plan["only"].cores == available_cores() == sorted(os.sched_getaffinity(0))
    assert plan_cpu_shares([]) == {}


def test_env_bounds_thread_pools() -> None:
    assert CpuShare(cores=[1, 3], threads=2, gpu_pct=40).env() == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2",
                                                                 "OMP_WAIT_POLICY": "PASSIVE"}


@pytest.mark.parametrize(
    ("requests", "cores", "match"),
    [
        ([("a", 0)], [0], "gpu_pct of 'a'"),
        ([("a", 101)], [0], "gpu_pct of 'a'"),
        ([("a", 50.0)], [0], "gpu_pct of 'a'"),
        ([("a", True)], [0], "gpu_pct of 'a'"),
        ([("", 50)], [0], "non-empty string"),
        ([(3, 50)], [0], "non-empty string"),
        ([("a", 10), ("a", 20)], [0], "more than once"),
        ([("a", 10, 1)], [0], "pair"),
        (["a"], [0], "pair"),
        ("a", [0], "list of"),
        ([("a", 10)], [], "non-empty list"),
        ([("a", 10)], [0, 0], "unique"),
        ([("a", 10)], [-1], ">= 0"),
        ([("a", 10)], [True], ">= 0"),
        ([("a", 10)], "0,1", "non-empty list"),
    ],
)
def test_bad_plans_raise_value_error(requests: Any, cores: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_cpu_shares(requests, cores)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cores": [], "threads": 1, "gpu_pct": 10}, "non-empty list"),
        ({"cores": [0], "threads": 0, "gpu_pct": 10}, "threads"),
        ({"cores": [0], "threads": 1.0, "gpu_pct": 10}, "threads"),
        ({"cores": [0], "threads": 1, "gpu_pct": 0}, "gpu_pct"),
    ],
)
def test_bad_cpu_share_raises_value_error(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CpuShare(**kwargs)


def test_cores_for_pct_rejects_bad_core_count() -> None:
    with pytest.raises(ValueError, match="ncores"):
        cores_for_pct(50, 0)
    with pytest.raises(ValueError, match="gpu_pct"):
        cores_for_pct(0, 2)


def test_apply_refuses_non_share_and_impossible_cores() -> None:
    with pytest.raises(ValueError, match="CpuShare"):
        apply_cpu_share({"cores": [0], "threads": 1})  # type: ignore[arg-type]
    before = os.sched_getaffinity(0)
    with pytest.raises(OSError, match=r"cores \[100000\]"):
        apply_cpu_share(CpuShare(cores=[100000], threads=1, gpu_pct=10))
    assert os.sched_getaffinity(0) == before


def _child_apply(share: CpuShare, preset_interop: int | None, queue: mp.Queue) -> None:  # spawned child
    import torch

    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logging.getLogger("gpuprims.cpushare").addHandler(Collect())
    if preset_interop is not None:
        torch.set_num_interop_threads(preset_interop)
    apply_cpu_share(share)
    queue.put(
        {
            "affinity": sorted(os.sched_getaffinity(0)),
            "threads": torch.get_num_threads(),
            "interop": torch.get_num_interop_threads(),
            "omp": os.environ.get("OMP_NUM_THREADS"),
            "messages": messages,
        }
    )


def _run_child(share: CpuShare, preset_interop: int | None = None) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_apply, args=(share, preset_interop, queue))
    child.start()
    try:
        result: dict[str, Any] = queue.get(timeout=60)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == 0
    return result


def test_apply_in_child_sets_affinity_and_threads() -> None:
    cores = available_cores()
    plan = plan_cpu_shares([("a", 50), ("b", 50)], cores=cores)
    result = _run_child(plan["b"])
    assert result["affinity"] == plan["b"].cores
    assert result["threads"] == plan["b"].threads
    assert result["interop"] == plan["b"].threads
    assert result["omp"] == str(plan["b"].threads)
    assert result["messages"] == []


def test_apply_in_child_keeps_interop_set_earlier_and_warns() -> None:
    cores = available_cores()
    share = CpuShare(cores=cores, threads=len(cores) + 1, gpu_pct=100)
    result = _run_child(share, preset_interop=1)
    assert result["affinity"] == cores
    assert result["threads"] == len(cores) + 1
    assert result["interop"] == 1
    assert len(result["messages"]) == 1 and "inter-op threads stay at 1" in result["messages"][0]
