"""Param-Share (paper V-E, Table II): memory per added instance with and without shared weights.

    python3 -m bench.share [--quick] [--backend auto|cpu|cuda] [--models ...] [--ort-models ...]

For ResNet-50, VGG-19 and ResNeXt-50, instances are started one after another as spawn processes,
each loading the model and running one batch-1 inference, and all kept alive:
* unshared: every instance loads its own weights;
* shared: the first instance exports its parameters (export_parameters) and the others map them
  (share_parameters) from a model built on the meta device, so they allocate no weights.

CUDA: the memory an instance adds is the drop of the device's free memory (cudaMemGetInfo, read by
the parent) from just before it starts to when its weights are in place (context and weights),
read before its first inference; what the inference then adds (activations, the cuBLAS/cuDNN
workspace, the same with or without Param-Share) is reported apart as ``*_inference_mb``. CPU: the USS (private memory) of each instance, with PSS beside it. The instances that
fit in a fixed budget (16 GiB, the paper's T4) follow from these.

ONNX Runtime rows (``ort_<model>_*``, CPU provider, any backend): the model exported and optimized once
by the onnxruntime engine (its cache entry), then each instance is a spawn process that imports
onnxruntime and no torch and opens a session on the optimized model, one intra-op thread:
* unshared: the session loads its own initializers (ORT's defaults: pre-packing on);
* shared: the first instance copies the initializers into a POSIX shared-memory segment
  (gpuprims.engines.ort_share.export_initializers) and every session, its own included, takes them
  with ``add_initializer`` over the mapping (pre-packing off, so no private re-packed copy).
Memory per added instance is its USS (the segment's pages are shared, so they are not in it) with PSS
beside; the first shared instance is charged the whole segment; ``ort_<model>_latency_ms_*`` is the
first instance's batch-1 median alone (what pre-packing off costs). That is how the node runs an
``engine: onnxruntime`` app's instances and shadows on the CPU.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import write_result
from gpuprims.backend import resolve_backend

MODELS = ("resnet50", "vgg19", "resnext50")
BUDGET_MIB = 16 * 1024
PAPER = {"resnet50": (10, 11), "vgg19": (8, 10), "resnext50": (10, 12)}  # instances without / with P.S.


def instance(backend: str, name: str, mode: str, blob: bytes | None, conn: Any) -> None:
    """One model instance: load (own weights, export them, or map shared ones), infer once, report
    ready, then wait for the word to stop."""
    try:
        import torch

        from apps.zoo import build_model
        from gpuprims.cuda import export_parameters, share_parameters

        cuda = backend == "cuda"
        dev = "cuda:0" if cuda else "cpu"
        shared = exp = None
        if mode == "import":
            model = build_model(name, device="meta")
            shared = share_parameters(blob, model)  # type: ignore[arg-type]
        else:
            model = build_model(name, device=dev)
        if mode == "export":
            exp = export_parameters(model)
            if cuda:
                torch.cuda.empty_cache()  # the pre-export copies are free now; give them back
        if cuda:
            torch.cuda.synchronize()
        # The parent reads the device's memory here (weights in place, no inference yet), then again
        # after the inference below, whose workspace is the same with or without Param-Share.
        conn.send({"loaded": True})
        conn.recv()
        with torch.no_grad():
            model(torch.randn(1, 3, 224, 224, device=dev))
        if cuda:
            torch.cuda.synchronize()
        weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        conn.send({"ready": True, "pid": os.getpid(), "blob": exp.to_bytes() if exp else None,
                   "weights_bytes": weights})
        conn.recv()
        if shared is not None:
            shared.close()
        if exp is not None:
            exp.close()
    except Exception as exc:
        conn.send({"error": repr(exc)})


def ort_instance(model_path: str, mode: str, blob: bytes | None, latency_runs: int, conn: Any) -> None:
    """One ONNX Runtime instance (no torch): a session with its own initializers, or over the shared
    segment (export it first, or map it); one batch-1 inference; report; wait for the word to stop."""
    try:
        import onnxruntime as ort

        from gpuprims.engines.ort_share import export_initializers, map_initializers, trim_heap

        path = Path(model_path)
        shared = None
        if mode == "export":
            handles = path.parent / f"bench-share-{os.getpid()}.handles"
            shared = export_initializers(path, handles)
            handles.unlink()
        elif mode == "import":
            shared = map_initializers(blob or b"", path)
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        so.inter_op_num_threads = 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the optimized model
        so.log_severity_level = 3
        if shared is not None:
            shared.add_to(ort, so)
        sess = ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])
        trim_heap()
        inp = sess.get_inputs()[0]
        shape = [1 if not isinstance(d, int) else d for d in inp.shape]
        feed = {inp.name: np.zeros(shape, dtype=np.float32)}
        sess.run(None, feed)
        times = []
        for _ in range(latency_runs):  # batch-1 latency: what pre-packing off costs a sharing session
            t0 = time.perf_counter()
            sess.run(None, feed)
            times.append((time.perf_counter() - t0) * 1e3)
        trim_heap()
        conn.send({"ready": True, "pid": os.getpid(), "latency_ms": float(np.median(times)) if times else None, "blob": shared.handles.to_bytes() if mode == "export" and
                   shared is not None else None, "weights_bytes": shared.nbytes if shared is not None else 0,
                   "segment": shared.handles.handle.decode() if shared is not None else None})
        conn.recv()
        del sess
    except Exception as exc:
        conn.send({"error": repr(exc)})


class Fleet:
    """Instances started one by one and kept alive; always reaped."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.procs: list[tuple[Any, Any]] = []

    def start(self, *args: Any, timeout_s: float = 600, on_loaded: Any = None, target: Any = instance
              ) -> dict[str, Any]:
        """Start one instance; `on_loaded()` runs once its weights are in place (before its first
        inference), and its value is returned as ``msg["loaded"]``."""
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=target, args=(*args, child))
        p.start()
        self.procs.append((p, parent))
        loaded = None
        while True:
            if not parent.poll(timeout_s):
                raise TimeoutError(f"instance {args} not ready within {timeout_s} s")
            msg = parent.recv()
            if "error" in msg:
                raise RuntimeError(f"instance {args} failed: {msg['error']}")
            if msg.get("loaded"):
                loaded = on_loaded() if on_loaded is not None else None
                parent.send("go")
                continue
            msg["loaded"] = loaded
            return msg

    def stop(self) -> None:
        # Importers before the exporter: release in the order CUDA IPC requires.
        for p, conn in reversed(self.procs):
            try:
                conn.send("stop")
            except (BrokenPipeError, OSError):
                pass
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join()
        self.procs.clear()


def device_used_mib() -> float:
    import torch

    free, total = torch.cuda.mem_get_info(0)
    return (total - free) / 2**20


def host_mem_mib(pid: int) -> tuple[float, float]:
    import psutil

    info = psutil.Process(pid).memory_full_info()
    return info.uss / 2**20, info.pss / 2**20


def run_model(backend: str, name: str, added: int) -> tuple[dict[str, Any], dict[str, Any]]:
    cuda = backend == "cuda"
    samples: dict[str, Any] = {}
    for mode in ("unshared", "shared"):
        fleet = Fleet()
        per: list[float] = []
        infer: list[float] = []
        pss: list[float] = []
        weights = 0
        try:
            blob = None
            for i in range(added + 1):
                role = "unshared" if mode == "unshared" else ("export" if i == 0 else "import")
                before = device_used_mib() if cuda else 0.0
                msg = fleet.start(backend, name, role, blob, on_loaded=device_used_mib if cuda else None)
                if role == "export":
                    blob = msg["blob"]
                    weights = msg["weights_bytes"]
                if cuda:
                    per.append(msg["loaded"] - before)
                    infer.append(device_used_mib() - msg["loaded"])
                else:
                    uss, p = host_mem_mib(msg["pid"])
                    per.append(uss)
                    pss.append(p)
                weights = weights or msg["weights_bytes"]
        finally:
            fleet.stop()
        samples[mode] = {"mem_mib_per_instance": per, "pss_mib_per_instance": pss, "weights_bytes": weights,
                         "inference_mib_per_instance": infer}
    s: dict[str, Any] = {}
    un = samples["unshared"]["mem_mib_per_instance"]
    sh = samples["shared"]["mem_mib_per_instance"]
    s[f"{name}_weights_mb"] = samples["unshared"]["weights_bytes"] / 2**20
    s[f"{name}_mem_per_instance_mb_unshared"] = float(np.mean(un[1:] if len(un) > 1 else un))
    s[f"{name}_mem_per_instance_mb_shared"] = float(np.mean(sh[1:])) if len(sh) > 1 else float("nan")
    s[f"{name}_first_instance_mb"] = float(sh[0])
    s[f"{name}_instances_fit_unshared"] = int(BUDGET_MIB // max(s[f"{name}_mem_per_instance_mb_unshared"], 1e-9))
    s[f"{name}_instances_fit_shared"] = int(
        1 + max(0.0, BUDGET_MIB - s[f"{name}_first_instance_mb"]) // max(s[f"{name}_mem_per_instance_mb_shared"], 1e-9))
    if cuda:
        s[f"{name}_inference_mb"] = float(np.mean(samples["unshared"]["inference_mib_per_instance"]))
    if not cuda:
        s[f"{name}_pss_per_instance_mb_unshared"] = float(np.mean(samples["unshared"]["pss_mib_per_instance"]))
        s[f"{name}_pss_per_instance_mb_shared"] = float(np.mean(samples["shared"]["pss_mib_per_instance"][1:]))
    s[f"{name}_paper_instances_fit_unshared"], s[f"{name}_paper_instances_fit_shared"] = PAPER[name]
    return s, samples


def ort_model_file(name: str, cache_dir: Path) -> Path:
    """The model exported to ONNX and optimized by the onnxruntime engine (its cache entry's file)."""
    from gpuprims.engines import EngineCache, ModelSource, Target, make_engine
    from gpuprims.engines.onnxruntime import ONNX_FILE, OPTIMIZED_FILE

    engine = make_engine("onnxruntime", ModelSource(name, (3, 224, 224), 1), Target("cpu", threads=1),
                         cache=EngineCache(cache_dir))
    info = engine.prepare()
    engine.close()
    entry = Path(info.artefact)
    return entry / OPTIMIZED_FILE if (entry / OPTIMIZED_FILE).is_file() else entry / ONNX_FILE


def run_ort_model(name: str, added: int, cache_dir: Path, latency_runs: int = 30
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ONNX Runtime rows of one model (see the module docstring)."""
    path = ort_model_file(name, cache_dir)
    samples: dict[str, Any] = {"model_file_mb": path.stat().st_size / 2**20}
    segment_mib = 0.0
    for mode in ("unshared", "shared"):
        fleet = Fleet()
        uss: list[float] = []
        pss: list[float] = []
        latency: list[float] = []
        segment = None
        try:
            blob = None
            for i in range(added + 1):
                role = "unshared" if mode == "unshared" else ("export" if i == 0 else "import")
                msg = fleet.start(str(path), role, blob, latency_runs if i == 0 else 0, target=ort_instance)
                if i == 0:
                    latency.append(msg["latency_ms"])
                if role == "export":
                    blob, segment = msg["blob"], msg["segment"]
                    segment_mib = msg["weights_bytes"] / 2**20
                u, p = host_mem_mib(msg["pid"])
                uss.append(u)
                pss.append(p)
            # every instance's PSS with all of them alive (the segment split between its users)
            pss_all = [host_mem_mib(p.pid)[1] for p, _ in fleet.procs]
        finally:
            fleet.stop()
            if segment is not None:
                Path("/dev/shm", segment).unlink(missing_ok=True)
        samples[mode] = {"uss_mib_per_instance": uss, "pss_mib_per_instance_at_start": pss,
                         "pss_mib_per_instance_all_alive": pss_all, "first_instance_latency_ms": latency}
    un, sh = samples["unshared"], samples["shared"]
    k = f"ort_{name}"
    s: dict[str, Any] = {f"{k}_model_file_mb": samples["model_file_mb"], f"{k}_shared_segment_mb": segment_mib}
    s[f"{k}_mem_per_instance_mb_unshared"] = float(np.mean(un["uss_mib_per_instance"][1:]))
    s[f"{k}_mem_per_instance_mb_shared"] = float(np.mean(sh["uss_mib_per_instance"][1:]))
    s[f"{k}_first_instance_mb"] = float(sh["uss_mib_per_instance"][0]) + segment_mib
    s[f"{k}_pss_per_instance_mb_unshared"] = float(np.mean(un["pss_mib_per_instance_all_alive"]))
    s[f"{k}_pss_per_instance_mb_shared"] = float(np.mean(sh["pss_mib_per_instance_all_alive"]))
    # batch-1 median of the first instance (alone): pre-packing on (own copy) vs off (shared)
    s[f"{k}_latency_ms_unshared"] = un["first_instance_latency_ms"][0]
    s[f"{k}_latency_ms_shared"] = sh["first_instance_latency_ms"][0]
    s[f"{k}_instances_fit_unshared"] = int(BUDGET_MIB // max(s[f"{k}_mem_per_instance_mb_unshared"], 1e-9))
    s[f"{k}_instances_fit_shared"] = int(
        1 + max(0.0, BUDGET_MIB - s[f"{k}_first_instance_mb"]) // max(s[f"{k}_mem_per_instance_mb_shared"], 1e-9))
    if name in PAPER:
        s[f"{k}_paper_instances_fit_unshared"], s[f"{k}_paper_instances_fit_shared"] = PAPER[name]
    return s, samples


def plot(summary: dict[str, Any], models: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    x = np.arange(len(models))
    for ax, key, label in ((ax1, "mem_per_instance_mb", "memory per added instance (MiB)"),
                           (ax2, "instances_fit", f"instances in {BUDGET_MIB // 1024} GiB")):
        ax.bar(x - 0.2, [summary[f"{m}_{key}_unshared"] for m in models], 0.4, label="own weights", color="tab:red")
        ax.bar(x + 0.2, [summary[f"{m}_{key}_shared"] for m in models], 0.4, label="Param-Share", color="tab:green")
        ax.set_xticks(x, models)
        ax.set_ylabel(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one added instance per mode instead of two")
    ap.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--ort-models", default=",".join(MODELS),
                    help="models for the ONNX Runtime rows (CPU provider); empty for none")
    ap.add_argument("--engine-cache", default=None, help="engine cache for the ONNX exports (default: a temp dir)")
    ap.add_argument("--out-dir", default=None, help="write the result here instead of bench/results (a smoke run)")
    args = ap.parse_args(argv)
    backend = resolve_backend(args.backend)
    print(f"bench.share: backend {backend}")
    added = 1 if args.quick else 2
    models = [m for m in args.models.split(",") if m]
    summary: dict[str, Any] = {"budget_mib": BUDGET_MIB, "added_instances": added}
    samples: dict[str, Any] = {}
    for name in models:
        s, smp = run_model(backend, name, added)
        summary.update(s)
        samples[name] = smp
        print(f"  {name}: {s}")
    ort_models = [m for m in args.ort_models.split(",") if m]
    with tempfile.TemporaryDirectory(prefix="bench-share-") as tmp:
        cache_dir = Path(args.engine_cache) if args.engine_cache else Path(tmp)
        for name in ort_models:
            s, smp = run_ort_model(name, added, cache_dir, 10 if args.quick else 30)
            summary.update(s)
            samples[f"ort_{name}"] = smp
            print(f"  onnxruntime {name}: {s}")
    if backend == "cuda":
        import torch

        summary["device_total_mib"] = torch.cuda.mem_get_info(0)[1] / 2**20
        notes = ("CUDA: memory an instance adds = drop of device free memory (cudaMemGetInfo in the parent) from "
                 "before its start to its first inference; includes its CUDA context. Shared instances map the "
                 "first instance's parameters with CUDA IPC. Instances fit = 16 GiB budget (the paper's T4).")
    else:
        notes = ("backend: cpu (no GPU): memory per instance = USS (private memory) of each instance process after "
                 "its first inference, PSS beside it; shared instances map the first instance's parameters from "
                 "POSIX shared memory (read-only). Instances fit = a 16 GiB budget, as for the paper's T4.")
    if ort_models:
        notes += (" ONNX Runtime rows (ort_*): CPU provider sessions on the engine's optimized model, one thread; "
                  "memory per added instance = USS, PSS with all instances alive beside; shared = initializers "
                  "in one POSIX shared-memory segment given with add_initializer (pre-packing off); the first "
                  "shared instance is charged the whole segment.")
    path = write_result("share", backend, summary, samples, notes=notes,
                        out_dir=Path(args.out_dir) if args.out_dir else None)
    if models:
        plot(summary, models, path.with_suffix(".png"))
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
