from __future__ import annotations

import pickle
import threading

import pytest
import torch
from torch import nn

from apps.zoo import build_model
from gpuprims.opara.cpu_exec import ExecutorTimeout, OperatorError, StreamExecutor
from gpuprims.opara.graph import OpGraph, op_graph
from gpuprims.opara.plan import plan_streams

SMALL = {"googlenet": ((3, 32, 32), 0.25), "inception_v3": ((3, 75, 75), 0.125), "bert": ((1, 8, 48), 1.0)}


@pytest.fixture(scope="module")
def models() -> dict[str, nn.Module]:
    return {name: build_model(name, input_shape=shape, width=width) for name, (shape, width) in SMALL.items()}


@pytest.mark.parametrize("name", sorted(SMALL))
@pytest.mark.parametrize("batch", [1, 8])
def test_output_is_bit_identical_to_eager(models: dict[str, nn.Module], name: str, batch: int) -> None:
    model = models[name]
    x = torch.randn(batch, *SMALL[name][0], generator=torch.Generator().manual_seed(batch))
    graph = op_graph(model, x)
    with torch.inference_mode():
        want = model(x)
    for cap in (None, 2):
        plan = plan_streams(graph, max_streams=cap)
        with StreamExecutor(graph, plan) as ex:
            assert torch.equal(ex(x), want)
            assert torch.equal(ex(x), want)  # a second run on the same threads


def test_one_intra_op_thread_per_stream_is_equal_within_rounding(models: dict[str, nn.Module]) -> None:
    model = models["googlenet"]
    x = torch.randn(8, *SMALL["googlenet"][0], generator=torch.Generator().manual_seed(3))
    graph = op_graph(model, x)
    threads = torch.get_num_threads()
    with StreamExecutor(graph, plan_streams(graph), intra_op_threads=1) as ex:
        got = ex(x)
    assert torch.get_num_threads() == threads  # the caller's count is put back
    with torch.inference_mode():
        torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-4)


def test_executors_with_other_thread_counts_side_by_side_keep_their_own(models: dict[str, nn.Module]) -> None:
    # The second executor's workers change torch's process-wide default while the first's start: the
    # first must still run every operator with its own count (so it stays bit-identical).
    model = models["inception_v3"]
    x = torch.randn(1, *SMALL["inception_v3"][0], generator=torch.Generator().manual_seed(5))
    graph = op_graph(model, x)
    with torch.inference_mode():
        want = model(x)
    with StreamExecutor(graph, plan_streams(graph)) as same, \
            StreamExecutor(graph, plan_streams(graph, max_streams=2), intra_op_threads=1) as one:
        one(x)
        assert torch.equal(same(x), want)


class Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.a(x), self.b(x), self.c(x)], 1)


def _branches() -> tuple[nn.Module, OpGraph]:
    model = Branches().eval()
    return model, op_graph(model, torch.randn(2, 4))


def _stream_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("opara-stream-")]


def test_an_operator_error_propagates_with_its_node_and_the_executor_goes_on() -> None:
    model, graph = _branches()
    plan = plan_streams(graph)
    assert plan.stream_of["b"] != plan.stream_of["cat"]

    def boom(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("bad weights")

    with StreamExecutor(graph, plan, timeout_s=30.0) as ex:
        graph.module.b.forward = boom
        with pytest.raises(OperatorError, match=r"op 'b' \(Linear\) on stream \d+ raised ValueError: bad weights") as info:
            ex(torch.randn(2, 4))
        assert isinstance(info.value.__cause__, ValueError)
        assert info.value.node == "b" and info.value.stream == plan.stream_of["b"]
        assert pickle.loads(pickle.dumps(info.value)).node == "b"
        del graph.module.b.forward  # healed: the next run answers
        x = torch.randn(2, 4)
        with torch.inference_mode():
            assert torch.equal(ex(x), model(x))


@pytest.mark.slow
def test_a_stuck_operator_times_out_instead_of_hanging_and_the_executor_refuses_more() -> None:
    _, graph = _branches()
    release = threading.Event()

    def stuck(x: torch.Tensor) -> torch.Tensor:
        release.wait(timeout=60)
        return x

    ex = StreamExecutor(graph, plan_streams(graph), timeout_s=0.3)
    try:
        graph.module.c.forward = stuck
        with pytest.raises(ExecutorTimeout, match=r"timeout_s=0\.3.*'c'"):
            ex(torch.randn(2, 4))
        with pytest.raises(RuntimeError, match="unusable after an earlier timeout"):
            ex(torch.randn(2, 4))
    finally:
        release.set()
        ex.close()
    for t in _stream_threads():
        t.join(timeout=30)
    assert not _stream_threads()


def test_close_stops_every_thread_and_refuses_later_runs() -> None:
    _, graph = _branches()
    plan = plan_streams(graph)
    before = len(_stream_threads())
    ex = StreamExecutor(graph, plan)
    assert len(_stream_threads()) == before + plan.num_streams
    ex.close()
    ex.close()  # idempotent
    assert len(_stream_threads()) == before
    with pytest.raises(RuntimeError, match="closed"):
        ex(torch.randn(2, 4))


def test_bad_arguments_are_refused() -> None:
    _, graph = _branches()
    plan = plan_streams(graph)
    with pytest.raises(ValueError, match="no traced module"):
        StreamExecutor(OpGraph.from_edges({"a": []}), plan_streams(OpGraph.from_edges({"a": []})))
    other = OpGraph.from_edges({"a": []})
    with pytest.raises(ValueError, match="plan does not match the graph"):
        StreamExecutor(graph, plan_streams(other))
    for bad in (0, -1.0, float("inf"), "1"):
        with pytest.raises(ValueError, match="timeout_s"):
            StreamExecutor(graph, plan, timeout_s=bad)  # type: ignore[arg-type]
    for bad_threads in (0, True, 1.5):
        with pytest.raises(ValueError, match="intra_op_threads"):
            StreamExecutor(graph, plan, intra_op_threads=bad_threads)  # type: ignore[arg-type]
    with StreamExecutor(graph, plan) as ex, pytest.raises(ValueError, match="takes 1 inputs, got 2"):
        ex(torch.randn(2, 4), torch.randn(2, 4))
