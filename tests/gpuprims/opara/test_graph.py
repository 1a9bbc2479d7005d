from __future__ import annotations

import pytest
import torch
from torch import nn

from gpuprims.opara.graph import COMPUTE, INPUT, MEMORY, OUTPUT, T4, Op, OpGraph, Roofline, op_graph


class Misnamed(nn.Module):
    """Submodules named after what they are not: the graph must go by what each one is."""

    def __init__(self) -> None:
        super().__init__()
        self.relu = nn.Conv2d(16, 32, 3, padding=1)  # a convolution called "relu"
        self.conv = nn.ReLU()  # an activation called "conv"
        self.matmul = nn.BatchNorm2d(32)
        self.add = nn.Linear(32, 10)  # at batch 1, a matrix times a vector

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(self.matmul(self.relu(x)))
        z = torch.cat([y, y], 1)
        return self.add(torch.flatten(z[:, :32].mean((2, 3)), 1))


def test_classes_come_from_what_an_operator_is_and_its_shapes_not_its_name() -> None:
    g = op_graph(Misnamed(), torch.randn(1, 16, 56, 56))
    by_what = {}
    for o in g.ops:
        by_what.setdefault(o.what, o)
    assert by_what["Conv2d"].op_class == COMPUTE  # node "relu"
    assert by_what["ReLU"].op_class == MEMORY  # node "conv"
    assert by_what["BatchNorm2d"].op_class == MEMORY
    assert by_what["Linear"].op_class == MEMORY  # GEMV: 2 FLOPs per weight it reads
    assert by_what["torch.cat"].op_class == MEMORY
    assert by_what["torch.flatten"].bytes == 0.0  # a view moves nothing
    assert g.ops[0].kind == INPUT and g.ops[-1].kind == OUTPUT
    # The same linear layer over a big batch is compute-bound: the class follows the shapes.
    big = op_graph(nn.Sequential(nn.Linear(512, 512)), torch.randn(4096, 512))
    assert next(o for o in big.ops if o.what == "Linear").op_class == COMPUTE


def test_convolution_estimates_follow_the_formula() -> None:
    conv = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1, bias=False))
    g = op_graph(conv, torch.randn(2, 8, 10, 10))
    op = next(o for o in g.ops if o.what == "Conv2d")
    # Traced bare, the module becomes a conv2d call reading its weight: the same estimate.
    bare = op_graph(conv[0], torch.randn(2, 8, 10, 10))
    call = next(o for o in bare.ops if "conv2d" in o.what)
    assert (call.flops, call.bytes, call.op_class) == (op.flops, op.bytes, op.op_class)
    out = 2 * 16 * 10 * 10
    assert op.flops == 2.0 * out * 8 * 9
    assert op.bytes == 4.0 * (2 * 8 * 10 * 10 + out + 16 * 8 * 9)
    assert op.demand_us == pytest.approx(T4.time_us(op.flops, op.bytes))
    assert op.out_shape == (2, 16, 10, 10)
    # A device with a low ridge point calls the same convolution compute-bound, a high one memory-bound.
    assert op_graph(conv, torch.randn(2, 8, 10, 10), device=Roofline(1.0, 1.0)).ops[1].op_class == COMPUTE
    assert op_graph(conv, torch.randn(2, 8, 10, 10), device=Roofline(1e6, 1.0)).ops[1].op_class == MEMORY


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        before = y + 1  # reads y before the in-place write
        z = self.act(y)  # overwrites y
        after = y - 1  # reads the overwritten y
        return before + z + after


def test_in_place_writes_order_the_other_readers_of_their_input() -> None:
    g = op_graph(InPlace(), torch.randn(4))
    act = next(o.name for o in g.ops if o.what == "ReLU")
    before = next(o.name for o in g.ops if o.what.endswith(".add") and o.preds and o.preds[0] == "mul")
    after = next(o.name for o in g.ops if o.what.endswith(".sub"))
    assert before in g.preds(act)
    assert act in g.preds(after)


class ViewWrite(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = x.view(-1)
        other = v * 2
        v.add_(1)
        return other + v


def test_in_place_write_through_a_shared_view_is_refused_with_the_node() -> None:
    with pytest.raises(ValueError, match=r"add_.*writes in place into 'view'"):
        op_graph(ViewWrite(), torch.randn(4))


class Untraceable(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow
            return x
        return -x


def test_bad_models_and_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match=r"torch\.fx cannot trace Untraceable"):
        op_graph(Untraceable(), torch.randn(2))
    with pytest.raises(ValueError, match="takes 1 inputs, got 2"):
        op_graph(nn.ReLU(), (torch.randn(2), torch.randn(2)))


def test_op_graph_validation() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        OpGraph((Op("a"), Op("a")))
    with pytest.raises(ValueError, match="unknown task"):
        OpGraph.from_edges({"a": ["b"]})
    with pytest.raises(ValueError, match="cycle"):
        OpGraph.from_edges({"a": ["b"], "b": ["a"]})
    with pytest.raises(ValueError, match="one output at most"):
        OpGraph((Op("a"), Op("o1", ("a",), kind=OUTPUT), Op("o2", ("a",), kind=OUTPUT)))
    with pytest.raises(ValueError, match="cannot have successors"):
        OpGraph((Op("o", kind=OUTPUT), Op("a", ("o",))))
    with pytest.raises(ValueError, match="op_class"):
        Op("a", op_class="io")
    with pytest.raises(ValueError, match="kind"):
        Op("a", kind="constant")
    with pytest.raises(ValueError, match="demand_us"):
        Op("a", demand_us=float("nan"))
    with pytest.raises(ValueError, match="predecessors"):
        Op("x", ("a",), kind=INPUT)
    with pytest.raises(ValueError, match="peak_gflops"):
        Roofline(0.0, 1.0)
    with pytest.raises(ValueError, match="at least one op"):
        OpGraph(())
    with pytest.raises(KeyError, match="no op 'zz'"):
        OpGraph.from_edges({"a": []}).op("zz")


def test_counts_and_successor_order() -> None:
    g = OpGraph.from_edges({"a": [], "c": ["a"], "b": ["a"]}, op_class={"c": COMPUTE})
    assert g.succs("a") == ("c", "b")  # declaration order: Algorithm 1's "first successor" is c
    assert g.counts() == {MEMORY: 2, COMPUTE: 1, INPUT: 0, "edges": 2}
