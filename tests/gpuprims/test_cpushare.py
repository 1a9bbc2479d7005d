from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
from typing import Any

import pytest

from gpuprims.cpushare import (
    CpuShare,
    apply_cpu_share,
    available_cores,
    cores_for_pct,
    lower_thread_priority,
    pin_own_threads,
    plan_cpu_shares,
    raise_low_threads,
    thread_priority,
)


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


@pytest.mark.real
def test_apply_in_child_sets_affinity_and_threads() -> None:
    cores = available_cores()
    plan = plan_cpu_shares([("a", 50), ("b", 50)], cores=cores)
    result = _run_child(plan["b"])
    assert result["affinity"] == plan["b"].cores
    assert result["threads"] == plan["b"].threads
    assert result["interop"] == plan["b"].threads
    assert result["omp"] == str(plan["b"].threads)
    assert result["messages"] == []


@pytest.mark.real
def test_apply_in_child_keeps_interop_set_earlier_and_warns() -> None:
    cores = available_cores()
    share = CpuShare(cores=cores, threads=len(cores) + 1, gpu_pct=100)
    result = _run_child(share, preset_interop=1)
    assert result["affinity"] == cores
    assert result["threads"] == len(cores) + 1
    assert result["interop"] == 1
    assert len(result["messages"]) == 1 and "inter-op threads stay at 1" in result["messages"][0]


# -- thread priority (a shadow's pre-warm) -----------------------------------------------------------------

def _in_thread(fn: Any) -> Any:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(timeout=30)
    assert not t.is_alive()
    return out[0]


def test_lowering_a_thread_leaves_the_other_threads_alone() -> None:
    main_before = thread_priority()

    def lowered() -> tuple[str, dict[str, object], int]:
        applied = lower_thread_priority()
        # A thread it starts afterwards (as OpenMP workers are) inherits the low priority.
        return applied, thread_priority(), _in_thread(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    applied, mine, child_nice = _in_thread(lowered)
    assert applied == "nice"
    assert mine["nice"] == 19 and mine["policy"] == "other"
    assert child_nice == 19
    assert thread_priority() == main_before  # the calling (serving) thread keeps its priority
    assert main_before["policy"] == "other"


def _drop_cap_sys_nice() -> None:
    """Clear CAP_SYS_NICE from this process's bounding, effective and permitted capabilities."""
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    # Out of the bounding set first, or root's exec would give it back (PR_CAPBSET_DROP = 24).
    if os.geteuid() == 0 and libc.prctl(24, 23, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")
    hdr, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    if libc.capget(ctypes.byref(hdr), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    bit = ~(1 << 23)  # CAP_SYS_NICE
    data[0].effective &= bit
    data[0].permitted &= bit
    if libc.capset(ctypes.byref(hdr), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


_UNPRIVILEGED = """
import os, threading, json
from gpuprims.cpushare import lower_thread_priority, raise_low_threads, thread_priority
done, go = threading.Event(), threading.Event()
res = {}
def warm():
    res["applied"] = lower_thread_priority()
    done.set()
    go.wait(30)
t = threading.Thread(target=warm); t.start(); done.wait(30)
res["raise"] = raise_low_threads()
res["main"] = thread_priority()
go.set(); t.join()
print(json.dumps(res))
"""


def test_an_unprivileged_process_cannot_raise_a_lowered_thread_back_but_its_main_thread_is_untouched() -> None:
    import json
    import resource
    import subprocess
    import sys

    def drop() -> None:
        # What an ordinary user has: RLIMIT_NICE 0 and no CAP_SYS_NICE (dropped here when run as root).
        resource.setrlimit(resource.RLIMIT_NICE, (0, 0))
        _drop_cap_sys_nice()

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _UNPRIVILEGED], cwd=repo, preexec_fn=drop, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": repo})
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["applied"] == "nice"
    assert res["raise"] == [0, 1]  # refused: nice 19 -> 0 needs CAP_SYS_NICE or RLIMIT_NICE >= 20
    assert res["main"]["policy"] == "other" and res["main"]["nice"] == 0 and res["main"]["can_raise"] is False


def test_a_privileged_process_raises_its_lowered_threads_back() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs CAP_SYS_NICE (run as root)")  # the unprivileged side is tested above
    done, go = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def warm() -> None:
        lower_thread_priority()
        done.set()
        go.wait(30)
        seen["after"] = thread_priority()

    t = threading.Thread(target=warm)
    t.start()
    assert done.wait(30)
    raised, refused = raise_low_threads()
    go.set()
    t.join(30)
    # At least this thread: earlier tests in this process may have left lowered threads of their own
    # (a pre-warm's OpenMP workers inherit its nice value), and those are raised too.
    assert raised >= 1 and refused == 0
    assert seen["after"]["policy"] == "other" and seen["after"]["nice"] == 0


def _thread_cores() -> dict[int, set[int]]:
    """The affinity set of every thread of this process."""
    out: dict[int, set[int]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[int(tid)] = os.sched_getaffinity(int(tid))
        except ProcessLookupError:
            continue
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs at least two usable cores")
def test_pinning_moves_every_thread_and_withdrawing_restores_them() -> None:
    base = sorted(os.sched_getaffinity(0))
    first, last = base[0], base[-1]
    started = threading.Event()
    stop = threading.Event()

    def idle() -> None:
        started.set()
        stop.wait(30)

    before = threading.Thread(target=idle, daemon=True)  # running before the pin: moved with the rest
    before.start()
    assert started.wait(10)
    owner_a, owner_b = object(), object()
    try:
        assert pin_own_threads(owner_a, [last]) == [last]
        assert all(cores == {last} for cores in _thread_cores().values())
        assert available_cores() == base  # shares are still planned over every usable core
        assert plan_cpu_shares([("x", 100)])["x"].cores == base
        seen: list[set[int]] = []
        after = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        after.start()
        after.join(10)
        assert seen == [{last}]  # a thread started later inherits the set
        # A second owner: the threads go where both allow; none in common -> anywhere.
        assert pin_own_threads(owner_b, [first]) is None
        assert all(cores == set(base) for cores in _thread_cores().values())
        assert pin_own_threads(owner_b, None) == [last]
        assert all(cores == {last} for cores in _thread_cores().values())
    finally:
        assert pin_own_threads(owner_a, None) is None
        pin_own_threads(owner_b, None)
        stop.set()
        before.join(10)
    assert all(cores == set(base) for cores in _thread_cores().values())
    assert available_cores() == base


def test_withdrawing_a_wish_never_given_changes_nothing() -> None:
    base = os.sched_getaffinity(0)
    assert pin_own_threads(object(), None) is None
    assert os.sched_getaffinity(0) == base
