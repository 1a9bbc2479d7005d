"""Deterministic, download-free weights for the zoo's networks.

`init_weights(model, key)` overwrites every parameter and buffer of `model` with values drawn from a
private `torch.Generator` seeded from `key` (a string such as ``"resnet50:seed=0"``). It draws on the
CPU, module by module in registration order, so the same architecture and key give bit-identical
tensors in any process, with any thread count, whatever the global RNG state; the global RNG is never
touched. Different keys give different weights.

The distributions stand in for training: every layer's output keeps about unit variance and zero mean
in inference mode (`.eval()`), so outputs depend on the input (different inputs land in different
classes; the DNN-Recog router sends some to "person" and some to "vehicle") and neither vanish nor
overflow, at 224x224 as at 32x32:

- Conv2d / Linear weights: normal, std sqrt(gain / fan_in), with every output unit's weights summing to
  zero (`_zero_sum_rows_normal_`); gain 1 where the input is not rectified (the image, a linear
  bottleneck: marked by the architecture), else `RECTIFIED_GAIN`. Biases normal with std 0.01.
- LSTM / LSTMCell: weights uniform in [-b, b] with b = sqrt(48 / (input + hidden)), i.e. gate
  pre-activations of about 4x unit variance (with torch's default, 1/sqrt(hidden), the state of a
  12-layer stack no longer depends on the input); biases uniform in [-1/sqrt(hidden), 1/sqrt(hidden)].
  Parameter by parameter in registration order.
- LayerNorm: weight uniform in [0.9, 1.1], bias normal with std 0.02.
- BatchNorm2d: weight uniform in [0.8, 1.2] (in [0.1, 0.3] for the last norm of a residual branch, so
  the residual stream of a deep network grows slowly), bias normal with std 0.05, running mean normal
  with std 0.05, running variance uniform in [0.8, 1.25], num_batches_tracked 0.

Bit-identical means: on the same torch build and CPU type. The normal draws go through vectorised
log/sin/cos, which may round differently on CPUs with other vector units.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from apps.zoo.nets import LINEAR_INPUT_ATTR, RESIDUAL_BN_ATTR


def generator_for(key: str) -> torch.Generator:
    """Return a CPU generator seeded from the SHA-256 of `key` (stable across processes and Python runs)."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"key must be a non-empty string, got {key!r}")
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return generator


#: 1 / Var(ReLU(z)) for z ~ N(0, 1). A zero-sum unit (see `_zero_sum_rows_normal_`) passes only the
#: variance of its rectified inputs, not their mean, so this gain (not He's 2, which assumes E[x^2])
#: keeps unit output variance layer after layer.
RECTIFIED_GAIN = 1.0 / (0.5 - 1.0 / (2.0 * math.pi))


def _fan_in(weight: torch.Tensor) -> int:
    # Conv weights are (out, in / groups, kh, kw) and Linear (out, in): fan_in is all but dim 0.
    return max(1, math.prod(weight.shape[1:]))


def _zero_sum_rows_normal_(weight: torch.Tensor, std: float, generator: torch.Generator) -> None:
    """Fill `weight` with normal values of std `std` whose every row (one output unit) sums to zero.

    Each row is ``(a - roll(a, s)) / sqrt(2)`` for a normal row `a` and a random shift `s`: elementwise
    operations only (no reduction whose rounding could depend on the thread count or vector width).
    A unit then ignores the mean of its inputs, as a trained one mostly does: without that, the
    rectified (positive) activations of a random network add the same large offset to every input's
    output and all inputs end up in one class.
    """
    rows = weight.view(weight.shape[0], -1)
    width = rows.shape[1]
    if width == 1:
        weight.normal_(0.0, std, generator=generator)
        return
    shift = int(torch.randint(1, width, (1,), generator=generator).item())
    drawn = torch.empty_like(rows).normal_(0.0, std, generator=generator)
    torch.sub(drawn, torch.roll(drawn, shift, dims=1), out=rows)
    rows.mul_(1.0 / math.sqrt(2.0))


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
            gain = 1.0 if getattr(module, LINEAR_INPUT_ATTR, False) else RECTIFIED_GAIN
            _zero_sum_rows_normal_(module.weight, math.sqrt(gain / _fan_in(module.weight)), generator)
            done.add(id(module.weight))
            if module.bias is not None:
                module.bias.normal_(0.0, 0.01, generator=generator)
                done.add(id(module.bias))
        elif isinstance(module, (nn.LSTM, nn.LSTMCell)):
            bias_bound = 1.0 / math.sqrt(module.hidden_size)
            for pname, tensor in module.named_parameters(recurse=False):
                if pname.startswith("weight"):
                    bound = math.sqrt(48.0 / (tensor.shape[1] + module.hidden_size))
                else:
                    bound = bias_bound
                tensor.uniform_(-bound, bound, generator=generator)
                done.add(id(tensor))
        elif isinstance(module, nn.LayerNorm):
            if module.weight is None or module.bias is None:
                raise ValueError(f"LayerNorm {name!r} needs elementwise_affine=True and bias=True")
            module.weight.uniform_(0.9, 1.1, generator=generator)
            module.bias.normal_(0.0, 0.02, generator=generator)
            done.update((id(module.weight), id(module.bias)))
        elif isinstance(module, nn.BatchNorm2d):
            low, high = (0.1, 0.3) if getattr(module, RESIDUAL_BN_ATTR, False) else (0.8, 1.2)
            tensors: list[torch.Tensor | None] = [
                module.weight, module.bias, module.running_mean, module.running_var,
            ]  # fmt: skip
            if any(t is None for t in tensors):
                raise ValueError(f"BatchNorm2d {name!r} needs affine=True and track_running_stats=True")
            module.weight.uniform_(low, high, generator=generator)
            module.bias.normal_(0.0, 0.05, generator=generator)
            module.running_mean.normal_(0.0, 0.05, generator=generator)  # type: ignore[union-attr]
            module.running_var.uniform_(0.8, 1.25, generator=generator)  # type: ignore[union-attr]
            done.update(id(t) for t in tensors)
            if module.num_batches_tracked is not None:
                module.num_batches_tracked.zero_()
                done.add(id(module.num_batches_tracked))
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            if id(tensor) not in done:
                raise ValueError(f"init_weights does not know how to initialise {kind} {name!r}")
