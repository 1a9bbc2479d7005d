"""Independent checks of a StreamPlan against its graph, shared by the planner and executor tests."""

from __future__ import annotations

import itertools

from gpuprims.opara.graph import INPUT, OPERATOR, OUTPUT, OpGraph
from gpuprims.opara.plan import StreamPlan

END = "\0end-of-stream-0"


def sync_edges(graph: OpGraph, plan: StreamPlan) -> dict[str, set[str]]:
    """The happens-before graph a capture builds: stream order, fork, waits and the final join."""
    succ: dict[str, set[str]] = {n: set() for n in plan.order}
    succ[END] = set()
    last: dict[int, str] = {}
    inputs = [n for n in plan.order if graph.op(n).kind == INPUT]
    for n in plan.order:
        s = plan.stream_of[n]
        if s in last:
            succ[last[s]].add(n)
        elif s != 0 and inputs:
            succ[inputs[-1]].add(n)  # the fork: recorded on stream 0 once the inputs are in place
        last[s] = n
        for u in plan.waits[n]:
            succ[u].add(n)
    if 0 in last:
        succ[last[0]].add(END)
    for u in plan.join:
        succ[u].add(END)
    return succ


def reach(succ: dict[str, set[str]]) -> dict[str, set[str]]:
    """Everything reachable from each node (the graphs in tests are small)."""
    out: dict[str, set[str]] = {}
    for start in succ:
        seen: set[str] = set()
        stack = list(succ[start])
        while stack:
            n = stack.pop()
            if n not in seen:
                seen.add(n)
                stack.extend(succ[n])
        out[start] = seen
    return out


def required_pairs(graph: OpGraph, plan: StreamPlan) -> list[tuple[str, str]]:
    """(u, v): u must be complete before v starts. Data edges, and every op before the end of capture."""
    pairs = [(u, v) for u, v in graph.edges()]
    has_output = any(graph.op(n).kind == OUTPUT for n in plan.order)
    for n in plan.order:
        if graph.op(n).kind != OUTPUT:
            pairs.append((n, END))
    if has_output:
        out = next(n for n in plan.order if graph.op(n).kind == OUTPUT)
        pairs += [(n, out) for n in plan.order if n != out]
    return pairs


def ancestors(graph: OpGraph) -> dict[str, set[str]]:
    anc: dict[str, set[str]] = {}
    for n in graph.topo_order():
        a: set[str] = set()
        for p in graph.preds(n):
            a |= anc[p] | {p}
        anc[n] = a
    return anc


def check_plan(graph: OpGraph, plan: StreamPlan, *, max_streams: int | None = None) -> None:
    """Every property a plan promises (docs/opara.md); AssertionError naming the first broken one."""
    assert sorted(plan.order) == sorted(graph.names), "order must list every op once"
    seen: set[str] = set()
    for n in plan.order:
        late = [p for p in graph.preds(n) if p not in seen]
        assert not late, f"order not topological: {n} before {late}"
        seen.add(n)
    streams = set(plan.stream_of.values())
    assert streams == set(range(plan.num_streams)), f"streams {sorted(streams)} vs num_streams {plan.num_streams}"
    for n in plan.order:
        if graph.op(n).kind in (INPUT, OUTPUT):
            assert plan.stream_of[n] == 0, f"{n} must be on the origin stream"
    if max_streams is not None:
        assert plan.num_streams <= max_streams
    for n in plan.order:
        w = plan.waits[n]
        assert len(w) == len(set(w)), f"duplicate waits at {n}: {w}"
        for u in w:
            assert plan.stream_of[u] != plan.stream_of[n], f"{n} waits for {u} on its own stream"
            if graph.op(n).kind != OUTPUT:
                assert u in graph.preds(n), f"{n} waits for {u}, not an input of it"
    # Coverage: every required pair is ordered by the happens-before graph.
    succ = sync_edges(graph, plan)
    r = reach(succ)
    pairs = required_pairs(graph, plan)
    for u, v in pairs:
        assert v in r[u], f"{u} -> {v} is not ordered by the plan"
    waited = {u for w in plan.waits.values() for u in w} | set(plan.join)
    assert set(plan.events) == waited and len(plan.events) == len(waited)
    if plan.pruned:
        # Minimal: dropping any single wait leaves some required pair unordered.
        for n in plan.order:
            for u in plan.waits[n]:
                succ[u].discard(n)
                try:
                    r2 = reach(succ)
                    assert any(v not in r2[a] for a, v in pairs), f"wait {n} <- {u} is redundant"
                finally:
                    succ[u].add(n)
    else:
        for n in plan.order:
            if graph.op(n).kind == OPERATOR:
                cross = {p for p in graph.preds(n) if plan.stream_of[p] != plan.stream_of[n]}
                assert set(plan.waits[n]) == cross, f"{n}: waits {plan.waits[n]} vs cross-stream inputs {cross}"
    # Deadlock freedom: streams advancing independently always finish.
    done: set[str] = set()
    queues = {s: list(plan.stream_ops(s)) for s in streams}
    inputs = [n for n in plan.order if graph.op(n).kind == INPUT]
    for _ in range(len(plan.order) + 1):
        moved = False
        for s, q in queues.items():
            while q and all(u in done for u in plan.waits[q[0]]) and (s == 0 or all(i in done for i in inputs)):
                done.add(q.pop(0))
                moved = True
        if not moved:
            break
    assert len(done) == len(plan.order), f"deadlock: {sorted(set(plan.order) - done)} never run"


def check_chains(graph: OpGraph, plan: StreamPlan) -> None:
    """Uncapped: two device operators on one stream are always ordered by the graph (a chain)."""
    anc = ancestors(graph)
    for s in range(plan.num_streams):
        ops = [n for n in plan.stream_ops(s) if graph.op(n).kind == OPERATOR and not graph.op(n).host]
        for a, b in itertools.pairwise(ops):
            assert a in anc[b], f"stream {s}: {a} and {b} can run at the same time"
