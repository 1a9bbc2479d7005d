"""``engine: chrion``: Chrion's operator placement of an unrolled LSTM (docs/cpu-coexecution.md) behind
the run seam.

Chrion plans models made of many small recurrent operators; here that is the zoo's ``lstm``
(:class:`apps.zoo.seqnets.StackedLSTM`, unrolled cell by cell). Any other model is refused by name at
prepare. At :meth:`ChrionEngine.prepare`:

1. one LSTM cell step and the head are timed at ``max_batch`` rows (``repeats`` runs, median) on the
   accelerator and on the CPU, and the CPU's contention curve is measured with
   :func:`gpuprims.coexec.fx_exec.measure_lstm_cell_ms` (1..``cores`` threads stepping cells at once);
2. the model becomes Chrion's task graph (:func:`gpuprims.coexec.oppart.lstm_graph`: a cell per layer
   and step, a cell's accelerator memory its layer's weights over the sequence, its output the hidden
   and cell state) and :func:`gpuprims.coexec.oppart.chrion_plan` picks the number of cores ``k*`` and
   each cell's device for ``latency + alpha * accelerator memory``;
3. a :class:`gpuprims.coexec.fx_exec.LstmExecutor` runs that placement: the accelerator's cells in the
   plan's order in the caller's thread, the CPU's on ``max(k*, 1)`` worker threads, each cell waiting
   for its inputs. The answer equals eager's and comes back on the CPU.

``cores`` (default: the app's share of CPU threads, ``Target.threads``, else 1) is the most cores the
CPU side may use; more than the share is refused. On the cpu backend (and the fake CUDA runtime) the
accelerator is the CPU too: both timings are the same cores, the link costs nothing, so the plan
shows how Chrion trades cores against contention and memory, not a speed-up over one device.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch

from apps.zoo.seqnets import StackedLSTM
from gpuprims.coexec.fx_exec import LstmExecutor, measure_lstm_cell_ms
from gpuprims.coexec.graph import CPU, PCIE, SHARED_MEMORY
from gpuprims.coexec.oppart import CpuCores, chrion_plan, lstm_graph
from gpuprims.engines.base import EngineError, ExportError, Progress
from gpuprims.engines.duet import CoexecEngine, accelerator, example_batch
from gpuprims.engines.kinds import ENGINE_KINDS


def _median_ms(fn: Any, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1e6)
    return statistics.median(samples)


class ChrionEngine(CoexecEngine):
    """Chrion's placement of an unrolled LSTM's cells on the accelerator and k CPU cores (module docstring)."""

    kind = "chrion"
    spec = ENGINE_KINDS["chrion"]
    #: The same cells on the same tensors as eager; the last bits may differ with the intra-op thread
    #: count of the thread a cell runs on (oneDNN blocks by it), as eager's own answers do between batch
    #: sizes: the bound the node's eager oracle uses.
    tolerance = (1e-4, 1e-5)

    def _cores(self) -> int:
        share = self.target.threads
        cores = self.options["cores"]
        if cores is None:
            return share or 1
        if share is not None and cores > share:
            raise EngineError(f"engine 'chrion' option cores={cores} exceeds the app's share of {share} CPU "
                              "thread(s)")
        return cores

    def _prepare(self, module: Any, progress: Progress | None) -> None:
        t0 = time.perf_counter()
        cores = self._cores()
        model = self.source.build_module("cpu")
        if not isinstance(model, StackedLSTM):
            raise ExportError(f"engine 'chrion' places the cells of an unrolled LSTM (the zoo's 'lstm'); "
                              f"model {self.source.model!r} is a {type(model).__name__}")
        accel = accelerator(self.target)
        cpu = torch.device("cpu")
        same = accel == cpu
        reps = self.options["repeats"]
        x = example_batch(self.source)
        batch, layers, steps = x.shape[0], len(model.cells), model.seq_len
        if progress is not None:
            progress(f"chrion: timing a cell of {layers} x {steps} on {cores} core(s)", 0.1)

        def cell_ms(m: Any, dev: Any) -> tuple[float, float]:
            """Median ms of one cell step and of the head on ``dev``."""
            def sync() -> None:
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)

            with torch.inference_mode():
                h = torch.zeros(batch, model.hidden, device=dev)
                cell, head = m.cells[-1], m.head

                def step() -> None:
                    cell(h, (h, h))
                    sync()

                def top() -> None:
                    head(h)
                    sync()

                return _median_ms(step, reps), _median_ms(top, reps)

        cpu_cell, cpu_head = cell_ms(model, cpu)
        if same:
            acc_cell, acc_head = cpu_cell, cpu_head
        else:
            acc_cell, acc_head = cell_ms(copy.deepcopy(model).to(accel), accel)
        contention = measure_lstm_cell_ms(batch=batch, features=model.hidden, max_workers=cores,
                                          repeats=reps, seed=self.source.seed)
        slowdown = tuple(max(1.0, contention[k] / contention[1]) for k in sorted(contention))
        weight_mb = sum(p.numel() * p.element_size() for p in model.cells[-1].parameters()) / 2**20
        graph = lstm_graph(layers, steps, gpu_cell_ms=acc_cell, cpu_cell_ms=cpu_cell,
                           out_mb=2 * batch * model.hidden * 4 / 2**20, weight_mb_per_layer=weight_mb,
                           head_gpu_ms=acc_head, head_cpu_ms=cpu_head)
        t1 = time.perf_counter()
        plan = chrion_plan(graph, CpuCores(cores, slowdown), alpha=float(self.options["alpha"]),
                           link=SHARED_MEMORY if same else PCIE)
        planning_ms = (time.perf_counter() - t1) * 1e3
        k = int(plan.notes["cores"])  # type: ignore[call-overload]
        order = list(plan.notes["order"])  # type: ignore[call-overload]
        self.plan = plan
        self.executor = LstmExecutor(model, plan.placement, order, cpu_workers=max(k, 1), accel=accel)
        self.info.build_ms = (time.perf_counter() - t0) * 1e3
        self.info.extra.update({"plan": {
            "accelerator": str(accel), "same_cores": same, "cells": layers * steps, "cores_allowed": cores,
            "cores": k, "alpha": self.options["alpha"], "on_cpu": len(plan.on(CPU)),
            "on_accelerator": len(plan.placement) - len(plan.on(CPU)), "fallback": plan.fallback,
            "estimated_ms": round(plan.makespan_ms, 3), "accelerator_mb": round(plan.gpu_mem_mb, 3),
            "baselines": {d: round(v, 3) for d, v in plan.baselines.items()},
            "cell_ms": {"accelerator": round(acc_cell, 4), "cpu": round(cpu_cell, 4)},
            "slowdown": [round(s, 3) for s in slowdown], "planning_ms": round(planning_ms, 3)}})
        if progress is not None:
            progress(f"chrion: {len(plan.on(CPU))} of {len(plan.placement)} operator(s) on {k} core(s)", 1.0)
