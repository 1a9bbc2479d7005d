"""Small models for the engine tests (``tests.gpuprims.engines.nets:tiny``): conv, batch norm, ReLU,
pooling and a linear head, like the zoo's nets but built in milliseconds."""

from __future__ import annotations

import torch
from torch import nn


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
