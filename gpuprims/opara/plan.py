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

from gpuprims.opara.graph import INPUT, MEMORY, OUTPUT, GraphIndex, OpGraph

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
    ix = graph.indexed
    return dict(zip(ix.topo, _allocate(ix, rule == "first_free"), strict=True))


def _allocate(ix: GraphIndex, first_free: bool) -> list[int]:
    """Algorithm 1 over topological positions: the stream of each position."""
    n = len(ix.topo)
    kind, host, preds = ix.kind, ix.host, ix.preds
    # "First successor" counts device operators only: a shape read taken first does not end a chain.
    first_device = [-1] * n
    for i, succs in enumerate(ix.succs):
        for x in succs:
            if not host[x]:
                first_device[i] = x
                break
    stream = [0] * n
    inputs = n  # one token for all inputs: they share stream 0 and pass it on once
    handed = bytearray(n + 1)  # positions (or the inputs' token) whose stream went on already
    has_inputs = INPUT in kind
    count = 1  # stream 0 is the origin (the inputs' stream)
    for i in range(n):
        k = kind[i]
        if k in (INPUT, OUTPUT):
            continue  # stream 0
        ps = preds[i]
        if host[i]:
            # Host-side work (a shape read, integer arithmetic) runs nothing on a device: it rides on its
            # first input's stream without taking it (that stream still goes to a device operator).
            stream[i] = stream[ps[0]] if ps else 0
            continue
        chosen = -1
        for p in ps:
            if host[p]:
                continue  # a host op rides on a stream it does not own: it has none to hand on
            token = inputs if kind[p] == INPUT else p
            if handed[token]:
                continue
            if first_free or first_device[p] == i:
                chosen = stream[p]
                handed[token] = 1
                break
        if chosen < 0:
            if not ps and not has_inputs and not handed[inputs]:
                chosen = 0  # a graph without inputs: its first source starts the origin stream
                handed[inputs] = 1
            else:
                chosen = count
                count += 1
        stream[i] = chosen
    return stream


def launch_order(graph: OpGraph, *, demand_us: Mapping[str, float] | None = None) -> tuple[str, ...]:
    """Algorithm 2 (module docstring): the launch order; ``demand_us`` overrides ops' ``demand_us``."""
    ix = graph.indexed
    return tuple(ix.topo[i] for i in _launch(ix, _demand(ix, demand_us)))


def _demand(ix: GraphIndex, demand_us: Mapping[str, float] | None) -> list[float]:
    demand = list(ix.demand_us)
    if demand_us is not None:
        for name, v in demand_us.items():
            i = ix.pos.get(name)
            if i is not None:
                demand[i] = float(v)
    return demand


def _launch(ix: GraphIndex, demand: list[float]) -> list[int]:
    """Algorithm 2 over topological positions (ties: the earlier position)."""
    n = len(ix.topo)
    kind, succs = ix.kind, ix.succs
    is_mem = [c == MEMORY for c in ix.op_class]
    is_out = [k == OUTPUT for k in kind]
    indeg = [len(p) for p in ix.preds]
    mem: list[tuple[float, int]] = []
    comp: list[tuple[float, int]] = []
    order: list[int] = []
    output: list[int] = []
    push, pop = heapq.heappush, heapq.heappop

    def release(i: int) -> None:
        for x in succs[i]:
            indeg[x] -= 1
            if indeg[x] == 0:
                if is_out[x]:
                    output.append(x)
                else:
                    push(mem if is_mem[x] else comp, (demand[x], x))

    for i in range(n):
        if kind[i] == INPUT:
            order.append(i)
        elif indeg[i] == 0:
            if is_out[i]:
                output.append(i)
            else:
                push(mem if is_mem[i] else comp, (demand[i], i))
    for i in list(order):
        release(i)
    last_mem = True  # so the first pick is from the compute list
    while mem or comp:
        # The other list than the last pick's when it has ops, else the same one.
        lst = (comp or mem) if last_mem else (mem or comp)
        last_mem = lst is mem
        i = pop(lst)[1]
        order.append(i)
        release(i)
    order.extend(output)
    if len(order) != n:  # cannot happen for a validated DAG; guards a broken invariant loudly
        raise RuntimeError(f"launch order covers {len(order)} of {n} ops")
    return order


def _cap(ix: GraphIndex, order: list[int], chain_of: list[int], max_streams: int) -> list[int]:
    """Map Algorithm 1's chains onto at most ``max_streams`` streams (module docstring)."""
    n = len(ix.topo)
    anc = [0] * n  # ancestor sets as bit masks over the topological position
    for i in range(n):
        m = 0
        for p in ix.preds[i]:
            m |= anc[p] | (1 << p)
        anc[i] = m
    position = [0] * n
    for k, i in enumerate(order):
        position[i] = k
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i in order:
        if ix.kind[i] == OUTPUT:
            continue  # the join: always on stream 0, after everything
        first.setdefault(chain_of[i], i)
        last[chain_of[i]] = i
    physical: dict[int, int] = {0: 0}
    tail: dict[int, int] = {0: last[0]} if 0 in last else {}  # physical stream -> last op assigned so far
    for chain in sorted(first, key=lambda c: position[first[c]]):
        if chain == 0:
            continue
        head = first[chain]
        free = [s for s, t in tail.items() if position[t] < position[head]]
        safe = [s for s in free if anc[head] >> tail[s] & 1]
        if safe:
            target = min(safe, key=lambda s: (position[tail[s]], s))
        elif len(tail) < max_streams:
            target = len(tail)
        else:
            target = min(tail, key=lambda s: (position[tail[s]], s))
        physical[chain] = target
        if target not in tail or position[last[chain]] > position[tail[target]]:
            tail[target] = last[chain]
    return [physical.get(c, 0) for c in chain_of]


def _sync(ix: GraphIndex, order: list[int], stream_of: list[int], num_streams: int,
          prune: bool) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """The waits of every position and the final join (module docstring), by vector clocks.

    The clock of op ``i`` is ``vec_of[i]`` with its own stream's entry replaced by ``seq[i]``: an op
    without waits shares its stream's vector (its own entry is the only one that moves), and a new
    vector is made only where waits merge clocks. An own-stream entry of a vector may be stale (lower
    than the truth), never higher, so reading it through ``seq`` keeps every comparison exact.
    """
    n = len(ix.topo)
    kind, preds = ix.kind, ix.preds
    seq = [0] * n
    counters = [0] * num_streams
    for i in order:
        s = stream_of[i]
        seq[i] = counters[s]
        counters[s] += 1
    fork = [-1] * num_streams
    inputs = [i for i in order if kind[i] == INPUT]
    if inputs:
        fork[0] = seq[inputs[-1]]
    origin = [-1] * num_streams
    vec_of: list[list[int]] = [origin] * n  # every entry is set before it is read
    stream_vec: list[list[int]] = [origin, *([fork] * (num_streams - 1))]
    last_of = [-1] * num_streams
    waits: list[tuple[int, ...]] = [()] * n

    def done_by(w: int, u: int) -> bool:
        """Whether op ``w``'s clock covers op ``u`` (``u`` is complete once ``w`` is)."""
        su = stream_of[u]
        return (seq[w] if stream_of[w] == su else vec_of[w][su]) >= seq[u]

    def needed(base: list[int], candidates: list[int]) -> list[int]:
        cands = [u for u in dict.fromkeys(candidates) if base[stream_of[u]] < seq[u]]
        if not prune or len(cands) < 2:
            return cands
        return [u for u in cands if not any(w != u and done_by(w, u) for w in cands)]

    for i in order:
        s = stream_of[i]
        base = stream_vec[s]
        cross = [p for p in preds[i] if stream_of[p] != s]
        if kind[i] == OUTPUT:
            cross += [t for k, t in enumerate(last_of) if k != s and t >= 0]
        if prune:
            w = needed(base, cross) if cross else cross
        else:
            w = list(dict.fromkeys(p for p in preds[i] if stream_of[p] != s))
            w += [t for t in needed(base, cross) if t not in w]
        if w:
            for u in w:
                base = list(map(max, base, vec_of[u]))
                su = stream_of[u]
                if seq[u] > base[su]:
                    base[su] = seq[u]
            stream_vec[s] = base
            waits[i] = tuple(w)
        vec_of[i] = base
        last_of[s] = i
    join: tuple[int, ...] = ()
    if OUTPUT not in kind:
        end0 = stream_vec[0]
        ends = [t for k, t in enumerate(last_of) if k != 0 and t >= 0]
        join = tuple(needed(end0, ends)) if prune else tuple(
            u for u in ends if end0[stream_of[u]] < seq[u])
    return waits, join


def plan_streams(graph: OpGraph, *, max_streams: int | None = None, prune_waits: bool = True,
                 rule: str = RULES[0], demand_us: Mapping[str, float] | None = None) -> StreamPlan:
    """Plan ``graph`` with Algorithms 2 and 1, an optional cap, and the waits (module docstring).

    ``planning_ms`` times everything from here to the plan's fields (by name); ``allocation_ms``
    Algorithm 1 alone. The graph's integer structure (``OpGraph.indexed``) is made with the graph.
    Raises ValueError for a ``max_streams`` below 1 or an unknown ``rule``.
    """
    if max_streams is not None and (isinstance(max_streams, bool) or not isinstance(max_streams, int)
                                    or max_streams < 1):
        raise ValueError(f"max_streams must be an integer >= 1 or None, got {max_streams!r}")
    if rule not in RULES:
        raise ValueError(f"rule must be one of {list(RULES)}, got {rule!r}")
    ix = graph.indexed
    t0 = time.perf_counter_ns()
    order = _launch(ix, _demand(ix, demand_us))
    t1 = time.perf_counter_ns()
    chain_of = _allocate(ix, rule == "first_free")
    t2 = time.perf_counter_ns()
    chains = max(chain_of) + 1
    if max_streams is not None and chains > max_streams:
        stream_of = _cap(ix, order, chain_of, max_streams)
    else:
        stream_of = chain_of
    num_streams = max(stream_of) + 1
    waits, join = _sync(ix, order, stream_of, num_streams, prune_waits)
    waited = bytearray(len(order))
    for w in waits:
        for u in w:
            waited[u] = 1
    for u in join:
        waited[u] = 1
    topo = ix.topo
    names = tuple(topo[i] for i in order)
    events = tuple(topo[i] for i in order if waited[i])
    plan_waits = {topo[i]: tuple(topo[u] for u in waits[i]) for i in order}
    plan_streams_of = {topo[i]: stream_of[i] for i in order}
    t3 = time.perf_counter_ns()
    return StreamPlan(
        order=names,
        stream_of=MappingProxyType(plan_streams_of),
        waits=MappingProxyType(plan_waits),
        num_streams=num_streams,
        planning_ms=(t3 - t0) / 1e6,
        allocation_ms=(t2 - t1) / 1e6,
        join=tuple(topo[u] for u in join),
        chains=chains,
        max_streams=max_streams,
        rule=rule,
        pruned=prune_waits,
        _events=events,
    )
