from __future__ import annotations

import pytest
import torch
from torch import nn

from apps.zoo import build_model
from apps.zoo.names import wide_deep_shape
from gpuprims.coexec.fx_exec import (
    LstmExecutor,
    SubgraphExecutor,
    partition,
    placement_timer,
    profile_subgraphs,
)
from gpuprims.coexec.graph import CPU, GPU
from gpuprims.coexec.oppart import CpuCores, chrion_plan, lstm_graph
from gpuprims.coexec.subgraph import duet

SMALL = {
    "wide_deep": (wide_deep_shape(16), 0.25),
    "siamese": ((2, 8, 16), 0.25),
    "mt_dnn": ((1, 8, 32), 0.25),
    "resnet18": ((3, 32, 32), 0.25),
}


def _model(name: str) -> tuple[nn.Module, torch.Tensor]:
    shape, width = SMALL[name]
    x = torch.randn(2, *shape, generator=torch.Generator().manual_seed(5))
    return build_model(name, input_shape=shape, width=width), x


@pytest.mark.slow
def test_partition_finds_the_papers_branches() -> None:
    got = {}
    for name in ("wide_deep", "siamese", "mt_dnn"):
        part = partition(_model(name)[0])
        got[name] = [[s.name for s in ph] for ph in part.phases()]
    assert got["wide_deep"] == [["flatten"], ["wide", "deep", "rnn", "cnn"], ["merge"]]
    assert got["siamese"] == [["left", "right"], ["merge"]]
    assert got["mt_dnn"] == [["encoder"], [f"heads.{i}" for i in range(10)], ["cat"]]
    part = partition(_model("wide_deep")[0])
    assert part.deps["merge"] == ("wide", "deep", "rnn", "cnn") and part.deps["cnn"] == ("flatten",)


@pytest.mark.parametrize("name", sorted(SMALL))
@pytest.mark.parametrize("split", ["alternate", "all_cpu", "all_gpu"])
def test_any_placement_answers_exactly_as_direct_torch(name: str, split: str) -> None:
    model, x = _model(name)
    part = partition(model)
    place = {s.name: (CPU if (i % 2 if split == "alternate" else split == "all_cpu") else GPU)
             for i, s in enumerate(part.subgraphs)}
    with torch.inference_mode():
        want = model(x)
    with SubgraphExecutor(part, place) as ex:
        got = ex(x)
        again = ex(x)
    # Same kernels on the same inputs: bit-identical on the CPU (a GPU would need a tolerance).
    assert torch.equal(got, want) and torch.equal(again, want)


def test_a_duet_plan_from_measured_profiles_runs_and_answers_exactly() -> None:
    model, x = _model("wide_deep")
    part = partition(model)
    prof = profile_subgraphs(part, [x[:1]], repeats=3, warmup=1)
    assert set(prof) == {s.name for s in part.subgraphs}
    assert all(p["latency_ms"] > 0 for p in prof.values())
    assert prof["flatten"]["out_mb"] > 0  # its row feeds every branch
    # The paper's GPU times where it has them, our CPU times for the CPU (as the scenarios do).
    gpu = {"wide": 0.05, "deep": 0.07, "rnn": 6.4, "cnn": 0.9, "merge": 0.06, "flatten": 0.01}
    graph = part.task_graph({n: {CPU: p["latency_ms"], GPU: gpu[n]} for n, p in prof.items()},
                            out_mb={n: p["out_mb"] for n, p in prof.items()})
    plan = duet(graph)
    with torch.inference_mode():
        want = model(x)
    with SubgraphExecutor(part, plan.placement) as ex:
        assert torch.equal(ex(x), want)


def test_duet_corrects_on_real_runs_with_the_placement_timer() -> None:
    model, x = _model("siamese")
    part = partition(model)
    measure = placement_timer(part, [x[:1]], repeats=2, warmup=0)
    assert measure({"left": GPU, "right": CPU, "merge": CPU}) > 0
    graph = part.task_graph({"left": {CPU: 3.0, GPU: 3.2}, "right": {CPU: 3.0, GPU: 3.2}, "merge": {CPU: 0.1, GPU: 0.1}})
    plan = duet(graph, measure=measure)
    assert set(plan.placement) == {"left", "right", "merge"} and plan.cost > 0
    assert plan.notes["measure_calls"] >= 3  # greedy, at least one swap, and the single-device baselines
    with pytest.raises(ValueError, match="repeats"):
        placement_timer(part, [x], repeats=0)


def test_executor_refuses_bad_placements_and_inputs() -> None:
    model, x = _model("siamese")
    part = partition(model)
    with pytest.raises(ValueError, match="every subgraph"):
        SubgraphExecutor(part, {"left": CPU})
    with pytest.raises(ValueError, match="device"):
        SubgraphExecutor(part, {"left": "tpu", "right": CPU, "merge": CPU})
    with SubgraphExecutor(part, {"left": GPU, "right": CPU, "merge": CPU}) as ex, \
            pytest.raises(ValueError, match="takes 1 inputs"):
        ex(x, x)


def test_an_untraceable_model_is_refused_with_the_reason() -> None:
    class Branchy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x if x.sum() > 0 else -x  # data-dependent control flow

    with pytest.raises(ValueError, match="cannot trace Branchy"):
        partition(Branchy())


def _lstm_plan(cores: int, cpu_ms: float) -> tuple[nn.Module, dict[str, str], list[str]]:
    model = build_model("lstm", input_shape=(1, 5, 16))
    g = lstm_graph(len(model.cells), 5, gpu_cell_ms=1.0, cpu_cell_ms=cpu_ms, out_mb=0.001, weight_mb_per_layer=1.0,
                   head_gpu_ms=0.1, head_cpu_ms=0.1)
    plan = chrion_plan(g, CpuCores(cores))
    return model, plan.placement, plan.notes["order"]


@pytest.mark.parametrize(("cores", "cpu_ms"), [(1, 1.2), (2, 1.2), (2, 50.0)])
def test_chrion_partition_of_the_lstm_answers_exactly_as_direct_torch(cores: int, cpu_ms: float) -> None:
    model, place, order = _lstm_plan(cores, cpu_ms)
    if cpu_ms < 2:
        assert CPU in place.values() and GPU in place.values()  # a real split
    x = torch.randn(3, 1, 5, 16, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want = model(x)
    with LstmExecutor(model, place, order, cpu_workers=cores) as ex:
        assert torch.equal(ex(x), want)


def test_lstm_executor_refuses_bad_plans() -> None:
    model, place, order = _lstm_plan(1, 1.2)
    with pytest.raises(ValueError, match="every cell"):
        LstmExecutor(model, {k: v for k, v in place.items() if k != "head"}, order)
    with pytest.raises(ValueError, match="order"):
        LstmExecutor(model, place, order[:-1])
    with pytest.raises(ValueError, match="cpu_workers"):
        LstmExecutor(model, place, order, cpu_workers=0)


def test_a_failing_cell_raises_instead_of_hanging() -> None:
    model, place, order = _lstm_plan(2, 1.2)
    with LstmExecutor(model, place, order, cpu_workers=2, wait_s=30) as ex, pytest.raises(RuntimeError):
        ex(torch.randn(1, 1, 5, 7))  # wrong feature count: the first cell fails
