"""Run co-execution placements of real torch models: DUET subgraphs via torch.fx, Chrion LSTM cells.

Devices. The *accelerator* is ``torch.device("cuda")`` when a GPU is present, else the CPU in the
caller's thread. The *CPU device* is a separate worker pool (threads of this process) that runs the
work placed on the CPU while the caller's thread runs the accelerator's. On a machine without a GPU
both "devices" are the same cores and the same torch intra-op pool: the executors then prove the
partitioning, the data movement and the answers (equal to running the model directly), not a speed-up.
A speed-up needs a real accelerator, or CPU pools pinned to disjoint cores in separate processes.

``partition(model)`` traces a model with ``torch.fx.symbolic_trace`` and cuts its graph into DUET's
phases (see ``gpuprims.coexec.subgraph``): a node every other node comes before or after is
sequential; the nodes between two such nodes are split into their weakly connected components, the
mutually independent parallel branches. Each subgraph is named after the module path its modules
share (``cnn``, ``heads.3``). ``SubgraphExecutor`` runs a placement phase by phase: the CPU-placed
subgraphs of a multi-path phase on the CPU worker, concurrently with the accelerator-placed ones in
the caller's thread; a tensor made on one device is moved (``.to``) to the other where it is used.
``profile_subgraphs`` times each subgraph alone on a device into a ``TaskGraph`` for the planners.

``LstmExecutor`` runs a Chrion placement of the zoo's ``StackedLSTM`` cell by cell: cells on the
accelerator in the plan's order in the caller's thread, cells on the CPU on ``cpu_workers`` threads
that take the CPU cells in the plan's order, each waiting for its inputs.
"""

from __future__ import annotations

import copy
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.fx.node import map_arg

from gpuprims.coexec.graph import CPU, GPU, Task, TaskGraph


def accelerator_device() -> Any:
    """``torch.device("cuda")`` when a GPU is usable, else ``torch.device("cpu")`` (module docstring)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class Subgraph:
    """One subgraph: its fx node names in topological order, and the phase it belongs to."""

    name: str
    nodes: tuple[str, ...]
    phase: int
    kind: str  # "sequential" or "multipath"


@dataclass
class FxPartition:
    """A traced model cut into subgraphs (module docstring); ``deps`` maps a subgraph to its inputs'."""

    module: Any  # torch.fx.GraphModule
    subgraphs: tuple[Subgraph, ...]
    deps: dict[str, tuple[str, ...]]
    owner: dict[str, str]  # fx node name -> subgraph name

    def phases(self) -> list[list[Subgraph]]:
        """Subgraphs grouped by phase, in order."""
        out: dict[int, list[Subgraph]] = {}
        for s in self.subgraphs:
            out.setdefault(s.phase, []).append(s)
        return [out[k] for k in sorted(out)]

    def task_graph(self, latency_ms: Mapping[str, Mapping[str, float]],
                   out_mb: Mapping[str, float] | None = None, mem_mb: Mapping[str, float] | None = None) -> TaskGraph:
        """The planners' view: one task per subgraph with the given per-device latencies."""
        missing = [s.name for s in self.subgraphs if s.name not in latency_ms]
        if missing:
            raise ValueError(f"no latency for subgraphs {missing}")
        return TaskGraph(tuple(
            Task(s.name, dict(latency_ms[s.name]), self.deps[s.name], (out_mb or {}).get(s.name, 0.0),
                 (mem_mb or {}).get(s.name, 0.0)) for s in self.subgraphs))


def partition(model: Any) -> FxPartition:
    """Trace ``model`` and cut it into DUET subgraphs; ValueError if fx cannot trace it."""
    try:
        gm = torch.fx.symbolic_trace(model)
    except Exception as e:  # fx raises many types (TraceError, TypeError, ...) for untraceable code
        raise ValueError(f"torch.fx cannot trace {type(model).__name__}: {type(e).__name__}: {e}") from e
    compute = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    if not compute:
        raise ValueError(f"{type(model).__name__} has no operations to partition")
    anc: dict[str, set[str]] = {}
    for n in compute:
        s: set[str] = set()
        for p in n.all_input_nodes:
            if p.name in anc:
                s.add(p.name)
                s |= anc[p.name]
        anc[n.name] = s
    names = [n.name for n in compute]
    desc_count = dict.fromkeys(names, 0)
    for n in names:
        for a in anc[n]:
            desc_count[a] += 1
    total = len(names)
    # comparable with every node: its ancestors plus its descendants are all the others
    cut = {n: len(anc[n]) + desc_count[n] == total - 1 for n in names}
    segments: list[tuple[str, list[str]]] = []
    for n in names:
        kind = "sequential" if cut[n] else "multipath"
        if segments and segments[-1][0] == kind:
            segments[-1][1].append(n)
        else:
            segments.append((kind, [n]))
    by_name = {n.name: n for n in compute}
    # Each multi-path segment becomes its parallel branches plus the nodes that join them; a segment
    # with one branch only, and the join nodes, are sequential.
    phases_: list[tuple[str, list[list[str]]]] = []
    for kind, members in segments:
        if kind == "sequential":
            phases_.append(("sequential", [members]))
            continue
        branches, joins = _branches(members, by_name)
        if len(branches) > 1:
            phases_.append(("multipath", branches))
        else:
            phases_.append(("sequential", [members if not branches else branches[0]]))
            joins = [j for j in joins if not branches or j not in branches[0]]
        if joins:
            phases_.append(("sequential", [joins]))
    merged: list[tuple[str, list[list[str]]]] = []
    for kind, comps in phases_:  # consecutive sequential phases are one subgraph
        if kind == "sequential" and merged and merged[-1][0] == "sequential":
            merged[-1][1][0].extend(comps[0])
        else:
            merged.append((kind, [list(c) for c in comps]))
    order = {n: i for i, n in enumerate(names)}
    subgraphs: list[Subgraph] = []
    used: set[str] = set()
    for phase, (kind, comps) in enumerate(merged):
        for comp in comps:
            comp = sorted(comp, key=order.__getitem__)
            subgraphs.append(Subgraph(_unique(_name_of(comp, by_name), used), tuple(comp), phase, kind))
    owner = {n: s.name for s in subgraphs for n in s.nodes}
    deps: dict[str, tuple[str, ...]] = {}
    for s in subgraphs:
        d: list[str] = []
        for n in s.nodes:
            for p in by_name[n].all_input_nodes:
                o = owner.get(p.name)
                if o is not None and o != s.name and o not in d:
                    d.append(o)
        deps[s.name] = tuple(d)
    return FxPartition(gm, tuple(subgraphs), deps, owner)


def _branches(members: list[str], by_name: Mapping[str, Any]) -> tuple[list[list[str]], list[str]]:
    """Split a multi-path segment into parallel branches and the join nodes after them.

    A node without inputs inside the segment starts a branch; a node whose inputs come from one
    branch belongs to it; a node whose inputs come from several branches, or from a join, is a join.
    A branch without any module call (shape arithmetic, a slice) that meets another branch only at a
    join is glue, not a branch: it is merged into the branch it meets, and labelling starts over.
    """
    inside = set(members)
    parent: dict[str, str] = {}

    def find(a: str) -> str:
        while parent.setdefault(a, a) != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    join = "\0join"
    while True:
        label: dict[str, str] = {}
        for m in members:
            ins = {label[p.name] for p in by_name[m].all_input_nodes if p.name in inside}
            if not ins:
                label[m] = find(m)
            elif len(ins) == 1:
                label[m] = next(iter(ins))
            else:
                label[m] = join
        has_module = {lab for m, lab in label.items() if by_name[m].op == "call_module"}
        changed = False
        for m in members:
            ins = {label[p.name] for p in by_name[m].all_input_nodes if p.name in inside} - {join}
            if label[m] == join and len(ins) > 1 and len(ins & has_module) <= 1:
                keep = next(iter(sorted(ins & has_module) or sorted(ins)))
                for lab in ins:
                    parent[find(lab)] = find(keep)
                changed = True
                break
        if not changed:
            break
    groups: dict[str, list[str]] = {}
    joins: list[str] = []
    for m in members:
        (joins if label[m] == join else groups.setdefault(label[m], [])).append(m)
    return list(groups.values()), joins


def _name_of(comp: Sequence[str], by_name: Mapping[str, Any]) -> str:
    paths = [str(by_name[n].target).split(".") for n in comp if by_name[n].op == "call_module"]
    if paths:
        prefix = paths[0]
        for p in paths[1:]:
            k = 0
            while k < min(len(prefix), len(p)) and prefix[k] == p[k]:
                k += 1
            prefix = prefix[:k]
        if prefix:
            return ".".join(prefix)
    return comp[0]


def _unique(name: str, used: set[str]) -> str:
    out, i = name, 1
    while out in used:
        i += 1
        out = f"{name}#{i}"
    used.add(out)
    return out


def _to(value: Any, device: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    return value


class _Runner:
    """Evaluates fx nodes on one device with its own copy of the module."""

    def __init__(self, gm: Any, device: Any, shared: bool) -> None:
        self.device = device
        self.gm = gm if shared else copy.deepcopy(gm).to(device)
        self.nodes = {n.name: n for n in self.gm.graph.nodes}

    def run(self, names: Sequence[str], env: dict[str, Any]) -> None:
        with torch.inference_mode():
            for name in names:
                node = self.nodes[name]
                args = map_arg(node.args, lambda a: _to(env[a.name], self.device))
                kwargs = map_arg(node.kwargs, lambda a: _to(env[a.name], self.device))
                if node.op == "call_module":
                    env[name] = self.gm.get_submodule(node.target)(*args, **kwargs)
                elif node.op == "call_function":
                    env[name] = node.target(*args, **kwargs)
                elif node.op == "call_method":
                    env[name] = getattr(args[0], node.target)(*args[1:], **kwargs)
                elif node.op == "get_attr":
                    obj: Any = self.gm
                    for part in str(node.target).split("."):
                        obj = getattr(obj, part)
                    env[name] = obj
                else:  # placeholders and the output are handled by the executor
                    raise ValueError(f"unexpected fx node {name!r} of kind {node.op!r}")


class SubgraphExecutor:
    """Runs a DUET placement of ``partition`` (module docstring); ``close()`` or ``with`` ends the pool.

    ``accel`` defaults to ``accelerator_device()``; the CPU device is one worker thread (DUET runs
    the subgraphs placed on a device one after another).
    """

    def __init__(self, part: FxPartition, placement: Mapping[str, str], *, accel: Any = None) -> None:
        names = {s.name for s in part.subgraphs}
        bad = sorted(set(placement) ^ names)
        if bad:
            raise ValueError(f"placement must name every subgraph exactly once; mismatched: {bad}")
        for n, d in placement.items():
            if d not in (GPU, CPU):
                raise ValueError(f"subgraph {n!r}: device must be {GPU!r} or {CPU!r}, got {d!r}")
        self.part = part
        self.placement = dict(placement)
        self.accel = torch.device(accel) if accel is not None else accelerator_device()
        cpu = torch.device("cpu")
        self._runners = {GPU: _Runner(part.module, self.accel, self.accel == cpu),
                         CPU: _Runner(part.module, cpu, True)}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="coexec-cpu")
        self._placeholders = [n.name for n in part.module.graph.nodes if n.op == "placeholder"]
        self._output = next(n for n in part.module.graph.nodes if n.op == "output")

    def __call__(self, *inputs: Any) -> Any:
        """Run the model on ``inputs``; the answer comes back on the CPU."""
        if len(inputs) != len(self._placeholders):
            raise ValueError(f"model takes {len(self._placeholders)} inputs, got {len(inputs)}")
        env: dict[str, Any] = dict(zip(self._placeholders, inputs))
        for group in self.part.phases():
            on_cpu = [s for s in group if self.placement[s.name] == CPU]
            on_gpu = [s for s in group if self.placement[s.name] == GPU]
            fut: Future[None] | None = None
            if on_cpu:
                fut = self._pool.submit(self._run_all, CPU, on_cpu, env)
            try:
                self._run_all(GPU, on_gpu, env)
            finally:
                if fut is not None:
                    fut.result()
        out = map_arg(self._output.args[0], lambda a: env[a.name])
        return _to(out, torch.device("cpu"))

    def _run_all(self, dev: str, subs: Sequence[Subgraph], env: dict[str, Any]) -> None:
        for s in subs:
            self._runners[dev].run(s.nodes, env)

    def close(self) -> None:
        """Stop the CPU worker (idempotent)."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> SubgraphExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _time_ms(fn: Callable[[], None], repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1e6)
    return statistics.median(samples)


def profile_subgraphs(part: FxPartition, inputs: Sequence[Any], *, device: Any = "cpu", repeats: int = 20,
                      warmup: int = 3) -> dict[str, dict[str, float]]:
    """Median time (ms) of each subgraph run alone on ``device`` with its real inputs, plus its
    output size (MB: tensors other subgraphs read). Returns {name: {"latency_ms", "out_mb"}}."""
    dev = torch.device(device)
    runner = _Runner(part.module, dev, dev == torch.device("cpu"))
    placeholders = [n.name for n in part.module.graph.nodes if n.op == "placeholder"]
    env: dict[str, Any] = {k: _to(v, dev) for k, v in zip(placeholders, inputs)}
    for s in part.subgraphs:
        runner.run(s.nodes, env)
    users: dict[str, set[str]] = {}
    for n in part.module.graph.nodes:
        for p in n.all_input_nodes:
            users.setdefault(p.name, set()).add(part.owner.get(n.name, "<output>"))
    out: dict[str, dict[str, float]] = {}
    for s in part.subgraphs:
        frozen = dict(env)

        def once(s: Subgraph = s, frozen: dict[str, Any] = frozen) -> None:
            runner.run(s.nodes, dict(frozen))
            if dev.type == "cuda":
                torch.cuda.synchronize()

        mb = sum(_nbytes(env[n]) for n in s.nodes if users.get(n, set()) - {s.name}) / 2**20
        out[s.name] = {"latency_ms": _time_ms(once, repeats, warmup), "out_mb": mb}
    return out


def placement_timer(part: FxPartition, inputs: Sequence[Any], *, repeats: int = 10, warmup: int = 2,
                    accel: Any = None) -> Callable[[dict[str, str]], float]:
    """A DUET ``measure`` callback: the median wall time (ms) of running ``inputs`` through a placement
    with ``SubgraphExecutor`` (on a GPU host, the paper's step 3 on real runs)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")

    def measure(placement: dict[str, str]) -> float:
        with SubgraphExecutor(part, placement, accel=accel) as ex:
            def once() -> None:
                ex(*inputs)
                if ex.accel.type == "cuda":
                    torch.cuda.synchronize()

            return _time_ms(once, repeats, warmup)

    return measure


def _nbytes(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (tuple, list)):
        return sum(_nbytes(x) for x in v)
    return 0


# ---- Chrion: the unrolled LSTM, cell by cell -----------------------------------------------------------


def cell_name(layer: int, step: int) -> str:
    """The operator name of LSTM cell (layer, step), as in ``oppart.lstm_graph``."""
    return f"L{layer}T{step}"


class LstmExecutor:
    """Runs a Chrion placement of a zoo ``StackedLSTM`` (module docstring); ``close()`` ends the pool.

    ``placement`` maps every cell ``L{l}T{t}`` and ``head`` to ``"gpu"`` or ``"cpu"``; ``order`` is
    the plan's operator order (a topological order of the cells).
    """

    def __init__(self, model: Any, placement: Mapping[str, str], order: Sequence[str], *, cpu_workers: int = 1,
                 accel: Any = None, wait_s: float = 60.0) -> None:
        layers, steps = len(model.cells), model.seq_len
        want = {cell_name(layer, t) for layer in range(layers) for t in range(steps)} | {"head"}
        bad = sorted(set(placement) ^ want)
        if bad:
            raise ValueError(f"placement must name every cell and 'head' exactly once; mismatched: {bad[:6]}")
        if sorted(order) != sorted(want):
            raise ValueError("order must list every cell and 'head' exactly once")
        if cpu_workers < 1:
            raise ValueError(f"cpu_workers must be >= 1, got {cpu_workers}")
        if not wait_s > 0:
            raise ValueError(f"wait_s must be > 0, got {wait_s}")
        self.layers, self.steps = layers, steps
        self.placement, self.order = dict(placement), list(order)
        self.accel = torch.device(accel) if accel is not None else accelerator_device()
        cpu = torch.device("cpu")
        self._models = {CPU: model, GPU: model if self.accel == cpu else copy.deepcopy(model).to(self.accel)}
        self._devs = {CPU: cpu, GPU: self.accel}
        self.cpu_workers = cpu_workers
        self.wait_s = wait_s
        self._pool = ThreadPoolExecutor(max_workers=cpu_workers, thread_name_prefix="coexec-core")

    def _deps(self, op: str) -> list[str]:
        if op == "head":
            return [cell_name(self.layers - 1, self.steps - 1)]
        layer, t = (int(v) for v in op[1:].split("T"))
        return ([cell_name(layer, t - 1)] if t else []) + ([cell_name(layer - 1, t)] if layer else [])

    def __call__(self, x: Any) -> Any:
        """Run the model on ``x`` (N, 1, T, F); the answer comes back on the CPU."""
        seq = x[:, 0]
        done = {op: threading.Event() for op in self.order}
        state: dict[str, Any] = {}
        failed: list[BaseException] = []

        def run(op: str, dev: str) -> None:
            for d in self._deps(op):
                while not done[d].wait(0.05):
                    if failed:
                        raise RuntimeError("another operator failed")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"operator {op!r} waited more than wait_s={self.wait_s} s for {d!r}")
            model, device = self._models[dev], self._devs[dev]
            with torch.inference_mode():
                if op == "head":
                    state[op] = model.head(_to(state[self._deps(op)[0]][0], device))
                else:
                    layer, t = (int(v) for v in op[1:].split("T"))
                    inp = seq[:, t] if layer == 0 else state[cell_name(layer - 1, t)][0]
                    prev = state[cell_name(layer, t - 1)] if t else model.initial_state(seq.shape[0], seq)
                    state[op] = model.cells[layer](_to(inp, device), _to(prev, device))
            done[op].set()

        cpu_ops: Iterator[str] = iter([op for op in self.order if self.placement[op] == CPU])
        lock = threading.Lock()

        def cpu_worker() -> None:
            try:
                while True:
                    with lock:
                        op = next(cpu_ops, None)
                    if op is None or failed:
                        return
                    run(op, CPU)
            except BaseException as e:
                failed.append(e)
                raise

        deadline = time.monotonic() + self.wait_s
        futs = [self._pool.submit(cpu_worker) for _ in range(self.cpu_workers)]
        try:
            for op in self.order:
                if self.placement[op] == GPU:
                    run(op, GPU)
        except BaseException as e:
            failed.append(e)
        finally:
            for f in futs:
                f.exception()  # wait for the workers; their error (if any) is in ``failed``
        if failed:
            raise failed[0]  # the first failure, not a waiter's "another operator failed"
        return _to(state["head"], torch.device("cpu"))

    def close(self) -> None:
        """Stop the CPU workers (idempotent)."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> LstmExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _step_cell(cell: Any, x: Any, start: threading.Barrier, repeats: int, out: list[float]) -> None:
    with torch.inference_mode():
        h = c = x.new_zeros(x.shape[0], cell.hidden_size)
        for _ in range(10):
            h, c = cell(x, (h, c))
        start.wait()
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            h, c = cell(x, (h, c))
            out.append((time.perf_counter_ns() - t0) / 1e6)


def measure_lstm_cell_ms(*, batch: int, features: int, max_workers: int, repeats: int = 200,
                         seed: int = 0) -> dict[int, float]:
    """Median time (ms) of one LSTM cell step (``features`` in and hidden, ``batch`` rows) on the CPU
    while ``k`` worker threads run cells at once, for k = 1..max_workers: what ``LstmExecutor``'s
    CPU workers see, contention for cores, caches and the interpreter lock included."""
    if batch < 1 or features < 1 or max_workers < 1 or repeats < 1:
        raise ValueError("batch, features, max_workers and repeats must be >= 1")
    gen = torch.Generator().manual_seed(seed)
    out: dict[int, float] = {}
    for k in range(1, max_workers + 1):
        cells = [nn.LSTMCell(features, features) for _ in range(k)]
        xs = [torch.randn(batch, features, generator=gen) for _ in range(k)]
        times: list[list[float]] = [[] for _ in range(k)]
        start = threading.Barrier(k)
        threads = [threading.Thread(target=_step_cell, args=(cells[i], xs[i], start, repeats, times[i]))
                   for i in range(k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out[k] = statistics.median([x for ts in times for x in ts])
    return out


def cpu_count() -> int:
    """Cores this process may run on (affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)
