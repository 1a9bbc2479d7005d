"""Opara's two planners as pure functions, and the ``StreamPlan`` a capture or an executor follows.

**Algorithm 1, stream allocation** (``allocate_streams``). The ops are visited in topological order;
an op takes the stream of its first predecessor (in the order it reads them) whose first successor it
is, else a new stream. Each op so hands its stream to one successor at most, and each op gets its
stream from one predecessor at most: every stream is a *chain*, a path of the graph. Hence the
property the tests hold a plan to: any two operators on one stream are ordered by the graph (one is an
ancestor of the other), so two branches that can run at the same time never share a stream. The
model's inputs live on stream 0 (the capture's origin stream) and pass it on once, to the first op
that is the first successor of an input; the output op is put on stream 0 (it is the join).
Host-side operators (``Op.host``: shape reads, integer arithmetic; they launch nothing) ride on
their first input's stream without taking it, so they neither start streams nor break a chain of
device operators (a host op is not a device operator: the property above is about device operators).
``rule="first_free"`` is the public implementation's variant: an op takes the stream of its first
predecessor that has not yet handed it on (an op whose first successor went elsewhere can pass its
stream to a later successor): fewer streams, still chains.

**Algorithm 2, launch order** (``launch_order``). Ready ops are kept in two lists, memory-bound and
compute-bound; the launcher alternates between them (the other list than the last op's when it is
non-empty, starting with the compute list), each time taking the op of least resource demand (ties:
the earlier in topological order). The inputs come first and the output last.

**Synchronisation** (``plan_streams``). Ops on one stream run in launch order. A cross-stream edge
``u -> v`` needs ``v`` to wait for an event recorded after ``u``. With ``prune_waits`` (the default) a
wait is left out when the order already implies it: when ``u`` is known complete before ``v`` through
``v``'s stream order or through another of ``v``'s waits (tracked exactly with vector clocks, one
entry per stream). What remains is the unique minimal set: each kept wait is needed by an edge no
other wait covers. Without pruning every cross-stream edge gets its own wait, exactly one.

The contract with a capture (or ``cpu_exec``): capture begins on stream 0 once the inputs are in
place; every other stream first waits on a *fork* event recorded on stream 0 there (not listed in
``waits``); then the ops are issued in ``order``, each on ``stream_of[op]`` after waiting for the
events of ``waits[op]``, and an event is recorded after each op that someone waits for
(``events``). The output op, on stream 0, waits for the last op of every other stream (the *join*),
so capture can end on stream 0 with every stream joined; for a graph without an output op, stream 0
waits for ``join`` at the end.

**A cap** (``max_streams``): the chains of Algorithm 1 are mapped onto at most that many streams, in
launch order: a chain goes to a stream whose last op is an ancestor of the chain's first op (nothing
can overlap there), else to a new stream while the cap allows, else to the stream whose last op was
launched earliest. Two chains on one stream then run one after the other (what the cap asks for),
and the waits are computed on the capped assignment, so the plan stays correct.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from gpuprims.opara.graph import COMPUTE, INPUT, MEMORY, OUTPUT, OpGraph

#: Algorithm 1 variants (module docstring).
RULES = ("first_successor", "first_free")


@dataclass(frozen=True)
class StreamPlan:
    """What a capture or an executor follows (contract in the module docstring).

    ``order``: every op (inputs first, output last), topological. ``stream_of``: stream per op,
    0 the origin. ``waits``: per op, the ops on other streams it waits for (empty tuple when none).
    ``join``: ops stream 0 waits for at the end (empty when the graph has an output op).
    ``planning_ms``: wall time of the whole planning (Algorithm 2, Algorithm 1, cap, waits);
    ``allocation_ms``: Algorithm 1 alone (what the paper's Table I times). ``chains``: the stream count
    of Algorithm 1 before any cap.
    """

    order: tuple[str, ...]
    stream_of: Mapping[str, int]
    waits: Mapping[str, tuple[str, ...]]
    num_streams: int
    planning_ms: float
    allocation_ms: float = 0.0
    join: tuple[str, ...] = ()
    chains: int = 0
    max_streams: int | None = None
    rule: str = RULES[0]
    pruned: bool = True
    _events: tuple[str, ...] = field(default=(), repr=False)

    @property
    def events(self) -> tuple[str, ...]:
        """Ops after which an event is recorded (someone on another stream waits for them), in order."""
        return self._events

    @property
    def num_events(self) -> int:
        """Number of events a capture records (one per op in ``events``)."""
        return len(self._events)

    @property
    def num_waits(self) -> int:
        """Number of stream waits a capture issues (data waits and the join; not the forks)."""
        return sum(len(w) for w in self.waits.values()) + len(self.join)

    def stream_ops(self, stream: int) -> tuple[str, ...]:
        """The ops of ``stream`` in the order it runs them."""
        return tuple(n for n in self.order if self.stream_of[n] == stream)

    def describe(self) -> dict[str, Any]:
        """A JSON-ready summary (for status pages and bench results)."""
        return {"ops": len(self.order), "num_streams": self.num_streams, "chains": self.chains,
                "num_events": self.num_events, "num_waits": self.num_waits, "max_streams": self.max_streams,
                "rule": self.rule, "pruned": self.pruned, "planning_ms": self.planning_ms,
                "allocation_ms": self.allocation_ms}


def allocate_streams(graph: OpGraph, *, rule: str = RULES[0]) -> dict[str, int]:
    """Algorithm 1 (module docstring): the stream of every op, streams numbered in creation order."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {list(RULES)}, got {rule!r}")
    first_free = rule == "first_free"
    stream: dict[str, int] = {}
    handed: set[str] = set()  # ops (or "\0input", all inputs share stream 0) whose stream went on already
    inputs = "\0input"
    count = 1  # stream 0 is the origin (the inputs' stream)
    has_inputs = any(op.kind == INPUT for op in graph.ops)
    # "First successor" counts device operators only: a shape read taken first does not end a chain.
    first_device = {n: next((x for x in graph.succs(n) if not graph.op(x).host), None) for n in graph.names}
    for name in graph.topo_order():
        op = graph.op(name)
        if op.kind == INPUT:
            stream[name] = 0
            continue
        if op.kind == OUTPUT:
            stream[name] = 0
            continue
        if op.host:
            # Host-side work (a shape read, integer arithmetic) runs nothing on a device: it rides on its
            # first input's stream without taking it (that stream still goes to a device operator).
            preds = graph.preds(name)
            stream[name] = stream[preds[0]] if preds else 0
            continue
        chosen: int | None = None
        for p in graph.preds(name):
            token = inputs if graph.op(p).kind == INPUT else p
            if token in handed or graph.op(p).host:
                continue  # a host op rides on a stream it does not own: it has none to hand on
            if first_free or first_device[p] == name:
                chosen = stream[p]
                handed.add(token)
                break
        if chosen is None:
            if not graph.preds(name) and not has_inputs and inputs not in handed:
                chosen = 0  # a graph without inputs: its first source starts the origin stream
                handed.add(inputs)
            else:
                chosen = count
                count += 1
        stream[name] = chosen
    return stream


def launch_order(graph: OpGraph, *, demand_us: Mapping[str, float] | None = None) -> tuple[str, ...]:
    """Algorithm 2 (module docstring): the launch order; ``demand_us`` overrides ops' ``demand_us``."""
    topo = graph.topo_order()
    index = {n: i for i, n in enumerate(topo)}
    demand = {n: float(demand_us[n]) if demand_us is not None and n in demand_us else graph.op(n).demand_us
              for n in topo}
    indeg = {n: len(graph.preds(n)) for n in topo}
    lists: dict[str, list[tuple[float, int, str]]] = {MEMORY: [], COMPUTE: []}
    order: list[str] = []
    output: list[str] = []

    def release(n: str) -> None:
        for s in graph.succs(n):
            indeg[s] -= 1
            if indeg[s] == 0:
                if graph.op(s).kind == OUTPUT:
                    output.append(s)
                else:
                    heapq.heappush(lists[graph.op(s).op_class], (demand[s], index[s], s))

    for n in topo:
        op = graph.op(n)
        if op.kind == INPUT:
            order.append(n)
        elif indeg[n] == 0 and op.kind == OUTPUT:
            output.append(n)
        elif indeg[n] == 0:
            heapq.heappush(lists[op.op_class], (demand[n], index[n], n))
    for n in list(order):
        release(n)
    last = MEMORY  # so the first pick is from the compute list
    while lists[MEMORY] or lists[COMPUTE]:
        other = COMPUTE if last == MEMORY else MEMORY
        pick = other if lists[other] else last
        _, _, n = heapq.heappop(lists[pick])
        order.append(n)
        last = pick
        release(n)
    order.extend(output)
    if len(order) != len(topo):  # cannot happen for a validated DAG; guards a broken invariant loudly
        raise RuntimeError(f"launch order covers {len(order)} of {len(topo)} ops")
    return tuple(order)


def _ancestors(graph: OpGraph) -> dict[str, int]:
    """Ancestor sets as bit masks over the topological index."""
    topo = graph.topo_order()
    bit = {n: 1 << i for i, n in enumerate(topo)}
    anc: dict[str, int] = {}
    for n in topo:
        m = 0
        for p in graph.preds(n):
            m |= anc[p] | bit[p]
        anc[n] = m
    return anc


def _cap(graph: OpGraph, order: tuple[str, ...], chain_of: dict[str, int], max_streams: int) -> dict[str, int]:
    """Map Algorithm 1's chains onto at most ``max_streams`` streams (module docstring)."""
    topo_bit = {n: 1 << i for i, n in enumerate(graph.topo_order())}
    anc = _ancestors(graph)
    position = {n: i for i, n in enumerate(order)}
    first: dict[int, str] = {}
    last: dict[int, str] = {}
    for n in order:
        if graph.op(n).kind == OUTPUT:
            continue  # the join: always on stream 0, after everything
        first.setdefault(chain_of[n], n)
        last[chain_of[n]] = n
    physical: dict[int, int] = {0: 0}
    tail: dict[int, str] = {0: last[0]} if 0 in last else {}  # physical stream -> last op assigned so far (by position)
    for chain in sorted(first, key=lambda c: position[first[c]]):
        if chain == 0:
            continue
        head = first[chain]
        free = [s for s, t in tail.items() if position[t] < position[head]]
        safe = [s for s in free if anc[head] & topo_bit[tail[s]]]
        if safe:
            target = min(safe, key=lambda s: (position[tail[s]], s))
        elif len(tail) < max_streams:
            target = len(tail)
        else:
            target = min(tail, key=lambda s: (position[tail[s]], s))
        physical[chain] = target
        if target not in tail or position[last[chain]] > position[tail[target]]:
            tail[target] = last[chain]
    return {n: physical.get(chain_of[n], 0) for n in order}


def _sync(graph: OpGraph, order: tuple[str, ...], stream_of: Mapping[str, int], num_streams: int,
          prune: bool) -> tuple[dict[str, tuple[str, ...]], tuple[str, ...]]:
    """The waits of every op and the final join (module docstring), by vector clocks."""
    seq: dict[str, int] = {}
    counters = [0] * num_streams
    for n in order:
        seq[n] = counters[stream_of[n]]
        counters[stream_of[n]] += 1
    fork = [-1] * num_streams
    inputs = [n for n in order if graph.op(n).kind == INPUT]
    if inputs:
        fork[0] = seq[inputs[-1]]
    clock_end: dict[str, list[int]] = {}
    stream_clock: list[list[int] | None] = [None] * num_streams
    last_of: list[str | None] = [None] * num_streams
    waits: dict[str, tuple[str, ...]] = {}

    def needed(base: list[int], candidates: list[str]) -> list[str]:
        cands = [u for u in dict.fromkeys(candidates) if base[stream_of[u]] < seq[u]]
        if not prune:
            return cands
        return [u for u in cands
                if not any(w != u and clock_end[w][stream_of[u]] >= seq[u] for w in cands)]

    for n in order:
        s = stream_of[n]
        current = stream_clock[s]
        base = list(current) if current is not None else (list(fork) if s != 0 else [-1] * num_streams)
        cross = [p for p in graph.preds(n) if stream_of[p] != s]
        if graph.op(n).kind == OUTPUT:
            cross += [t for k, t in enumerate(last_of) if k != s and t is not None]
        if prune:
            w = needed(base, cross)
        else:
            w = list(dict.fromkeys(p for p in graph.preds(n) if stream_of[p] != s))
            w += [t for t in needed(base, cross) if t not in w]
        for u in w:
            cu = clock_end[u]
            for k in range(num_streams):
                if cu[k] > base[k]:
                    base[k] = cu[k]
        base[s] = seq[n]
        clock_end[n] = base
        stream_clock[s] = base
        last_of[s] = n
        waits[n] = tuple(w)
    join: tuple[str, ...] = ()
    if not any(graph.op(n).kind == OUTPUT for n in order):
        end0 = stream_clock[0] if stream_clock[0] is not None else [-1] * num_streams
        ends = [t for k, t in enumerate(last_of) if k != 0 and t is not None]
        join = tuple(needed(list(end0), ends)) if prune else tuple(
            u for u in ends if end0[stream_of[u]] < seq[u])
    return waits, join


def plan_streams(graph: OpGraph, *, max_streams: int | None = None, prune_waits: bool = True,
                 rule: str = RULES[0], demand_us: Mapping[str, float] | None = None) -> StreamPlan:
    """Plan ``graph`` with Algorithms 2 and 1, an optional cap, and the waits (module docstring).

    Raises ValueError for a ``max_streams`` below 1 or an unknown ``rule``.
    """
    if max_streams is not None and (isinstance(max_streams, bool) or not isinstance(max_streams, int)
                                    or max_streams < 1):
        raise ValueError(f"max_streams must be an integer >= 1 or None, got {max_streams!r}")
    if rule not in RULES:
        raise ValueError(f"rule must be one of {list(RULES)}, got {rule!r}")
    t0 = time.perf_counter_ns()
    order = launch_order(graph, demand_us=demand_us)
    t1 = time.perf_counter_ns()
    chain_of = allocate_streams(graph, rule=rule)
    t2 = time.perf_counter_ns()
    chains = max(chain_of.values()) + 1
    if max_streams is not None and chains > max_streams:
        stream_of = _cap(graph, order, chain_of, max_streams)
    else:
        stream_of = chain_of
    num_streams = max(stream_of.values()) + 1
    waits, join = _sync(graph, order, stream_of, num_streams, prune_waits)
    waited = {u for w in waits.values() for u in w} | set(join)
    events = tuple(n for n in order if n in waited)
    t3 = time.perf_counter_ns()
    return StreamPlan(
        order=order,
        stream_of=MappingProxyType({n: stream_of[n] for n in order}),
        waits=MappingProxyType(waits),
        num_streams=num_streams,
        planning_ms=(t3 - t0) / 1e6,
        allocation_ms=(t2 - t1) / 1e6,
        join=join,
        chains=chains,
        max_streams=max_streams,
        rule=rule,
        pruned=prune_waits,
        _events=events,
    )
