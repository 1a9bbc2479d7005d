"""``engine: duet``: DUET's subgraph co-execution (docs/cpu-coexecution.md) behind the run seam.

At :meth:`DuetEngine.prepare` the model is traced and cut into DUET's phases and subgraphs
(:func:`gpuprims.coexec.fx_exec.partition`); every subgraph is timed alone, at ``max_batch`` rows, on
the accelerator and on the CPU (:func:`~gpuprims.coexec.fx_exec.profile_subgraphs`, ``repeats`` runs
each); DUET's greedy-correction planner (:func:`gpuprims.coexec.subgraph.duet`) places each subgraph on
one of the two devices, falling back to the better single device when no split beats it; and a
:class:`~gpuprims.coexec.fx_exec.SubgraphExecutor` is built for that placement. :meth:`run` runs a
batch through it: phase by phase, the CPU-placed subgraphs of a phase on the executor's CPU worker
while the caller's thread runs the accelerator-placed ones, tensors moved where they are used. The
answer equals eager's (the same operators on the same tensors) and comes back on the CPU.

The accelerator is ``cuda:<device>`` on the cuda backend (with PCIe transfers in the cost model) and
the CPU on the cpu backend (and on the fake CUDA runtime): there both "devices" are this process's
cores and torch's one intra-op pool, the two profiles are one measurement and the link costs nothing
(:data:`gpuprims.coexec.graph.SHARED_MEMORY`). That shows the plan, the partitioning, the executor and
equal answers; it does not show a speed-up (docs/cpu-coexecution.md).

The module is built on the CPU from the app's source (the CPU subgraphs run on it; the accelerator
gets its own copy), so Param-Share does not apply.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from gpuprims.backend import torch_device
from gpuprims.coexec.fx_exec import SubgraphExecutor, partition, profile_subgraphs
from gpuprims.coexec.graph import CPU, GPU, PCIE, SHARED_MEMORY
from gpuprims.coexec.subgraph import duet
from gpuprims.engines.base import Engine, EngineError, ExportError, ModelSource, Progress, Target, check_batch
from gpuprims.engines.kinds import ENGINE_KINDS


def accelerator(target: Target) -> Any:
    """The accelerator of ``target`` for the co-execution engines: cuda:<i>, or the CPU on the cpu
    backend and on the fake CUDA runtime (both "devices" are then the same cores)."""
    return torch_device(target.backend, target.device_index)


def example_batch(source: ModelSource) -> Any:
    """A seeded ``(max_batch, C, H, W)`` batch in [0, 1): what the planners profile with."""
    return torch.rand((source.max_batch, *source.input_shape), generator=torch.Generator().manual_seed(source.seed))


class CoexecEngine(Engine):
    """An engine whose prepare() leaves an ``executor`` running a batch across the accelerator and the
    CPU cores (DUET's subgraphs, Chrion's operators); run() checks the batch and calls it."""

    executor: Any

    def run(self, x: Any) -> Any:
        if not self.prepared:
            raise EngineError(f"engine {self.kind!r} is not prepared: call prepare() before run()")
        check_batch(self.kind, x, self.source)
        return self.executor(x)

    def close(self) -> None:
        ex = self.__dict__.pop("executor", None)
        if ex is not None:
            ex.close()
        super().close()


class DuetEngine(CoexecEngine):
    """DUET's placement of the model's subgraphs on the accelerator and the CPU (module docstring)."""

    kind = "duet"
    spec = ENGINE_KINDS["duet"]
    #: The same operators on the same tensors as eager; the last bits may differ with the intra-op thread
    #: count of the thread a subgraph runs on (oneDNN blocks by it), as eager's own answers do between batch
    #: sizes: the bound the node's eager oracle uses.
    tolerance = (1e-4, 1e-5)

    def _prepare(self, module: Any, progress: Progress | None) -> None:
        t0 = time.perf_counter()
        accel = accelerator(self.target)
        cpu = torch.device("cpu")
        model = self.source.build_module("cpu")
        try:
            part = partition(model)
        except ValueError as e:
            raise ExportError(f"engine 'duet' cannot partition {self.source.model!r}: {e}") from e
        if progress is not None:
            progress(f"duet: {len(part.subgraphs)} subgraph(s) in {len(part.phases())} phase(s); profiling", 0.1)
        x = example_batch(self.source)
        reps = self.options["repeats"]
        on_cpu = profile_subgraphs(part, [x], device=cpu, repeats=reps, warmup=1)
        same = accel == cpu
        on_accel = on_cpu if same else profile_subgraphs(part, [x], device=accel, repeats=reps, warmup=1)
        graph = part.task_graph({n: {GPU: on_accel[n]["latency_ms"], CPU: on_cpu[n]["latency_ms"]} for n in on_cpu},
                                out_mb={n: v["out_mb"] for n, v in on_cpu.items()})
        t1 = time.perf_counter()
        plan = duet(graph, link=SHARED_MEMORY if same else PCIE)
        planning_ms = (time.perf_counter() - t1) * 1e3
        self.plan, self.partition = plan, part
        self.executor = SubgraphExecutor(part, plan.placement, accel=accel)
        self.info.build_ms = (time.perf_counter() - t0) * 1e3
        self.info.extra.update({"plan": {
            "accelerator": str(accel), "same_cores": same,
            "subgraphs": len(part.subgraphs), "phases": len(part.phases()),
            "placement": dict(plan.placement), "on_cpu": plan.on(CPU), "fallback": plan.fallback,
            "estimated_ms": round(plan.makespan_ms, 3),
            "baselines_ms": {d: round(v, 3) for d, v in plan.baselines.items()},
            "profile_ms": {n: {GPU: round(on_accel[n]["latency_ms"], 3), CPU: round(on_cpu[n]["latency_ms"], 3)}
                           for n in on_cpu},
            "planning_ms": round(planning_ms, 3)}})
        if progress is not None:
            progress(f"duet: {len(plan.on(CPU))} of {len(part.subgraphs)} subgraph(s) on the CPU", 1.0)
