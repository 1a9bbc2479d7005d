"""``engine: eager``: the model run by torch as it is (the default, and every other engine's reference)."""

from __future__ import annotations

from typing import Any

import torch

from gpuprims.backend import torch_device
from gpuprims.engines.base import Engine, Progress
from gpuprims.engines.kinds import ENGINE_KINDS


class EagerEngine(Engine):
    """The torch module itself, under ``torch.inference_mode``. Runs on the module's own weights, so
    Param-Share applies: ``prepare(module)`` takes the instance's (possibly shared) module as it is."""

    kind = "eager"
    spec = ENGINE_KINDS["eager"]
    tolerance = (0.0, 0.0)
    uses_torch_weights = True

    def _prepare(self, module: Any, progress: Progress | None) -> None:
        if module is None:
            module = self.source.build_module(_device(self.target))
        self.module = module

    def run(self, x: Any) -> Any:
        with torch.inference_mode():
            return self.module(x)

    def close(self) -> None:
        self.__dict__.pop("module", None)
        super().close()


def _device(target: Any) -> Any:
    """The torch device of a target: ``cuda:<i>`` on cuda (``cpu`` on the fake runtime)."""
    return torch_device(target.backend, target.device_index)
