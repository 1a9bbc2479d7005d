from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from apps.zoo import build_model
from gpuprims.opara.graph import COMPUTE, INPUT, MEMORY, OPERATOR, OUTPUT, Op, OpGraph, op_graph
from gpuprims.opara.plan import RULES, allocate_streams, launch_order, plan_streams
from tests.gpuprims.opara._checks import check_chains, check_plan


def _block() -> OpGraph:
    """One GoogLeNet Inception block as a graph: x -> 4 branches -> cat -> output."""
    return OpGraph((
        Op("x", kind=INPUT),
        Op("b1", ("x",), op_class=COMPUTE, demand_us=4.0),
        Op("b2a", ("x",), op_class=MEMORY, demand_us=1.0),
        Op("b2b", ("b2a",), op_class=COMPUTE, demand_us=6.0),
        Op("b3a", ("x",), op_class=MEMORY, demand_us=0.5),
        Op("b3b", ("b3a",), op_class=COMPUTE, demand_us=2.0),
        Op("pool", ("x",), op_class=MEMORY, demand_us=3.0),
        Op("b4", ("pool",), op_class=MEMORY, demand_us=1.5),
        Op("cat", ("b1", "b2b", "b3b", "b4"), op_class=MEMORY, demand_us=2.5),
        Op("out", ("cat",), kind=OUTPUT),
    ))


def test_algorithm_1_on_an_inception_block_worked_by_hand() -> None:
    # x's first successor b1 continues stream 0; b2a, b3a, pool start streams 1-3; each second op is
    # its predecessor's first successor; cat is b1's first successor (stream 0), the output joins on 0.
    g = _block()
    assert allocate_streams(g) == {"x": 0, "b1": 0, "b2a": 1, "b2b": 1, "b3a": 2, "b3b": 2, "pool": 3, "b4": 3,
                                   "cat": 0, "out": 0}
    plan = plan_streams(g)
    assert plan.num_streams == 4
    # The branches need no wait for x: the fork (recorded once the input is in place) covers it.
    assert {n: w for n, w in plan.waits.items() if w} == {"cat": ("b2b", "b3b", "b4")}
    assert plan.events == tuple(n for n in plan.order if n in {"b2b", "b3b", "b4"})
    assert plan.num_events == 3 and plan.num_waits == 3 and plan.join == ()
    check_plan(g, plan)
    check_chains(g, plan)


def test_algorithm_2_on_an_inception_block_worked_by_hand() -> None:
    # Ready after x: compute {b1: 4}, memory {b2a: 1, b3a: 0.5, pool: 3}. Start with the compute list:
    # b1; memory: b3a (0.5) releases b3b (compute 2); compute: b3b; memory: b2a (1) releases b2b (6);
    # compute: b2b; memory: pool releases b4; compute list empty: memory b4; then cat; the output last.
    assert launch_order(_block()) == ("x", "b1", "b3a", "b3b", "b2a", "b2b", "pool", "b4", "cat", "out")


def test_algorithm_2_takes_demands_from_a_profile_when_given() -> None:
    order = launch_order(_block(), demand_us={"b1": 100.0, "pool": 0.1})
    assert order[:3] == ("x", "b1", "pool")  # b1 is the only compute op ready; pool is now the smallest


def test_the_two_rules_differ_where_a_first_successor_went_elsewhere() -> None:
    # m reads z first and is z's first successor: it continues z's stream, so a's stream is not handed on.
    # The paper's rule gives n (a's second successor) a new stream; the public implementation's lets n
    # continue a's stream, since nobody took it.
    g = OpGraph.from_edges({"z": [], "a": [], "m": ["z", "a"], "n": ["a"]})
    assert allocate_streams(g, rule="first_successor") == {"z": 0, "a": 1, "m": 0, "n": 2}
    assert allocate_streams(g, rule="first_free") == {"z": 0, "a": 1, "m": 0, "n": 1}
    for rule in RULES:
        plan = plan_streams(g, rule=rule)
        check_plan(g, plan)
        check_chains(g, plan)
        assert plan.join  # no output op: stream 0 joins the others at the end


def test_a_wait_implied_by_stream_order_is_dropped() -> None:
    # a -> b on stream 1; c (stream 0) reads a and b: waiting for b implies a (same stream, earlier).
    g = OpGraph.from_edges({"r": [], "q": ["r"], "a": ["r"], "b": ["a"], "c": ["q", "a", "b"]})
    assert allocate_streams(g) == {"r": 0, "q": 0, "a": 1, "b": 1, "c": 0}
    assert plan_streams(g).waits["c"] == ("b",)
    assert plan_streams(g, prune_waits=False).waits["c"] == ("a", "b")
    for prune in (True, False):
        check_plan(g, plan_streams(g, prune_waits=prune))


def test_a_wait_implied_through_another_stream_is_dropped() -> None:
    # u on stream 1, v on stream 2 waits for u; w on stream 0 reads u and v: waiting for v implies u.
    g = OpGraph.from_edges({"r": [], "q": ["r"], "u": ["r"], "u2": ["u"], "v": ["u"], "w": ["q", "u", "v"]})
    plan = plan_streams(g)
    assert plan.stream_of["u"] == 1 and plan.stream_of["v"] == 2 and plan.stream_of["w"] == 0
    assert plan.waits["v"] == ("u",)
    assert plan.waits["w"] == ("v",)
    assert plan_streams(g, prune_waits=False).waits["w"] == ("u", "v")
    check_plan(g, plan)


def test_host_side_operators_start_no_stream_and_do_not_end_a_chain() -> None:
    # x.shape read first, then the device operators: the paper's rule would give q a new stream if the
    # shape read counted as x's first successor; host ops ride on their input's stream instead.
    g = OpGraph((
        Op("x", kind=INPUT),
        Op("shape", ("x",), host=True),
        Op("n", ("shape",), host=True),
        Op("q", ("x",)),
        Op("k", ("x",)),
        Op("view", ("q", "n")),
        Op("cat", ("view", "k")),
        Op("out", ("cat",), kind=OUTPUT),
    ))
    streams = allocate_streams(g)
    assert streams == {"x": 0, "shape": 0, "n": 0, "q": 0, "k": 1, "view": 0, "cat": 0, "out": 0}
    plan = plan_streams(g)
    assert plan.num_streams == 2
    check_plan(g, plan)
    check_chains(g, plan)
    with pytest.raises(ValueError, match="only an operator can be host-side"):
        Op("y", kind=INPUT, host=True)


class ShapeReads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(8, 8)
        self.k = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, s, d = x.shape
        return (self.q(x).view(n, s, 2, d // 2) + self.k(x).view(n, s, 2, d // 2)).flatten(2)


def test_shape_reads_of_a_traced_model_are_host_side() -> None:
    g = op_graph(ShapeReads(), torch.randn(2, 3, 8))
    host = {o.name for o in g.ops if o.host}
    assert host and all(o.out_shape is None for o in g.ops if o.name in host)
    assert not any(o.host for o in g.ops if o.what in ("Linear", "method:view"))
    plan = plan_streams(g)
    assert plan.num_streams == 2  # q continues x's stream, k gets the second; the shape reads none
    check_plan(g, plan)


def test_cap_folds_streams_and_stays_correct() -> None:
    g = _block()
    for cap in (1, 2, 3):
        plan = plan_streams(g, max_streams=cap)
        assert plan.num_streams == cap and plan.chains == 4 and plan.max_streams == cap
        check_plan(g, plan, max_streams=cap)
    single = plan_streams(g, max_streams=1)
    assert single.num_waits == 0 and single.num_events == 0  # one stream: its order is enough


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_bad_cap_and_rule_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="max_streams"):
        plan_streams(_block(), max_streams=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rule"):
        plan_streams(_block(), rule="nimble")
    with pytest.raises(ValueError, match="rule"):
        allocate_streams(_block(), rule="")


@pytest.mark.slow
@pytest.mark.parametrize(("name", "shape", "streams", "events"), [
    # The paper: 28 streams for GoogLeNet (1 + 3 new per Inception block x 9); one event per block
    # input and per branch end beside the first.
    ("googlenet", (3, 32, 32), 28, 36),
    # Inception-v3: 3 per A (x3), 2 for B, 3 per C (x4), 2 for D, 5 per E (x2: two inner forks), + 1.
    ("inception_v3", (3, 75, 75), 36, 50),
    # BERT: the key and value projections of each of the 12 layers start streams (query continues x's),
    # + 1; events: each layer's input (read on 3 streams) and the ends of key and value.
    ("bert", (1, 8, 48), 25, 36),
])
def test_zoo_models_get_the_hand_counted_streams(name: str, shape: tuple[int, int, int], streams: int,
                                                 events: int) -> None:
    model = build_model(name, input_shape=shape, width=0.125 if name != "bert" else 1.0)
    g = op_graph(model, torch.randn(1, *shape))
    for rule in RULES:
        plan = plan_streams(g, rule=rule)
        assert plan.num_streams == plan.chains == streams
        assert plan.num_events == events
        check_chains(g, plan)
    capped = plan_streams(g, max_streams=4)
    # BERT's widest point is three projections: folding finds a safe stream before it needs a fourth.
    assert capped.num_streams == (3 if name == "bert" else 4)
    check_plan(g, capped, max_streams=4)


@st.composite
def dags(draw: st.DrawFn) -> OpGraph:
    n = draw(st.integers(1, 18))
    with_input = draw(st.booleans())
    with_output = draw(st.booleans())
    ops: list[Op] = []
    names: list[str] = []
    if with_input:
        ops.append(Op("in0", kind=INPUT))
        names.append("in0")
    for i in range(n):
        preds = draw(st.lists(st.sampled_from(names), max_size=3, unique=True)) if names else []
        ops.append(Op(f"o{i}", tuple(preds), OPERATOR, op_class=draw(st.sampled_from([MEMORY, COMPUTE])),
                      demand_us=draw(st.floats(0, 10, allow_nan=False)), host=draw(st.booleans())))
        names.append(f"o{i}")
    if with_output:
        sinks = [o.name for o in ops if o.kind == OPERATOR and all(o.name not in p.preds for p in ops)]
        ops.append(Op("out", tuple(sinks[:3]), kind=OUTPUT))
    return OpGraph(tuple(ops))


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(graph=dags(), rule=st.sampled_from(RULES), prune=st.booleans(),
       cap=st.one_of(st.none(), st.integers(1, 4)))
def test_plans_of_random_dags_keep_every_promise(graph: OpGraph, rule: str, prune: bool, cap: int | None) -> None:
    plan = plan_streams(graph, rule=rule, prune_waits=prune, max_streams=cap)
    check_plan(graph, plan, max_streams=cap)
    if cap is None:
        check_chains(graph, plan)
        assert plan.num_streams == plan.chains
