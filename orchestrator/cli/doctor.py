"""`gpuprims doctor`: the first run on a GPU host, in one command (docs/gpu-machine.md).

Each check says whether it passed, its figures, and what it proves:

* ``extension``: the native extension imports; whether its CUDA kernels were built.
* ``runtime_driver``: the extension's CUDA runtime against the driver (a 13.x runtime needs a CUDA 13
  driver), a device, and the GPU-DMA kernels loading on every device (cudaFuncGetAttributes).
* ``torch``: torch sees the same devices (the models run through torch).
* ``pinned_mapped``: a host region page-locked and mapped (cudaHostRegister + cudaHostGetDevicePointer),
  then unregistered, as the packet pool is.
* ``events``: an event recorded and polled (Sync-lite's wait), with the poll interval achieved.
* ``ipc``: device memory shared with a second process (cudaIpcGetMemHandle / OpenMemHandle), written
  there and read back here (Param-Share's mechanism).
* ``mps``: the MPS control daemon, its servers and their client processes; with ``--instance
  PID:PCT`` each named instance must be one of its clients (else it runs without its GPU%).
* ``gpu_dma``: GPU-DMA and CUDA-Copy gathers of a scattered pool, bit-exact against the expected
  rows, with the CPU time per batch of each.
* ``sync_lite``: a small model completed by Sync-lite against the blocking wait and the callback.
* ``engines``: the GPU engines (``cudagraph``; ``tensorrt`` where the package is installed) built for a
  small model, replayed on a stream and equal to eager at batch 1 and 4; ``scripts/gpu-engines.sh``
  then times every GPU engine on the zoo models (docs/engines-gpu.md).

Without a GPU it says so and runs what it can (the extension); ``--fake`` runs every check on the
fake CUDA runtime (gpuprims.testing.fake), which proves the Python paths, not the device. Results go to
``bench/results/<device>/doctor.json`` (``doctor-fake.json`` on the fake runtime; or ``--out``). Exit
status 1 if any check failed.
"""

from __future__ import annotations

import datetime as _dt
import importlib.util
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import numpy as np

from gpuprims import backend
from gpuprims.cuda import runtime
from gpuprims.cuda.event import Stream
from gpuprims.engines import EngineCache, EngineUnavailable, ModelSource, Target, make_engine
from orchestrator.node.mps import probe_daemon

ROOT = Path(__file__).resolve().parents[2]
SHAPE = (3, 224, 224)
BATCH = 8


class Skip(Exception):
    """A check that cannot run here; the message says why."""


def _check(name: str, proves: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    t0 = time.perf_counter()
    entry: dict[str, Any] = {"name": name, "proves": proves}
    try:
        entry.update(fn())
        entry.setdefault("ok", True)
    except Skip as e:
        entry.update(ok=None, skipped=str(e))
    except Exception as e:  # a failed check is reported, with its error; the others still run
        entry.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc(limit=4))
    entry["seconds"] = round(time.perf_counter() - t0, 3)
    return entry


def check_extension() -> dict[str, Any]:
    from gpuprims import _native

    return {"kernels_built": bool(_native.CUDA_KERNELS_BUILT) or runtime.is_fake(), "fake_runtime": runtime.is_fake()}


def check_runtime_driver() -> dict[str, Any]:
    probe = backend.cuda_probe()
    out = probe.as_dict()
    out["ok"] = probe.ok
    if not probe.ok and probe.driver_version == 0 and not probe.fake:
        raise Skip(f"no NVIDIA GPU/driver here: {probe.reason}")
    return out


def _need_cuda() -> None:
    probe = backend.cuda_probe()
    if not probe.ok:
        raise Skip(f"the CUDA layer cannot run here: {probe.reason}")


def check_torch() -> dict[str, Any]:
    import torch

    if runtime.is_fake():
        raise Skip("fake runtime: torch runs on the CPU")
    if not torch.backends.cuda.is_built():
        raise Skip(f"torch {torch.__version__} is a CPU build")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {"ok": n > 0 and n == runtime.device_count(), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "devices": n, "gpuprims_devices": runtime.device_count()}


def check_pinned_mapped() -> dict[str, Any]:
    import mmap

    _need_cuda()
    m = mmap.mmap(-1, 1 << 20)
    addr = int(np.frombuffer(m, dtype=np.uint8).ctypes.data)
    region = runtime.PinnedRegion(addr, 1 << 20, owner=m)
    try:
        dev_ptr = region.device_pointer(0)
    finally:
        region.close()
    return {"device_pointer_equals_host": dev_ptr == addr, "bytes": 1 << 20}


def check_events() -> dict[str, Any]:
    from gpuprims.cuda.event import Event, Stream

    _need_cuda()
    s, ev = Stream(0), Event(0)
    try:
        ev.record(s)
        polls = ev.wait(50, timeout_s=10)
        return {"polls": polls, "requested_interval_us": 50, "achieved_interval_us": ev.achieved_interval_us}
    finally:
        ev.close()
        s.close()


def _ipc_child(handle: bytes, q: Any) -> None:
    try:
        rt = runtime.cuda()
        p = rt.cuda_ipc_open_mem_handle(0, handle)
        if runtime.is_fake():
            runtime._host_array(p, 16)[:] = 42
        else:
            rt.cuda_memset(0, p, 42, 16)
        rt.cuda_ipc_close_mem_handle(0, p)
        q.put("ok")
    except Exception as e:
        q.put(f"{type(e).__name__}: {e}")


def check_ipc() -> dict[str, Any]:
    _need_cuda()
    rt = runtime.cuda()
    mem = runtime.DeviceMemory(1 << 16, 0)
    try:
        rt.cuda_memset(0, mem.ptr, 0, mem.nbytes)
        handle = rt.cuda_ipc_get_mem_handle(0, mem.ptr)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_ipc_child, args=(handle, q))
        p.start()
        try:
            answer = q.get(timeout=120)
        finally:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
        if answer != "ok":
            return {"ok": False, "child": answer}
        host = np.zeros(16, np.uint8)
        if runtime.is_fake():
            host[:] = runtime._host_array(mem.ptr, 16)
        else:
            buf = runtime.PinnedBuffer(16, mapped=False)
            rt.cuda_memcpy_async(buf.address, mem.ptr, 16, 0)
            rt.cuda_stream_synchronize(0)
            host[:] = buf.array()[:16]
            buf.close()
        return {"ok": bool((host == 42).all()), "child": answer}
    finally:
        mem.close()


def check_mps(instances: dict[int, int]) -> dict[str, Any]:
    info = probe_daemon()
    if not info["installed"]:
        if instances:
            return {"ok": False, **info, "why": "instances given but nvidia-cuda-mps-control is not installed"}
        raise Skip("nvidia-cuda-mps-control is not installed (GPU% is then not enforced; see node.mps)")
    clients = {pid for pids in dict(info["servers"]).values() for pid in pids}  # type: ignore[arg-type]
    missing = {pid: pct for pid, pct in instances.items() if pid not in clients}
    info["instances"] = {str(pid): {"gpu_pct": pct, "mps_client": pid in clients} for pid, pct in instances.items()}
    info["ok"] = bool(info["answering"]) and not missing if instances else True
    if missing:
        info["why"] = "instances not served by MPS run WITHOUT their GPU% limit: " + ", ".join(
            f"pid {p} (GPU% {c})" for p, c in missing.items())
    return info


def check_gpu_dma() -> dict[str, Any]:
    from gpuprims.gather import make_gatherer
    from gpuprims.testing.synthetic import SyntheticPool

    _need_cuda()
    rng = np.random.default_rng(0)
    per = -(-int(np.prod(SHAPE)) // 1024)
    sp = SyntheticPool(slot_count=BATCH * per + 16, max_payload=1024, record_count=BATCH + 2, max_chunks=per + 1)
    bodies = [rng.integers(0, 256, SHAPE, dtype=np.uint8) for _ in range(BATCH)]
    recs = np.array([sp.add_request(1, i, b, chunk_payload=1024) for i, b in enumerate(bodies)], np.uint32)
    expect = (np.stack(bodies).astype(np.float32) / np.float32(255)).tobytes()
    out: dict[str, Any] = {"batch": BATCH, "shape": list(SHAPE), "dtype": "uint8"}
    try:
        for method in ("gpu_dma", "cuda_copy"):
            g = make_gatherer("cuda", sp, SHAPE, "uint8", BATCH, 0, method)
            try:
                x = g.gather(recs)
                got = x.cpu().numpy().tobytes() if hasattr(x, "cpu") else bytes(x)
                cpu = []
                for _ in range(20):
                    c0 = time.thread_time_ns()
                    g.gather(recs)
                    cpu.append((time.thread_time_ns() - c0) / 1e3)
            finally:
                del x
                g.close()
            out[f"{method}_exact"] = got == expect
            out[f"{method}_cpu_us_per_batch"] = float(np.median(cpu))
        out["cpu_ratio"] = out["cuda_copy_cpu_us_per_batch"] / max(out["gpu_dma_cpu_us_per_batch"], 1e-9)
        out["ok"] = out["gpu_dma_exact"] and out["cuda_copy_exact"]
    finally:
        sp.close()
    return out


def check_sync_lite() -> dict[str, Any]:
    import torch

    from gpuprims.gather import ModelRunner, torch_device

    _need_cuda()
    dev = torch_device("cuda", 0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(16, 10)).eval().to(dev)
    x = torch.rand(BATCH, *SHAPE, device=dev)
    with torch.inference_mode():
        ref = model(x)
    runner = ModelRunner("cuda", 0, interval_us=100)
    methods: dict[str, Callable[[], Any]] = {"sync_lite": lambda: runner.run(model, x)}
    if not runtime.is_fake():
        from gpuprims.cuda.sync import sync_blocking, sync_callback

        methods["synchronize"] = lambda: sync_blocking(model, x, how="stream")
        methods["callback"] = lambda: sync_callback(model, x)
    out: dict[str, Any] = {}
    try:
        for name, fn in methods.items():
            fn()
            wall, cpu = [], []
            for _ in range(20):
                w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                y = fn()
                cpu.append((time.thread_time_ns() - c0) / 1e3)
                wall.append((time.perf_counter_ns() - w0) / 1e6)
            out[f"{name}_p50_ms"] = float(np.median(wall))
            out[f"{name}_cpu_us_per_inference"] = float(np.median(cpu))
            out[f"{name}_matches_direct"] = bool(torch.equal(y, ref))
    finally:
        runner.close()
    out["ok"] = all(v for k, v in out.items() if k.endswith("_matches_direct"))
    return out


def probe_model(num_classes: int = 10, seed: int = 0) -> Any:
    """The engines check's model (``orchestrator.cli.doctor:probe_model``): conv, batch norm, pooling, linear."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(16, num_classes)).eval()


def check_engines() -> dict[str, Any]:
    import torch

    from gpuprims.gather import torch_device

    _need_cuda()
    source = ModelSource("orchestrator.cli.doctor:probe_model", (3, 32, 32), max_batch=4)
    dev = torch_device("cuda", 0)
    module = source.build_module(dev)
    gen = torch.Generator().manual_seed(0)
    xs = {n: torch.rand((n, 3, 32, 32), generator=gen).to(dev) for n in (1, 4)}
    with torch.no_grad():
        refs = {n: module(x).cpu() for n, x in xs.items()}
    kinds = ["cudagraph"]
    out: dict[str, Any] = {"full_run": "scripts/gpu-engines.sh times every GPU engine on the zoo models"}
    if "tensorrt" in sys.modules or importlib.util.find_spec("tensorrt") is not None:
        kinds.append("tensorrt")
    else:
        out["tensorrt"] = "not installed (pip install 'gpuprims[gpu-engines]' for engine: tensorrt)"
    with tempfile.TemporaryDirectory(prefix="gpuprims-doctor-engines-") as tmp:
        for kind in kinds:
            stream: Any = Stream(0) if runtime.is_fake() else torch.cuda.Stream(0)
            eng = make_engine(kind, source, Target("cuda", stream=stream), cache=EngineCache(tmp))
            try:
                t0 = time.perf_counter()
                eng.prepare(module)
                out[f"{kind}_build_s"] = round(time.perf_counter() - t0, 3)
                rtol, atol = eng.tolerance
                for n, x in xs.items():
                    got = eng.run(x)
                    eng.synchronize()  # type: ignore[attr-defined]
                    got = got.cpu()
                    out[f"{kind}_max_abs_diff_b{n}"] = float((got - refs[n]).abs().max())
                    out[f"{kind}_matches_eager_b{n}"] = bool(torch.allclose(got, refs[n], rtol=rtol, atol=atol))
            except EngineUnavailable as e:
                out[kind] = f"unavailable: {e}"
            finally:
                eng.close()
                if hasattr(stream, "close"):
                    stream.close()
    out["ok"] = all(v for k, v in out.items() if "_matches_eager_" in k)
    return out


PROVES = {
    "extension": "the native extension imports; whether it carries CUDA kernels",
    "runtime_driver": "the extension's CUDA runtime works with this driver and its GPU-DMA kernels load on "
                      "every device (an image for the architecture or PTX the driver can JIT)",
    "torch": "torch sees the same GPUs with a working CUDA build",
    "pinned_mapped": "host memory can be page-locked and mapped for the GPU (the packet pool's registration)",
    "events": "events record and complete; the Sync-lite poll and the interval it achieves",
    "ipc": "device memory can be shared across processes (Param-Share)",
    "mps": "the MPS daemon answers and the named instances are its clients (their GPU% is enforced)",
    "gpu_dma": "GPU-DMA and CUDA-Copy place a scattered batch bit-exactly; CPU time of each",
    "sync_lite": "Sync-lite returns the model's exact output; its cost against the blocking and callback waits",
    "engines": "the GPU engines (CUDA graphs; TensorRT where installed) build, replay on a stream and equal eager",
}


def _device_name(results: list[dict[str, Any]]) -> str:
    """The benchmarks' machine name (CONTRIBUTING.md, Benchmarks): the GPU's short name, else cpu-<N>core (also on the fake runtime)."""
    if runtime.is_fake():
        return f"cpu-{os.cpu_count()}core"
    for r in results:
        if r["name"] == "runtime_driver" and r.get("ok") and r.get("devices"):
            name = str(r["devices"][0].get("name", "gpu")).lower()
            for short in ("h200", "h100", "a100", "l40", "l4", "t4", "a10", "orin", "thor"):
                if short in name:
                    return short
            return name.replace(" ", "-")
    return f"cpu-{os.cpu_count()}core"


def run_checks(instances: dict[int, int]) -> list[dict[str, Any]]:
    steps: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("extension", check_extension), ("runtime_driver", check_runtime_driver), ("torch", check_torch),
        ("pinned_mapped", check_pinned_mapped), ("events", check_events), ("ipc", check_ipc),
        ("mps", lambda: check_mps(instances)), ("gpu_dma", check_gpu_dma), ("sync_lite", check_sync_lite),
        ("engines", check_engines)]
    return [_check(name, PROVES[name], fn) for name, fn in steps]


def _git() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@click.group()
def main() -> None:
    """gpuprims tools."""


@main.command()
@click.option("--fake", "fake_runtime", is_flag=True, help="Run on the fake CUDA runtime (no GPU needed; proves the Python paths).")
@click.option("--instance", "instances", multiple=True, metavar="PID:PCT",
              help="An instance process and its GPU%%, to check that MPS serves it (repeatable).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Directory for doctor.json (default bench/results/<device>/).")
def doctor(fake_runtime: bool, instances: tuple[str, ...], out: Path | None) -> None:
    """Check this machine's GPU path step by step and write doctor.json."""
    expected: dict[int, int] = {}
    for item in instances:
        try:
            pid, pct = item.split(":")
            expected[int(pid)] = int(pct)
        except ValueError:
            raise click.BadParameter(f"expected PID:PCT, got {item!r}", param_hint="--instance") from None
    if fake_runtime:
        os.environ[runtime.FAKE_ENV] = os.environ.get(runtime.FAKE_ENV) or "1"
    load_before = os.getloadavg()
    results = run_checks(expected)
    device = _device_name(results)
    probe = next(r for r in results if r["name"] == "runtime_driver")
    if probe.get("ok") is None and not runtime.is_fake():
        click.echo(f"doctor: NO GPU: {probe.get('skipped')}. Checked what runs without one; "
                   "`gpuprims doctor --fake` runs the GPU checks on the fake CUDA runtime.")
    for r in results:
        state = "SKIP" if r["ok"] is None else ("ok" if r["ok"] else "FAILED")
        why = r.get("skipped") or r.get("error") or r.get("why") or ""
        click.echo(f"  {state:6s} {r['name']:15s} {why}")
    doc = {"experiment": "doctor", "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
           "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(), "git": _git(),
           "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version(), "device": device,
                       "fake_runtime": runtime.is_fake(), "load_avg_before": list(load_before),
                       "load_avg_after": list(os.getloadavg())},
           "summary": {r["name"]: {k: v for k, v in r.items() if k not in ("name", "trace")} for r in results},
           "samples": {r["name"]: r.get("trace", "") for r in results if r.get("trace")}}
    out_dir = out or ROOT / "bench" / "results" / device
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / ("doctor-fake.json" if runtime.is_fake() else "doctor.json")
    path.write_text(json.dumps(doc, indent=1, default=str))
    click.echo(f"doctor: wrote {path}")
    if any(r["ok"] is False for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
