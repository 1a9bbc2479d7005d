"""CPU co-execution: the edge server's CPU cores as a second device beside the accelerator.

Three planners, pure and driven by profiles (``graph.TaskGraph``: per-task latency on each device,
output size, accelerator memory), all rated by one cost model (``graph.schedule``):

- ``overflow``: SIR+ (whole requests, ``OverflowRouter``; or a model's tasks, ``comm_sd``);
- ``subgraph``: DUET (subgraphs of a multi-branch model, greedy then corrected on measurements);
- ``oppart``: Chrion (an RNN's operators on the accelerator or k cores, latency vs memory by alpha).

``fx_exec`` runs DUET placements of torch models (via torch.fx) and Chrion placements of the zoo's
unrolled LSTM, with answers equal to running the model directly.
"""

from __future__ import annotations

from gpuprims.coexec.graph import CPU, GPU, Link, Plan, Schedule, Task, TaskGraph, gpu_memory_mb, schedule
from gpuprims.coexec.oppart import CpuCores, chrion_order, chrion_plan, lstm_graph, memory_optimal
from gpuprims.coexec.overflow import OverflowRouter, RouteDecision, comm_sd, comm_sd_placement, sd_placement
from gpuprims.coexec.subgraph import Phase, correct, duet, greedy_placement, phases

__all__ = [
    "CPU",
    "GPU",
    "CpuCores",
    "Link",
    "OverflowRouter",
    "Phase",
    "Plan",
    "RouteDecision",
    "Schedule",
    "Task",
    "TaskGraph",
    "chrion_order",
    "chrion_plan",
    "comm_sd",
    "comm_sd_placement",
    "correct",
    "duet",
    "gpu_memory_mb",
    "greedy_placement",
    "lstm_graph",
    "memory_optimal",
    "phases",
    "schedule",
    "sd_placement",
]
