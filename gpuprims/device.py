"""Measuring a model's batch latency on its device, to seed an instance's batch policy at start.

`warm_up` runs the model on deterministic inputs for each batch size, discards the first runs (lazy
initialisation, allocator growth, kernel selection), and reports the median latency of the rest. On a
CUDA device each run ends with a device synchronisation, so a latency is the whole time from launch to
results. Importing this module does not touch the GPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn


def _check_count(label: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{label} must be an integer >= {minimum}, got {value!r}")
    return value


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def warm_up(
    model: nn.Module | Callable[[torch.Tensor], object],
    input_shape: tuple[int, int, int],
    batch_sizes: Sequence[int],
    device: str | torch.device = "cpu",
    *,
    repeats: int = 5,
    discard: int = 2,
    seed: int = 0,
) -> dict[int, float]:
    """Median latency in ms of `model` on a float32 batch of each size in `batch_sizes`.

    The model (a module, or any callable taking a batch, such as a DAG app's stages) must already be
    on `device` and in inference mode. For each batch size it runs `discard`
    untimed passes, then `repeats` timed ones (wall clock, `time.perf_counter_ns`, ending with a device
    synchronisation on CUDA). Inputs are standard normal, drawn on the CPU from `seed` and copied to
    the device before timing. Returns {batch size: median ms}, in ascending batch size order, ready
    for `LatencyModel(profile=...)`.

    Raises ValueError for a model that is not callable, a bad input shape, an empty or
    non-positive batch size list, or bad counts.
    """
    if not callable(model):
        raise ValueError(f"model must be a torch.nn.Module or a callable taking a batch, got {type(model).__name__}")
    if not isinstance(input_shape, (tuple, list)) or len(input_shape) != 3 or any(
        isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in input_shape
    ):
        raise ValueError(f"input_shape must be three positive integers (C, H, W), got {input_shape!r}")
    if not isinstance(batch_sizes, (list, tuple)) or not batch_sizes:
        raise ValueError(f"batch_sizes must be a non-empty list of batch sizes, got {batch_sizes!r}")
    sizes = sorted({_check_count("batch size", size, 1) for size in batch_sizes})
    _check_count("repeats", repeats, 1)
    _check_count("discard", discard, 0)
    _check_count("seed", seed, 0)
    target = torch.device(device)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    medians: dict[int, float] = {}
    for size in sizes:
        batch = torch.randn(size, *input_shape, generator=generator).to(target)
        for _ in range(discard):
            model(batch)
        _synchronize(target)
        samples_ms: list[float] = []
        for _ in range(repeats):
            start_ns = time.perf_counter_ns()
            model(batch)
            _synchronize(target)
            samples_ms.append((time.perf_counter_ns() - start_ns) / 1e6)
        medians[size] = statistics.median(samples_ms)
    return medians
