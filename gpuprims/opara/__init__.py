"""Opara (Chen, Xu et al.): operator parallelism for one DNN on several streams.

``graph.op_graph`` turns a torch model into an operator graph (each operator memory- or compute-bound
from what it is and its shapes, with a resource-demand estimate); ``plan.plan_streams`` runs Opara's
Algorithm 1 (stream allocation) and Algorithm 2 (launch order) into a ``StreamPlan`` that a CUDA
Graph capture follows (one multi-stream graph) and that ``cpu_exec.StreamExecutor`` runs on CPU
threads, bit-identical to eager. See docs/opara.md.
"""

from __future__ import annotations

from gpuprims.opara.graph import COMPUTE, MEMORY, T4, Op, OpGraph, Roofline, op_graph
from gpuprims.opara.plan import RULES, StreamPlan, allocate_streams, launch_order, plan_streams

__all__ = [
    "COMPUTE",
    "MEMORY",
    "RULES",
    "T4",
    "Op",
    "OpGraph",
    "Roofline",
    "StreamPlan",
    "allocate_streams",
    "launch_order",
    "op_graph",
    "plan_streams",
]
