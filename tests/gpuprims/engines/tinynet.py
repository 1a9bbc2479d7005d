"""A user model small enough that building every engine of it takes a moment (``module:factory`` form):
the zoo's blocks in miniature (conv, batch norm, depthwise conv, residual add, pool, linear)."""

from __future__ import annotations

import torch
from torch import nn

SPEC = "tests.gpuprims.engines.tinynet:build"


class TinyNet(nn.Module):
    def __init__(self, num_classes: int, channels: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(channels, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU6())
        self.dw = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        y = y + self.dw(y)
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


def build(num_classes: int = 10, input_shape: tuple[int, int, int] = (3, 16, 16)) -> nn.Module:
    model = TinyNet(num_classes, input_shape[0])
    with torch.no_grad():  # non-trivial batch-norm statistics, so folding them is exercised
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return model.eval()
