"""Scheduling from profiles: Batch-Latency, Multi-Model, DAG apps, schedulers and a simulator.

Pure logic: nothing here touches a GPU or a clock. Time is passed in (``now_ms``), so the
orchestrator drives the same scheduler classes live that ``gpuprims.sched.sim`` drives in simulation.
"""

from __future__ import annotations

from gpuprims.sched.batch_latency import batch_latency, largest_batch
from gpuprims.sched.dag import App, Stage, dnn_recog, single, validate_apps
from gpuprims.sched.multi_model import multi_model
from gpuprims.sched.scheduler import (
    SCHEDULERS,
    Dispatch,
    Scheduler,
    SpatioTemporalScheduler,
    TemporalScheduler,
    make_scheduler,
)

__all__ = [
    "SCHEDULERS",
    "App",
    "Dispatch",
    "Scheduler",
    "SpatioTemporalScheduler",
    "Stage",
    "TemporalScheduler",
    "batch_latency",
    "dnn_recog",
    "largest_batch",
    "make_scheduler",
    "multi_model",
    "single",
    "validate_apps",
]
