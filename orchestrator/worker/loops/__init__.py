"""An instance's serving loops: one class per serving mode over a small base (as LitServe's ``loops/``).

- :class:`ServingLoop` (``base``): the queue, the statistics and the data path's seams every mode shares.
- :class:`AdaptiveLoop` (``adaptive``): the instance batches on its own (the spatial scheduler).
- :class:`DispatchedLoop` (``dispatched``): the instance serves what the node's scheduler names in
  ``RunBatch`` (the spatio-temporal and temporal schedulers).
- :class:`TensorLoop` (``tensors``): a model file's named tensors, batched as the adaptive mode does.

:func:`serving_loop` picks the class from the instance's spec.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuprims.pool import PacketPool
from orchestrator.control.spec import InstanceSpec
from orchestrator.worker.file_runner import FileRunner
from orchestrator.worker.loops.adaptive import AdaptiveLoop
from orchestrator.worker.loops.base import ServingLoop
from orchestrator.worker.loops.dispatched import DispatchedLoop
from orchestrator.worker.loops.tensors import TensorLoop

if TYPE_CHECKING:  # the zoo's runner imports torch: a model file's instance never imports it
    from orchestrator.worker.zoo_runner import AppRunner

__all__ = ["AdaptiveLoop", "DispatchedLoop", "ServingLoop", "TensorLoop", "loop_class", "serving_loop"]


def loop_class(spec: InstanceSpec) -> type[ServingLoop]:
    """The serving mode ``spec`` asks for: a model file's (``serves_file``), the scheduler's
    (``dispatched``), or the instance's own batching."""
    if spec.serves_file:
        return TensorLoop
    if spec.dispatched:
        return DispatchedLoop
    return AdaptiveLoop


def serving_loop(spec: InstanceSpec, pool: PacketPool, runner: AppRunner | FileRunner) -> ServingLoop:
    """The serving loop of ``spec``'s mode over ``pool``, serving through ``runner``; a model file's spec
    needs its :class:`FileRunner`, a zoo model's its ``AppRunner``."""
    cls = loop_class(spec)
    if cls is TensorLoop:
        if not isinstance(runner, FileRunner):
            raise TypeError(f"{spec.name}: a model file is served through a FileRunner, got {type(runner).__name__}")
        return TensorLoop(spec, pool, runner)
    if isinstance(runner, FileRunner):
        raise TypeError(f"{spec.name}: a zoo model is served through an AppRunner, got a FileRunner")
    return cls(spec, pool, runner)
