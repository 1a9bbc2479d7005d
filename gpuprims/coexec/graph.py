"""The task graph every co-execution planner works on, and the one cost model that rates a placement.

A ``TaskGraph`` is a DAG of tasks (an operator, a subgraph or a whole model) with, per task, its
profiled latency on each device kind (``"gpu"``, the accelerator; ``"cpu"``, the host cores), the
size of its output (what crosses PCIe when a successor runs on the other device) and the device
memory it holds while placed on the accelerator (weights, ephemeral tensors).

``schedule(graph, placement, ...)`` is the cost model: list scheduling of the tasks in a given
priority order onto the accelerator (``gpu_slots`` tasks at a time, 1 by default: one stream runs
kernels one after another) and a pool of ``cpu_slots`` CPU cores (a task takes one core). A task
starts when its device has a free slot and every input has arrived; an input made on the other device
arrives ``link.transfer_ms(out_mb)`` after its producer finished. The makespan is the end of the last
task. The accelerator memory of a placement is Chrion's Eq. 4: for every task on the accelerator, its
``mem_mb`` and ``out_mb`` plus the outputs of its CPU predecessors copied in.

Pure: no clock, no torch. Units are in the names (``_ms``, ``_mb``; bandwidth in GB/s = MB/ms).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

#: The two device kinds a placement names.
GPU = "gpu"
CPU = "cpu"
DEVICES = (GPU, CPU)


@dataclass(frozen=True)
class Task:
    """One schedulable unit: ``latency_ms[device]`` for each device kind it can run on."""

    name: str
    latency_ms: Mapping[str, float]
    deps: tuple[str, ...] = ()
    out_mb: float = 0.0
    mem_mb: float = 0.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("task name must be non-empty")
        lat = dict(self.latency_ms)
        bad = [d for d in lat if d not in DEVICES]
        if bad:
            raise ValueError(f"task {self.name!r}: unknown device kinds {bad}; use {list(DEVICES)}")
        for d, v in lat.items():
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"task {self.name!r}: latency_ms[{d!r}] must be finite and >= 0, got {v}")
        if not lat:
            raise ValueError(f"task {self.name!r}: needs a latency on at least one device")
        for label, v in (("out_mb", self.out_mb), ("mem_mb", self.mem_mb)):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"task {self.name!r}: {label} must be finite and >= 0, got {v}")
        object.__setattr__(self, "latency_ms", lat)
        object.__setattr__(self, "deps", tuple(self.deps))

    def runs_on(self, device: str) -> bool:
        """True if the task has a latency on ``device``."""
        return device in self.latency_ms

    def fastest(self) -> str:
        """The device kind with the lowest latency (the accelerator on a tie)."""
        return min(self.latency_ms, key=lambda d: (self.latency_ms[d], DEVICES.index(d)))


@dataclass(frozen=True)
class Link:
    """The host-accelerator link: a transfer of ``mb`` takes ``latency_ms + mb / bandwidth_gbps``."""

    bandwidth_gbps: float = 12.0
    latency_ms: float = 0.01

    def __post_init__(self) -> None:
        if not (self.bandwidth_gbps > 0 and math.isfinite(self.bandwidth_gbps)):
            raise ValueError(f"bandwidth_gbps must be a positive finite number, got {self.bandwidth_gbps}")
        if not (self.latency_ms >= 0 and math.isfinite(self.latency_ms)):
            raise ValueError(f"link latency_ms must be finite and >= 0, got {self.latency_ms}")

    def transfer_ms(self, mb: float) -> float:
        """Time to move ``mb`` megabytes across the link (0 for nothing to move)."""
        return 0.0 if mb <= 0 else self.latency_ms + mb / self.bandwidth_gbps


#: A PCIe 3.0 x16-class link (about 12 GB/s, 10 us per transfer): the planners' default.
PCIE = Link()

#: A free link: what two "devices" that share host memory (two CPU pools) pay.
SHARED_MEMORY = Link(bandwidth_gbps=1e9, latency_ms=0.0)


@dataclass(frozen=True)
class TaskGraph:
    """A validated DAG of tasks: unique names, known dependencies, no cycles."""

    tasks: tuple[Task, ...]
    _index: dict[str, Task] = field(default_factory=dict, init=False, repr=False, compare=False)
    _succ: dict[str, tuple[str, ...]] = field(default_factory=dict, init=False, repr=False, compare=False)
    _topo: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tasks = tuple(self.tasks)
        object.__setattr__(self, "tasks", tasks)
        if not tasks:
            raise ValueError("a task graph needs at least one task")
        index: dict[str, Task] = {}
        for t in tasks:
            if t.name in index:
                raise ValueError(f"duplicate task name {t.name!r}")
            index[t.name] = t
        succ: dict[str, list[str]] = {t.name: [] for t in tasks}
        for t in tasks:
            for d in t.deps:
                if d not in index:
                    raise ValueError(f"task {t.name!r} depends on unknown task {d!r}")
                if d == t.name:
                    raise ValueError(f"task {t.name!r} depends on itself")
                succ[d].append(t.name)
        # Kahn's algorithm in declaration order: a stable topological order, and cycle detection.
        indeg = {t.name: len(set(t.deps)) for t in tasks}
        ready = [t.name for t in tasks if indeg[t.name] == 0]
        order: list[str] = []
        pos = {t.name: i for i, t in enumerate(tasks)}
        heap = [(pos[n], n) for n in ready]
        heapq.heapify(heap)
        while heap:
            _, n = heapq.heappop(heap)
            order.append(n)
            for m in dict.fromkeys(succ[n]):
                indeg[m] -= 1
                if indeg[m] == 0:
                    heapq.heappush(heap, (pos[m], m))
        if len(order) != len(tasks):
            stuck = sorted(n for n, d in indeg.items() if d > 0)
            raise ValueError(f"task graph has a cycle through {stuck}")
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_succ", {k: tuple(dict.fromkeys(v)) for k, v in succ.items()})
        object.__setattr__(self, "_topo", tuple(order))

    def task(self, name: str) -> Task:
        """The task called ``name``; KeyError naming the known tasks otherwise."""
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"no task {name!r} (tasks: {list(self._index)})") from None

    @property
    def names(self) -> tuple[str, ...]:
        """Task names in declaration order."""
        return tuple(t.name for t in self.tasks)

    def topo_order(self) -> tuple[str, ...]:
        """A topological order (declaration order among ready tasks)."""
        return self._topo

    def preds(self, name: str) -> tuple[str, ...]:
        """Distinct direct predecessors of ``name``."""
        return tuple(dict.fromkeys(self.task(name).deps))

    def succs(self, name: str) -> tuple[str, ...]:
        """Distinct direct successors of ``name``."""
        self.task(name)
        return self._succ[name]

    def single_device(self, device: str) -> dict[str, str]:
        """The placement of every task on ``device``; ValueError if some task cannot run there."""
        cannot = [t.name for t in self.tasks if not t.runs_on(device)]
        if cannot:
            raise ValueError(f"tasks {cannot} have no {device} latency")
        return dict.fromkeys(self.names, device)

    def check_placement(self, placement: Mapping[str, str]) -> None:
        """ValueError naming the task when a placement misses a task or puts it where it cannot run."""
        missing = [n for n in self.names if n not in placement]
        if missing:
            raise ValueError(f"placement misses tasks {missing}")
        extra = [n for n in placement if n not in self._index]
        if extra:
            raise ValueError(f"placement names unknown tasks {extra}")
        for n, d in placement.items():
            if d not in DEVICES:
                raise ValueError(f"task {n!r}: unknown device {d!r}; use {list(DEVICES)}")
            if not self._index[n].runs_on(d):
                raise ValueError(f"task {n!r} has no {d} latency but is placed there")


@dataclass(frozen=True)
class Schedule:
    """What ``schedule`` computed: start/finish per task, the makespan and accelerator memory."""

    placement: dict[str, str]
    start_ms: dict[str, float]
    finish_ms: dict[str, float]
    makespan_ms: float
    gpu_mem_mb: float
    transfer_ms: float

    def busy_ms(self, device: str) -> float:
        """Sum of the execution times of the tasks on ``device``."""
        return sum(self.finish_ms[n] - self.start_ms[n] for n, d in self.placement.items() if d == device)


def gpu_memory_mb(graph: TaskGraph, placement: Mapping[str, str]) -> float:
    """Chrion's Eq. 4: accelerator memory of a placement (see the module docstring)."""
    total = 0.0
    for t in graph.tasks:
        if placement[t.name] != GPU:
            continue
        total += t.mem_mb + t.out_mb
        total += sum(graph.task(p).out_mb for p in graph.preds(t.name) if placement[p] != GPU)
    return total


def schedule(graph: TaskGraph, placement: Mapping[str, str], *, link: Link = PCIE,
             cpu_slots: int = 1, gpu_slots: int = 1, order: Sequence[str] | None = None,
             cpu_latency_scale: float = 1.0) -> Schedule:
    """List-schedule ``graph`` under ``placement`` (module docstring); the cost model of every planner.

    ``order`` is the priority order (a topological order; default ``graph.topo_order()``): each task
    in turn takes the slot of its device where it can start earliest. ``cpu_latency_scale``
    multiplies every CPU latency (Chrion: a core is slower when more cores are busy).
    """
    graph.check_placement(placement)
    if cpu_slots < 1 or gpu_slots < 1:
        raise ValueError(f"cpu_slots and gpu_slots must be >= 1, got {cpu_slots}, {gpu_slots}")
    seq = tuple(order) if order is not None else graph.topo_order()
    _check_order(graph, seq)
    free = {GPU: [0.0] * gpu_slots, CPU: [0.0] * cpu_slots}
    start: dict[str, float] = {}
    finish: dict[str, float] = {}
    moved = 0.0
    for n in seq:
        t = graph.task(n)
        dev = placement[n]
        ready = 0.0
        for p in graph.preds(n):
            arrive = finish[p]
            if placement[p] != dev:
                xfer = link.transfer_ms(graph.task(p).out_mb)
                arrive += xfer
                moved += xfer
            ready = max(ready, arrive)
        slots = free[dev]
        i = min(range(len(slots)), key=lambda k: (max(slots[k], ready), k))
        s = max(slots[i], ready)
        dur = t.latency_ms[dev] * (cpu_latency_scale if dev == CPU else 1.0)
        start[n], finish[n] = s, s + dur
        slots[i] = s + dur
    return Schedule(dict(placement), start, finish, max(finish.values()), gpu_memory_mb(graph, placement), moved)


def _check_order(graph: TaskGraph, order: Sequence[str]) -> None:
    if sorted(order) != sorted(graph.names):
        raise ValueError(f"order must list every task once; got {list(order)}")
    seen: set[str] = set()
    for n in order:
        late = [p for p in graph.preds(n) if p not in seen]
        if late:
            raise ValueError(f"order is not topological: {n!r} comes before its inputs {late}")
        seen.add(n)


@dataclass(frozen=True)
class Plan:
    """A planner's answer: the placement, its rated cost and the single-device costs it beat or matched.

    ``cost`` is the planner's own objective (makespan in ms, plus ``alpha * gpu_mem_mb`` for
    Chrion); ``baselines`` maps ``"gpu"``/``"cpu"`` to the same objective of the all-on-one-device
    placements the task graph allows. ``fallback`` names the single device when the planner found no
    split that beats it (DUET's fall back to the best single device).
    """

    placement: dict[str, str]
    cost: float
    makespan_ms: float
    gpu_mem_mb: float
    baselines: dict[str, float]
    fallback: str | None = None
    notes: dict[str, object] = field(default_factory=dict)

    def on(self, device: str) -> list[str]:
        """Tasks placed on ``device``, in placement order."""
        return [n for n, d in self.placement.items() if d == device]


def best_of(graph: TaskGraph, candidate: Mapping[str, str], cost_of: Callable[[dict[str, str]], float],
            ) -> tuple[dict[str, str], float, dict[str, float], str | None]:
    """The candidate or the best single-device placement, whichever ``cost_of`` rates lower.

    Returns (placement, cost, baselines, fallback device or None). The candidate wins ties.
    """
    baselines: dict[str, float] = {}
    for dev in DEVICES:
        if all(t.runs_on(dev) for t in graph.tasks):
            baselines[dev] = cost_of(graph.single_device(dev))
    cost = cost_of(candidate)
    best, fallback = dict(candidate), None
    for dev, c in sorted(baselines.items(), key=lambda kv: kv[1]):
        if c < cost - 1e-12:
            best, cost, fallback = graph.single_device(dev), c, dev
            break
    return best, cost, baselines, fallback
