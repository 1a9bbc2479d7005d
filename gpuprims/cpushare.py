"""GPU% on the CPU backend: a share of the node's cores (affinity set plus torch thread count).

On a machine without a GPU an instance's GPU% (1-100) stands for the same fraction of the cores the
orchestrator may use. `plan_cpu_shares` turns the GPU% of every instance on the node into core sets,
and `apply_cpu_share` confines the calling process (an instance, at start, before it runs the model)
to its set.

Planning rule, for N usable cores:

1. An instance with p GPU% gets ``k = max(1, min(N, round_half_up(p / 100 * N)))`` cores, and as many
   torch intra-op threads.
2. Instances are placed one by one, the largest k first (ties: in request order). Each takes the k
   cores with the least load so far (ties: the lower core id first), where an instance adds
   ``p / 100 * N / k`` (its demand spread over its cores) to each core it takes.

So while the core counts fit (sum of k <= N) every instance gets its own cores, disjoint from the
others and contiguous in core order; two 50% instances on 2 cores get one core each. When they do not
fit, which happens when small shares round up to one core each or under oversubscription, the extra
instances share the least loaded cores.
"""

from __future__ import annotations

import logging
import math
import os
import resource
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuShare:
    """The CPU cores of one instance: its affinity set, its torch thread count, and the GPU% it stands for."""

    cores: list[int] = field(hash=False)
    threads: int
    gpu_pct: int

    def __post_init__(self) -> None:
        _check_cores(self.cores)
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {self.threads!r}")
        _check_pct("gpu_pct", self.gpu_pct)

    def env(self) -> dict[str, str]:
        """Environment variables that bound the thread pools of a process started with this share.

        Set them in a child's environment before it imports torch (OpenMP and MKL read them once).
        ``OMP_WAIT_POLICY=PASSIVE``: idle OpenMP workers sleep instead of spinning, because instances
        take turns on shared cores (a live scheduler, oversubscribed shares) and a spinning idle
        worker steals the core from the instance whose turn it is (measured: bench/sched_live).
        """
        value = str(self.threads)
        return {"OMP_NUM_THREADS": value, "MKL_NUM_THREADS": value, "OMP_WAIT_POLICY": "PASSIVE"}


def _check_pct(label: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100:
        raise ValueError(f"{label} must be an integer from 1 to 100, got {value!r}")
    return value


def _check_cores(cores: object) -> list[int]:
    if not isinstance(cores, (list, tuple)) or not cores:
        raise ValueError(f"cores must be a non-empty list of core ids, got {cores!r}")
    for core in cores:
        if isinstance(core, bool) or not isinstance(core, int) or core < 0:
            raise ValueError(f"core ids must be integers >= 0, got {cores!r}")
    if len(set(cores)) != len(cores):
        raise ValueError(f"core ids must be unique, got {cores!r}")
    return list(cores)


# Threads of this process kept on some cores (pin_own_threads): each owner's wish, and the affinity set
# the process had before the first one, which `available_cores` keeps answering while any wish holds.
_pin_lock = threading.Lock()
_pin_wishes: dict[int, frozenset[int]] = {}
_pin_base: list[int] | None = None
_pin_applied: list[int] | None = None


def available_cores() -> list[int]:
    """The cores this process may run on (its affinity set), in ascending order.

    While :func:`pin_own_threads` keeps this process's threads on fewer cores, this is still the set
    the process had before, so a node that moved its own threads off its instances' cores plans
    shares (and a second node in the same process plans its own) over every usable core.
    """
    with _pin_lock:
        if _pin_base is not None:
            return list(_pin_base)
    return sorted(os.sched_getaffinity(0))


def _thread_ids() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the calling thread only (threads started later inherit its set)
        return [threading.get_native_id()]


def _set_all_threads(cores: list[int]) -> int:
    """Set the affinity of every thread of this process to `cores`; returns how many threads took it."""
    done = 0
    for tid in _thread_ids():
        try:
            os.sched_setaffinity(tid, cores)
            done += 1
        except ProcessLookupError:  # the thread ended since the listing
            continue
        except OSError as exc:
            logger.debug("thread %d keeps its cores: %s", tid, exc)
    return done


def pin_own_threads(owner: object, cores: Sequence[int] | None) -> list[int] | None:
    """Keep every thread of this process on `cores` for `owner` (None withdraws its wish).

    A node calls it with the cores none of its instances holds, so its own threads (ingest, control
    loop, front door, and anything else in its process) stop taking turns on an instance's core; the
    instances set their own affinity at start, so they are not affected. Threads started afterwards
    inherit the set from the thread that starts them. With several owners (two nodes in one process)
    the threads go on the cores every owner allows; when those are none, or when the last owner
    withdraws, every thread goes back to the set the process had before the first wish.

    Returns the cores the threads are on now, or None when no wish holds (the original set). A core
    outside the original set is ignored; the operating system refusing a thread is logged, never raised.
    """
    global _pin_base, _pin_applied
    if not hasattr(os, "sched_setaffinity"):
        return None
    with _pin_lock:
        if cores is None:
            _pin_wishes.pop(id(owner), None)
        else:
            if _pin_base is None:
                _pin_base = sorted(os.sched_getaffinity(0))
            _pin_wishes[id(owner)] = frozenset(cores)
        if _pin_base is None:
            return None
        allowed = set(_pin_base)
        for wish in _pin_wishes.values():
            allowed &= wish
        target = sorted(allowed) if _pin_wishes and allowed else list(_pin_base)
        if target != _pin_applied:
            n = _set_all_threads(target)
            logger.info("this process's %d thread(s) now run on cores %s%s", n, target,
                        "" if _pin_wishes and allowed else " (all it may use)")
            _pin_applied = target
        if not _pin_wishes:
            _pin_base = None
            _pin_applied = None
            return None
        return target if allowed else None


def cores_for_pct(gpu_pct: int, ncores: int) -> int:
    """How many of `ncores` cores a `gpu_pct` share gets: round-half-up of the fraction, at least 1."""
    _check_pct("gpu_pct", gpu_pct)
    if isinstance(ncores, bool) or not isinstance(ncores, int) or ncores < 1:
        raise ValueError(f"ncores must be an integer >= 1, got {ncores!r}")
    return max(1, min(ncores, math.floor(gpu_pct * ncores / 100 + 0.5)))


def plan_cpu_shares(
    requests: Sequence[tuple[str, int]],
    cores: list[int] | None = None,
    *,
    allow_oversubscribe: bool = False,
) -> dict[str, CpuShare]:
    """Map each instance's GPU% to a set of cores, by the rule in the module docstring.

    `requests` holds (instance name, gpu_pct) pairs with unique non-empty names and gpu_pct in 1-100;
    `cores` defaults to this process's affinity set. Returns one CpuShare per instance, in request
    order. Raises ValueError for a malformed request, a duplicate name, bad core ids, or, unless
    `allow_oversubscribe`, GPU% summing to more than 100 (naming the instances and the sum).
    """
    pool = sorted(_check_cores(cores)) if cores is not None else available_cores()
    if not isinstance(requests, (list, tuple)):
        raise ValueError(f"requests must be a list of (instance name, gpu_pct) pairs, got {requests!r}")
    names: list[str] = []
    pcts: list[int] = []
    for item in requests:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(f"each request must be an (instance name, gpu_pct) pair, got {item!r}")
        name, pct = item
        if not isinstance(name, str) or not name:
            raise ValueError(f"instance name must be a non-empty string, got {name!r}")
        if name in names:
            raise ValueError(f"instance name {name!r} appears more than once")
        names.append(name)
        pcts.append(_check_pct(f"gpu_pct of {name!r}", pct))
    total = sum(pcts)
    if total > 100 and not allow_oversubscribe:
        listing = ", ".join(f"{n}={p}%" for n, p in zip(names, pcts))
        raise ValueError(
            f"GPU% of instances {listing} sums to {total}% > 100%; "
            "lower a share or allow oversubscription explicitly"
        )
    ncores = len(pool)
    counts = [cores_for_pct(p, ncores) for p in pcts]
    load = {core: 0.0 for core in pool}
    order = sorted(range(len(names)), key=lambda i: (-counts[i], i))
    shares: dict[int, CpuShare] = {}
    for i in order:
        picked = sorted(pool, key=lambda core: (load[core], core))[: counts[i]]
        per_core = pcts[i] / 100 * ncores / counts[i]
        for core in picked:
            load[core] += per_core
        shares[i] = CpuShare(cores=sorted(picked), threads=counts[i], gpu_pct=pcts[i])
    return {names[i]: shares[i] for i in range(len(names))}


def apply_cpu_share(share: CpuShare) -> None:
    """Confine the calling process to `share`: CPU affinity, torch intra-op and inter-op threads.

    Sets ``os.sched_setaffinity(0, share.cores)``, ``torch.set_num_threads(share.threads)`` and, where
    torch still allows it, ``torch.set_num_interop_threads(share.threads)`` (torch accepts that only
    once per process and only before inter-op parallel work has started; otherwise the inter-op pool is
    left as it is and a warning is logged: the affinity set still bounds the cores it runs on). Also
    sets OMP_NUM_THREADS/MKL_NUM_THREADS in os.environ for processes this one starts (and for torch, if
    this process imports it later: torch's pools are set only where it is imported already, so an
    instance that runs no torch does not load it here). Call it early in an instance process, before
    the model runs.

    Raises ValueError if `share` is not a CpuShare, and OSError (naming the cores) if the operating
    system refuses the affinity set, e.g. a core outside this process's cpuset.
    """
    if not isinstance(share, CpuShare):
        raise ValueError(f"share must be a CpuShare, got {type(share).__name__}")
    try:
        os.sched_setaffinity(0, share.cores)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot set CPU affinity to cores {share.cores}: {exc.strerror}") from exc
    os.environ.update(share.env())
    torch: Any = sys.modules.get("torch")
    if torch is None:  # an instance that runs no torch (a model file on ONNX Runtime) must not load it here;
        return  # torch imported later sizes its pools from OMP_NUM_THREADS, set above
    torch.set_num_threads(share.threads)
    if torch.get_num_interop_threads() != share.threads:
        try:
            torch.set_num_interop_threads(share.threads)
        except RuntimeError as exc:
            logger.warning(
                "inter-op threads stay at %d (wanted %d): %s",
                torch.get_num_interop_threads(),
                share.threads,
                exc,
            )


def lower_thread_priority() -> str:
    """Put the calling thread (and the threads it starts afterwards, e.g. its OpenMP workers) at the
    lowest priority it can take without starving: nice 19 (on Linux the nice value is per thread), or
    ``SCHED_IDLE`` where nice is refused. Returns what was applied: ``"nice"``, ``"idle"`` or
    ``"none"`` (both refused; the thread runs at its normal priority).

    Nice 19 rather than SCHED_IDLE: a nice-19 thread still gets about 1.5 % of a core that normal
    threads keep busy (weight 15 against 1024), so a shadow's pre-warm finishes even on a busy machine
    and an idle thread holding the GIL cannot stall the process's other threads for long; SCHED_IDLE
    (weight 3) can leave it waiting for minutes behind two busy loops.

    Any user may lower a thread's priority, but going back needs ``CAP_SYS_NICE`` or an
    ``RLIMIT_NICE`` that allows the old nice value (sched(7), setpriority(2)); by default an
    unprivileged user cannot. So call it only in a thread whose work is optional and ends (a shadow's
    warm-up), never in a thread that will serve: the serving threads keep their normal priority.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        return "nice"
    except OSError as exc:
        logger.debug("nice 19 refused (%s); trying SCHED_IDLE", exc)
    if hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread on Linux
            return "idle"
        except OSError as exc:
            logger.debug("SCHED_IDLE refused (%s)", exc)
    logger.warning("could not lower the thread's priority; it runs at normal priority")
    return "none"


_CAP_SYS_NICE = 23


def _has_cap_sys_nice() -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_NICE & 1)
    except (OSError, ValueError):
        pass
    return os.geteuid() == 0


def thread_priority(tid: int | None = None) -> dict[str, object]:
    """The scheduling policy and nice value of a thread (the calling one by default), and whether this
    process could raise a thread back to nice 0 under SCHED_OTHER (``CAP_SYS_NICE`` or ``RLIMIT_NICE``
    >= 20; effective uid 0 counts as having the capability)."""
    tid = threading.get_native_id() if tid is None else tid
    policy = os.sched_getscheduler(tid)
    names = {getattr(os, n): n.removeprefix("SCHED_").lower()
             for n in ("SCHED_OTHER", "SCHED_IDLE", "SCHED_BATCH", "SCHED_FIFO", "SCHED_RR") if hasattr(os, n)}
    soft, _hard = resource.getrlimit(resource.RLIMIT_NICE)
    can_raise = _has_cap_sys_nice() or soft == resource.RLIM_INFINITY or soft >= 20
    return {"policy": names.get(policy, str(policy)), "nice": os.getpriority(os.PRIO_PROCESS, tid),
            "can_raise": can_raise}


def raise_low_threads() -> tuple[int, int]:
    """Bring every thread of this process that runs below the calling thread's priority (a higher nice
    value, or SCHED_IDLE) back to the calling thread's policy and nice value, where the system allows
    it (CAP_SYS_NICE, or an RLIMIT_NICE that allows that nice value: sched(7)). Returns (raised,
    refused); an unprivileged process typically gets (0, n)."""
    me = threading.get_native_id()
    my_nice = os.getpriority(os.PRIO_PROCESS, me)
    my_policy = os.sched_getscheduler(me)
    raised = refused = 0
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return 0, 0
    idle = getattr(os, "SCHED_IDLE", None)
    for tid in tids:
        try:
            low_policy = idle is not None and os.sched_getscheduler(tid) == idle and my_policy != idle
            low_nice = os.getpriority(os.PRIO_PROCESS, tid) > my_nice
            if not (low_policy or low_nice):
                continue
            if low_policy:
                os.sched_setscheduler(tid, my_policy, os.sched_param(0))
            if low_nice:
                os.setpriority(os.PRIO_PROCESS, tid, my_nice)
            raised += 1
        except PermissionError:
            refused += 1
        except OSError:  # the thread exited meanwhile
            continue
    return raised, refused
