"""Deterministic, download-free weights for the zoo's networks.

`init_weights(model, key)` overwrites every parameter and buffer of `model` with values drawn from a
private `torch.Generator` seeded from `key` (a string such as ``"resnet50:seed=0"``). It draws on the
CPU, module by module in registration order, so the same architecture and key give bit-identical
tensors in any process, with any thread count, whatever the global RNG state; the global RNG is never
touched. Different keys give different weights.

The distributions keep activations at a sensible scale in inference mode (`.eval()`), so outputs differ
between inputs and are neither constant nor overflowing:

- Conv2d / Linear weights: normal with std sqrt(2 / fan_in) (He et al.), biases normal with std 0.01.
- BatchNorm2d: weight uniform in [0.5, 1.0] (in [0.1, 0.3] for the last norm of a residual branch, so
  the residual stream of a deep network grows slowly), bias normal with std 0.05, running mean normal
  with std 0.05, running variance uniform in [0.5, 1.5], num_batches_tracked 0.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from apps.zoo.nets import RESIDUAL_BN_ATTR


def generator_for(key: str) -> torch.Generator:
    """Return a CPU generator seeded from the SHA-256 of `key` (stable across processes and Python runs)."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"key must be a non-empty string, got {key!r}")
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return generator


def _fan_in(weight: torch.Tensor) -> int:
    # Conv weights are (out, in / groups, kh, kw) and Linear (out, in): fan_in is all but dim 0.
    return max(1, math.prod(weight.shape[1:]))


@torch.no_grad()
def init_weights(model: nn.Module, key: str) -> None:
    """Fill every parameter and buffer of `model` (on the CPU) deterministically from `key`.

    Raises ValueError if the model holds a parameter or buffer of a layer type this function does not
    know, rather than leaving it uninitialised, and if a tensor is not on the CPU.
    """
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            if tensor.device.type != "cpu":
                raise ValueError(f"init_weights draws on the CPU; {kind} {name!r} is on {tensor.device}")
    generator = generator_for(key)
    done: set[int] = set()
    for name, module in model.named_modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            module.weight.normal_(0.0, math.sqrt(2.0 / _fan_in(module.weight)), generator=generator)
            done.add(id(module.weight))
            if module.bias is not None:
                module.bias.normal_(0.0, 0.01, generator=generator)
                done.add(id(module.bias))
        elif isinstance(module, nn.BatchNorm2d):
            low, high = (0.1, 0.3) if getattr(module, RESIDUAL_BN_ATTR, False) else (0.5, 1.0)
            tensors: list[torch.Tensor | None] = [
                module.weight, module.bias, module.running_mean, module.running_var,
            ]  # fmt: skip
            if any(t is None for t in tensors):
                raise ValueError(f"BatchNorm2d {name!r} needs affine=True and track_running_stats=True")
            module.weight.uniform_(low, high, generator=generator)
            module.bias.normal_(0.0, 0.05, generator=generator)
            module.running_mean.normal_(0.0, 0.05, generator=generator)  # type: ignore[union-attr]
            module.running_var.uniform_(0.5, 1.5, generator=generator)  # type: ignore[union-attr]
            done.update(id(t) for t in tensors)
            if module.num_batches_tracked is not None:
                module.num_batches_tracked.zero_()
                done.add(id(module.num_batches_tracked))
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            if id(tensor) not in done:
                raise ValueError(f"init_weights does not know how to initialise {kind} {name!r}")
