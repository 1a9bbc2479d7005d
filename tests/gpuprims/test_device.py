from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from apps.zoo import build_model
from gpuprims.batching import LatencyModel
from gpuprims.device import warm_up


class CountingModel(nn.Module):
    """Records the batch shapes it is called with."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(x.shape))
        return x.sum(dim=(1, 2, 3))


def test_warm_up_runs_discard_plus_repeats_per_size_and_returns_positive_medians() -> None:
    model = CountingModel()
    medians = warm_up(model, (3, 4, 4), [4, 1, 4], repeats=3, discard=2)
    assert list(medians) == [1, 4]
    assert all(ms > 0 for ms in medians.values())
    assert model.shapes == [(1, 3, 4, 4)] * 5 + [(4, 3, 4, 4)] * 5
    seeded = LatencyModel(profile=medians)
    assert seeded.predict(4) == max(medians[1], medians[4])  # the profile seeds a non-decreasing curve


def test_warm_up_a_zoo_model() -> None:
    model = build_model("mobilenet_v2", input_shape=(3, 32, 32), width=0.25)
    medians = warm_up(model, (3, 32, 32), [1, 2], repeats=1, discard=0)
    assert set(medians) == {1, 2}


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (("not a model", (3, 4, 4), [1]), {}, "nn.Module"),
        ((None, (3, 4), [1]), {}, "input_shape"),
        ((None, (3, 0, 4), [1]), {}, "input_shape"),
        ((None, (3, 4, 4), []), {}, "non-empty"),
        ((None, (3, 4, 4), 4), {}, "non-empty"),
        ((None, (3, 4, 4), [0]), {}, "batch size"),
        ((None, (3, 4, 4), [1]), {"repeats": 0}, "repeats"),
        ((None, (3, 4, 4), [1]), {"discard": -1}, "discard"),
        ((None, (3, 4, 4), [1]), {"seed": -1}, "seed"),
    ],
)
def test_warm_up_bad_arguments(args: tuple[Any, ...], kwargs: dict[str, Any], match: str) -> None:
    model = CountingModel() if args[0] is None else args[0]
    with pytest.raises(ValueError, match=match):
        warm_up(model, *args[1:], **kwargs)
    if isinstance(model, CountingModel):
        assert model.shapes == []  # nothing ran


@pytest.mark.gpu
def test_warm_up_on_cuda() -> None:
    model = build_model("resnet18", input_shape=(3, 64, 64), width=0.25, device="cuda")
    medians = warm_up(model, (3, 64, 64), [1, 8], "cuda", repeats=3)
    assert set(medians) == {1, 8} and all(ms > 0 for ms in medians.values())
