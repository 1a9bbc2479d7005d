"""The operator graph Opara plans on: a model's torch.fx graph with a class and a demand per operator.

``op_graph(model, example_input)`` traces ``model`` with ``torch.fx.symbolic_trace``, runs it once on
``example_input`` to record every node's output shape (as Opara's profiler runs the model once), and
returns an ``OpGraph``: one ``Op`` per fx node (placeholders, operators, the output) with

- ``what``: what the operator is: the module type (``Conv2d``), the function (``torch.cat``) or the
  method (``method:view``); never the node's name, which is only a label;
- ``flops`` and ``bytes``: an estimate from that and the recorded shapes. Convolutions, linear layers
  and matrix products (the *contractions*) count two FLOPs per multiply-add and move their inputs,
  weights and output; views and shape arithmetic move nothing; every other operator (elementwise,
  pooling, normalisation, concatenation) does about one operation per element it reads and moves
  what it reads and writes;
- ``op_class``: ``"compute"`` when the operator's arithmetic intensity (``flops / bytes``) reaches the
  reference device's ridge point, else ``"memory"``. Only a contraction can get there: a 3x3
  convolution over 56x56 maps is compute-bound, the 1024 -> 1000 classifier at batch 1 (a matrix
  times a vector) is memory-bound, whatever the nodes are called;
- ``host``: the operator's result holds no tensor (shape reads, integer arithmetic): it launches
  nothing on a device, and Algorithm 1 does not give it a stream of its own;
- ``demand_us``: the roofline time of the operator on the reference device, ``max(flops / peak,
  bytes / bandwidth)``: the resource demand Algorithm 2 orders by (the paper profiles shared memory
  per block on the GPU; this estimate needs no GPU and orders operators the same way within a class:
  bigger operators hold the device longer).

In-place operators (``ReLU(inplace=True)``, ``x.add_(y)``) overwrite their first input. Where that
input has other readers, the graph gets ordering edges (readers before the write in the traced order
precede it, later ones follow it), so no plan lets a reader see the wrong value. Writes through views
of a tensor (``x.view(...).add_(...)``) are not tracked: such a model is refused only if the in-place
node's input is itself a view with other readers (``ValueError`` naming the node).

The structure (validation, topological order, predecessors and successors) is
``gpuprims.coexec.graph.TaskGraph``: each operator is a task whose accelerator latency is its roofline
time, so the co-execution cost model (``schedule``) can also rate a plan.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.fx.node import map_arg

from gpuprims.coexec.graph import GPU, Task, TaskGraph

MEMORY = "memory"
COMPUTE = "compute"
OP_CLASSES = (MEMORY, COMPUTE)

#: Kinds of ``Op``: the model's inputs, its operators, and its output (the join point).
INPUT = "input"
OPERATOR = "op"
OUTPUT = "output"


@dataclass(frozen=True)
class Roofline:
    """A reference device for the estimates: peak FP32 throughput and memory bandwidth.

    The default is an NVIDIA T4 (8.1 TFLOP/s FP32, 320 GB/s), the edge GPU of the project's paper:
    ridge point about 25 FLOPs per byte.
    """
    peak_gflops: float = 8100.0
    bandwidth_gbps: float = 320.0

    def __post_init__(self) -> None:
        for label, v in (("peak_gflops", self.peak_gflops), ("bandwidth_gbps", self.bandwidth_gbps)):
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{label} must be a positive finite number, got {v!r}")

    @property
    def ridge_flops_per_byte(self) -> float:
        """The arithmetic intensity above which an operator is compute-bound on this device."""
        return self.peak_gflops / self.bandwidth_gbps

    def time_us(self, flops: float, nbytes: float) -> float:
        """Roofline time of an operator: the larger of its compute time and its memory time (us)."""
        return max(flops / (self.peak_gflops * 1e3), nbytes / (self.bandwidth_gbps * 1e3))

    def classify(self, flops: float, nbytes: float) -> str:
        """``"compute"`` when ``flops / nbytes`` reaches the ridge point, else ``"memory"``."""
        if flops <= 0:
            return MEMORY
        if nbytes <= 0:
            return COMPUTE
        return COMPUTE if flops / nbytes >= self.ridge_flops_per_byte else MEMORY


T4 = Roofline()


@dataclass(frozen=True)
class Op:
    """One node of the operator graph (see the module docstring for each field)."""

    name: str
    preds: tuple[str, ...] = ()
    kind: str = OPERATOR
    what: str = ""
    op_class: str = MEMORY
    flops: float = 0.0
    bytes: float = 0.0
    demand_us: float = 0.0
    out_shape: tuple[int, ...] | None = None
    #: True for an operator whose result holds no tensor (``x.shape``, ``size()``, integer arithmetic):
    #: host-side work that launches nothing on a device.
    host: bool = False

    def __post_init__(self) -> None:
        if self.kind not in (INPUT, OPERATOR, OUTPUT):
            raise ValueError(f"op {self.name!r}: kind must be one of {INPUT!r}, {OPERATOR!r}, {OUTPUT!r}, "
                             f"got {self.kind!r}")
        if self.op_class not in OP_CLASSES:
            raise ValueError(f"op {self.name!r}: op_class must be one of {list(OP_CLASSES)}, got {self.op_class!r}")
        for label, v in (("flops", self.flops), ("bytes", self.bytes), ("demand_us", self.demand_us)):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"op {self.name!r}: {label} must be finite and >= 0, got {v!r}")
        if self.kind == INPUT and self.preds:
            raise ValueError(f"input {self.name!r} cannot have predecessors {list(self.preds)}")
        if self.host and self.kind != OPERATOR:
            raise ValueError(f"op {self.name!r}: only an operator can be host-side, not a {self.kind!r}")
        object.__setattr__(self, "preds", tuple(dict.fromkeys(self.preds)))


@dataclass(frozen=True)
class GraphIndex:
    """The graph's structure over integers, made once with the graph: what the planners walk.

    Position ``i`` is the ``i``-th op of ``topo`` (the graph's topological order). ``preds[i]`` and
    ``succs[i]`` are positions, in the op's reading order and in declaration order; ``kind``,
    ``op_class``, ``host`` and ``demand_us`` are the ops' fields by position. Planning time is
    reported (the paper's Table I), so the planners do not rebuild this from names at every plan.
    """
    topo: tuple[str, ...]
    pos: Mapping[str, int]
    preds: tuple[tuple[int, ...], ...]
    succs: tuple[tuple[int, ...], ...]
    kind: tuple[str, ...]
    op_class: tuple[str, ...]
    host: tuple[bool, ...]
    demand_us: tuple[float, ...]


@dataclass(frozen=True)
class OpGraph:
    """A validated DAG of ``Op`` (unique names, known predecessors, no cycle, one output at most).

    Successors are listed in declaration order, which for a traced model is the fx graph's order:
    Algorithm 1's "first successor" is the first in that order. ``module`` is the traced
    ``torch.fx.GraphModule`` when the graph comes from a model (None for hand-made graphs).
    """
    ops: tuple[Op, ...]
    module: Any = field(default=None, compare=False, repr=False)
    tasks: TaskGraph = field(init=False, compare=False, repr=False)
    _index: dict[str, Op] = field(default_factory=dict, init=False, compare=False, repr=False)
    _preds: dict[str, tuple[str, ...]] = field(default_factory=dict, init=False, compare=False, repr=False)
    _succs: dict[str, tuple[str, ...]] = field(default_factory=dict, init=False, compare=False, repr=False)
    _indexed: GraphIndex | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        ops = tuple(self.ops)
        object.__setattr__(self, "ops", ops)
        if not ops:
            raise ValueError("an operator graph needs at least one op")
        outputs = [o.name for o in ops if o.kind == OUTPUT]
        if len(outputs) > 1:
            raise ValueError(f"an operator graph has one output at most, got {outputs}")
        tasks = TaskGraph(tuple(
            Task(o.name, {GPU: o.demand_us / 1e3}, o.preds, (o.bytes / 2**20) if o.kind == OPERATOR else 0.0)
            for o in ops
        ))
        for o in ops:
            if o.kind == OUTPUT and tasks.succs(o.name):
                raise ValueError(f"output {o.name!r} cannot have successors {list(tasks.succs(o.name))}")
        object.__setattr__(self, "tasks", tasks)
        object.__setattr__(self, "_index", {o.name: o for o in ops})
        # Plain dicts: the planners look these up for every op and edge, and planning time is reported.
        object.__setattr__(self, "_preds", {o.name: o.preds for o in ops})
        object.__setattr__(self, "_succs", {o.name: tasks.succs(o.name) for o in ops})
        topo = tasks.topo_order()
        pos = {n: i for i, n in enumerate(topo)}
        by_pos = [self._index[n] for n in topo]
        object.__setattr__(self, "_indexed", GraphIndex(
            topo=topo, pos=pos,
            preds=tuple(tuple(pos[p] for p in o.preds) for o in by_pos),
            succs=tuple(tuple(pos[x] for x in self._succs[o.name]) for o in by_pos),
            kind=tuple(o.kind for o in by_pos), op_class=tuple(o.op_class for o in by_pos),
            host=tuple(o.host for o in by_pos), demand_us=tuple(o.demand_us for o in by_pos)))

    @classmethod
    def from_edges(cls, preds: Mapping[str, Sequence[str]], *, op_class: Mapping[str, str] | None = None,
                   demand_us: Mapping[str, float] | None = None) -> OpGraph:
        """A hand-made graph: ``preds`` maps every op (in declaration order) to its predecessors.

        Every op is an operator (no inputs or output), memory-bound with demand 0 unless given.
        """
        classes = op_class or {}
        demands = demand_us or {}
        return cls(tuple(Op(n, tuple(p), op_class=classes.get(n, MEMORY), demand_us=float(demands.get(n, 0.0)))
                         for n, p in preds.items()))

    @property
    def indexed(self) -> GraphIndex:
        """The structure over integer positions (``GraphIndex``), made with the graph."""
        assert self._indexed is not None  # set by __post_init__
        return self._indexed

    def op(self, name: str) -> Op:
        """The op called ``name``; KeyError naming the known ops otherwise."""
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"no op {name!r} (ops: {list(self._index)})") from None

    @property
    def names(self) -> tuple[str, ...]:
        """Op names in declaration order (for a traced model: the fx graph's order)."""
        return self.tasks.names

    def preds(self, name: str) -> tuple[str, ...]:
        """Distinct direct predecessors, in the order the op reads them."""
        try:
            return self._preds[name]
        except KeyError:
            return self.op(name).preds  # raises KeyError naming the known ops

    def succs(self, name: str) -> tuple[str, ...]:
        """Distinct direct successors, in declaration order."""
        try:
            return self._succs[name]
        except KeyError:
            self.op(name)  # raises KeyError naming the known ops
            raise

    def topo_order(self) -> tuple[str, ...]:
        """A topological order (declaration order among ready ops)."""
        return self.tasks.topo_order()

    def edges(self) -> Iterable[tuple[str, str]]:
        """Every edge (producer, consumer)."""
        for o in self.ops:
            for p in o.preds:
                yield p, o.name

    def counts(self) -> dict[str, int]:
        """Number of operators per class, of inputs and of edges."""
        out = {MEMORY: 0, COMPUTE: 0, INPUT: 0, "edges": sum(len(o.preds) for o in self.ops)}
        for o in self.ops:
            if o.kind == INPUT:
                out[INPUT] += 1
            elif o.kind == OPERATOR:
                out[o.op_class] += 1
        return out


# --- from a torch model ---------------------------------------------------------------------------

#: Functions and methods that only reinterpret a tensor's shape or read metadata: they move nothing.
_VIEW_METHODS = frozenset({
    "view", "reshape", "flatten", "unsqueeze", "squeeze", "permute", "transpose", "expand", "size", "dim",
    "t", "narrow", "select", "unflatten", "view_as", "expand_as", "chunk", "split", "unbind",
})  # fmt: skip
_CONTRACTION_METHODS = frozenset({"matmul", "mm", "bmm", "__matmul__"})
_INPLACE_OPERATORS = frozenset({operator.iadd, operator.isub, operator.imul, operator.itruediv})


@functools.lru_cache(maxsize=1)
def _function_names() -> tuple[dict[Any, str], frozenset[Any], frozenset[Any]]:
    contractions = {
        torch.conv1d: "conv", torch.conv2d: "conv", torch.conv3d: "conv", F.conv1d: "conv", F.conv2d: "conv",
        F.conv3d: "conv", F.linear: "linear", torch.matmul: "matmul", torch.mm: "matmul", torch.bmm: "matmul",
        operator.matmul: "matmul", torch.addmm: "addmm", torch.baddbmm: "matmul",
    }
    views = frozenset({torch.flatten, torch.reshape, torch.squeeze, torch.unsqueeze, torch.permute,
                       torch.transpose, torch.narrow, torch.select, torch.chunk, torch.split, operator.getitem,
                       getattr})
    return contractions, views, frozenset(contractions)


def _describe(node: Any, gm: Any) -> str:
    if node.op == "call_module":
        return type(gm.get_submodule(node.target)).__name__
    if node.op == "call_method":
        return f"method:{node.target}"
    if node.op == "call_function":
        mod = getattr(node.target, "__module__", None) or ""
        name = getattr(node.target, "__name__", repr(node.target))
        return f"{mod}.{name}" if mod else name
    return node.op


def _tensors(value: Any) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _nbytes(values: Iterable[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in values)


def _is_inplace(node: Any, gm: Any) -> bool:
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(node.target), "inplace", False))
    if node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.startswith("__")
    if node.op == "call_function":
        if node.target in _INPLACE_OPERATORS:
            return True
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.startswith("__")
    return False


def _estimate(node: Any, gm: Any, ins: list[Any], out: list[Any]) -> tuple[float, float]:
    """(flops, bytes) of one fx node from what it is and the tensors it read and wrote."""
    contractions, views, _ = _function_names()
    out_numel = sum(t.numel() for t in out)
    kind: str | None = None
    weights: list[Any] = []
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            kind, weights = "conv", [p for p in (mod.weight, mod.bias) if p is not None]
        elif isinstance(mod, nn.Linear):
            kind, weights = "linear", [p for p in (mod.weight, mod.bias) if p is not None]
        elif isinstance(mod, (nn.Flatten, nn.Unflatten, nn.Identity, nn.Dropout)):
            return 0.0, 0.0  # a view, or nothing at inference
        else:
            weights = list(mod.parameters()) + list(mod.buffers())
    elif node.op == "call_function":
        if node.target in views:
            return 0.0, 0.0
        kind = contractions.get(node.target)
    elif node.op == "call_method":
        if node.target in _VIEW_METHODS:
            return 0.0, 0.0
        if node.target in _CONTRACTION_METHODS:
            kind = "matmul"
    else:
        return 0.0, 0.0
    nbytes = float(_nbytes(ins) + _nbytes(out) + _nbytes(weights))
    if kind == "conv":
        w = weights[0] if weights else (ins[1] if len(ins) > 1 else None)
        per_out = (w.shape[1] * math.prod(w.shape[2:])) if w is not None else 1
        return 2.0 * out_numel * per_out, nbytes
    if kind == "linear":
        w = weights[0] if weights else (ins[1] if len(ins) > 1 else None)
        return 2.0 * out_numel * (w.shape[-1] if w is not None else 1), nbytes
    if kind in ("matmul", "addmm"):
        a = ins[1] if kind == "addmm" and len(ins) > 1 else (ins[0] if ins else None)
        return 2.0 * out_numel * (a.shape[-1] if a is not None and a.dim() > 0 else 1), nbytes
    # Elementwise, pooling, normalisation, concatenation: about one operation per element read.
    return float(max(out_numel, sum(t.numel() for t in ins))), nbytes


def op_graph(model: Any, example_input: Any, *, device: Roofline = T4) -> OpGraph:
    """Trace ``model`` and build its operator graph (module docstring), running it once on ``example_input``.

    ``example_input`` is one tensor or a tuple of tensors (the model's positional inputs); the shapes
    it gives are the shapes the plan is for (one plan per batch size). Raises ValueError when fx cannot
    trace the model, when the input count is wrong, or when an in-place write goes through a shared view.
    """
    try:
        gm = model if isinstance(model, torch.fx.GraphModule) else torch.fx.symbolic_trace(model)
    except Exception as e:  # fx raises many types (TraceError, TypeError, ...) for untraceable code
        raise ValueError(f"torch.fx cannot trace {type(model).__name__}: {type(e).__name__}: {e}") from e
    inputs = example_input if isinstance(example_input, tuple) else (example_input,)
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(inputs) != len(placeholders):
        raise ValueError(f"{type(model).__name__} takes {len(placeholders)} inputs, got {len(inputs)}")
    _, views, _ = _function_names()
    env: dict[str, Any] = {}
    estimates: dict[str, tuple[float, float, tuple[int, ...] | None, bool]] = {}
    with torch.inference_mode():
        for n in nodes:
            if n.op == "placeholder":
                env[n.name] = inputs[placeholders.index(n)]
            elif n.op == "output":
                env[n.name] = None
            else:
                args = map_arg(n.args, lambda a: env[a.name])
                kwargs = map_arg(n.kwargs, lambda a: env[a.name])
                ins = [t for p in n.all_input_nodes for t in _tensors(env[p.name])]
                # Read sizes before the call: an in-place operator changes nothing in shape, but be exact.
                if n.op == "call_module":
                    value = gm.get_submodule(n.target)(*args, **kwargs)
                elif n.op == "call_function":
                    value = n.target(*args, **kwargs)
                elif n.op == "call_method":
                    value = getattr(args[0], n.target)(*args[1:], **kwargs)
                else:  # get_attr
                    value = gm
                    for part in str(n.target).split("."):
                        value = getattr(value, part)
                env[n.name] = value
                outs = _tensors(value)
                flops, nbytes = _estimate(n, gm, ins, outs) if n.op != "get_attr" else (0.0, 0.0)
                shape = tuple(outs[0].shape) if len(outs) == 1 else None
                estimates[n.name] = (flops, nbytes, shape, not outs)
    extra: dict[str, list[str]] = {n.name: [] for n in nodes}
    position = {n.name: i for i, n in enumerate(nodes)}
    view_like = {n.name for n in nodes
                 if (n.op == "call_function" and n.target in views)
                 or (n.op == "call_method" and n.target in _VIEW_METHODS)}
    for n in nodes:
        if n.op not in ("call_module", "call_function", "call_method") or not _is_inplace(n, gm):
            continue
        if not n.all_input_nodes:
            continue
        target = n.all_input_nodes[0]
        readers = [u for u in target.users if u is not n]
        if not readers:
            continue
        if target.name in view_like:
            raise ValueError(
                f"node {n.name!r} ({_describe(n, gm)}) writes in place into {target.name!r}, a view other "
                f"operators read; the operator graph does not track writes through views"
            )
        for u in readers:
            if position[u.name] < position[n.name]:
                extra[n.name].append(u.name)
            else:
                extra[u.name].append(n.name)
    ops: list[Op] = []
    for n in nodes:
        preds = tuple(p.name for p in n.all_input_nodes) + tuple(extra[n.name])
        if n.op == "placeholder":
            t = env[n.name]
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else None
            ops.append(Op(n.name, (), INPUT, "input", MEMORY, 0.0, 0.0, 0.0, shape))
        elif n.op == "output":
            ops.append(Op(n.name, preds, OUTPUT, "output", MEMORY))
        else:
            flops, nbytes, shape, host = estimates[n.name]
            ops.append(Op(n.name, preds, OPERATOR, _describe(n, gm), device.classify(flops, nbytes), flops, nbytes,
                          device.time_us(flops, nbytes), shape, host))
    return OpGraph(tuple(ops), module=gm)
