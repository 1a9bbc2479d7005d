"""Small models for the engine tests (``tests.gpuprims.engines.nets:tiny``): conv, batch norm, ReLU,
pooling and a linear head, like the zoo's nets but built in milliseconds."""

from __future__ import annotations

import torch
from torch import nn

from apps.zoo import build_model


def tiny(num_classes: int = 10, seed: int = 0) -> nn.Module:
    """A conv net on (3, 8, 8) inputs with deterministic weights and non-trivial batch-norm statistics."""
    g = torch.Generator().manual_seed(seed)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        bn = net[1]
        bn.running_mean.copy_(torch.randn(8, generator=g) * 0.1)
        bn.running_var.copy_(torch.rand(8, generator=g) + 0.5)
    return net.eval()


def googlenet_small(num_classes: int = 10, seed: int = 0,
                    input_shape: tuple[int, int, int] = (3, 32, 32)) -> nn.Module:
    """The zoo's GoogLeNet at a quarter of its width on (3, 32, 32): the same branch structure (28
    streams under Opara's Algorithm 1), built in a fraction of a second."""
    return build_model("googlenet", seed=seed, num_classes=num_classes, input_shape=input_shape, width=0.25)


def inception_v3_small(num_classes: int = 10, seed: int = 0,
                       input_shape: tuple[int, int, int] = (3, 75, 75)) -> nn.Module:
    """The zoo's Inception-v3 at an eighth of its width on (3, 75, 75), its smallest input side."""
    return build_model("inception_v3", seed=seed, num_classes=num_classes, input_shape=input_shape, width=0.125)


class _DataDependent(nn.Module):
    """Control flow on a tensor's value: eager runs it, torch.fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        if y.sum() > 0:
            return y.relu().mean(dim=(2, 3))
        return y.mean(dim=(2, 3))


def untraceable(num_classes: int = 10, seed: int = 0) -> nn.Module:
    """A model fx cannot trace (for the engines that plan from the fx graph)."""
    return _DataDependent().eval()
