"""Functions run in spawn-context child processes by the Param-Share tests (importable by name)."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import torch
from torch import nn


class TiedNet(nn.Module):
    """Conv + batch norm (buffers) + two linears sharing one weight (tied)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3)
        self.bn = nn.BatchNorm2d(width)
        self.enc = nn.Linear(width, width, bias=False)
        self.dec = nn.Linear(width, width)
        self.dec.weight = self.enc.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv(x)).relu().mean(dim=(2, 3))
        return self.dec(self.enc(h))


def build_tied(seed: int) -> TiedNet:
    torch.manual_seed(seed)
    m = TiedNet()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-1, 1)
        m.bn.running_var.uniform_(0.5, 2)
    return m.eval()


def _mapped_paths(addr: int) -> set[str]:
    paths = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi and len(parts) >= 6:
                paths.add(parts[5])
    return paths


def import_cpu(blob: bytes, x: torch.Tensor, q: mp.Queue) -> None:  # type: ignore[type-arg]
    """Share the exported parameters into a differently seeded model and report what it computes."""
    from gpuprims.cuda import ParameterHandles, share_parameters

    try:
        handles = ParameterHandles.from_bytes(blob)
        model = build_tied(seed=999)
        shared = share_parameters(blob, model)
        with torch.no_grad():
            out = model(x)
        name = handles.handle.decode()
        in_shm = all(any(name in p for p in _mapped_paths(t.data_ptr()))
                     for t in [*model.parameters(), *model.buffers()] if t.numel())
        report: dict[str, Any] = {
            "out": out.numpy(), "tied": model.enc.weight is model.dec.weight, "in_shm": in_shm,
            "no_grad": not any(p.requires_grad for p in model.parameters()),
        }
        shared.close()
        report["meta_after_close"] = all(p.is_meta for p in model.parameters())
        del model
        import gc

        gc.collect()
        report["closed"] = shared.closed
        q.put(report)
    except Exception as exc:  # report, so the parent fails with the reason
        q.put({"error": repr(exc)})


class Big(nn.Module):
    """Weights of 2 x 4096 x 4096 float32 (128 MiB) with small activations."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4096, 4096)
        self.b = nn.Linear(4096, 4096)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).relu())


def import_cuda(blob: bytes, x: torch.Tensor, q: mp.Queue) -> None:  # type: ignore[type-arg]
    """Map the exported CUDA parameters; report the output and the device memory this process added."""
    from gpuprims.cuda import runtime, share_parameters

    try:
        torch.zeros(1, device="cuda:0")  # context first: its memory is not the model's
        torch.cuda.synchronize()
        free_before, _ = runtime.mem_get_info(0)
        torch.manual_seed(1)
        model = Big()  # on the CPU: nothing of its own on the device
        shared = share_parameters(blob, model)
        with torch.no_grad():
            out = model(x.to("cuda:0"))
        torch.cuda.synchronize()
        free_after, _ = runtime.mem_get_info(0)
        q.put({"out": out.cpu().numpy(), "added_bytes": free_before - free_after})
        shared.close()
        del model, out
    except Exception as exc:
        q.put({"error": repr(exc)})


def run_spawned(target: Any, *args: Any, timeout_s: float = 120) -> dict[str, Any]:
    """Run target(*args, queue) in a spawn child, return what it put, and always reap it.

    Reports carry numpy arrays, not tensors: once torch.multiprocessing is imported, a tensor on a
    queue travels as a file descriptor that dies with the child."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    try:
        report = q.get(timeout=timeout_s)
    finally:
        p.join(timeout_s)
        if p.is_alive():
            p.kill()
            p.join()
    if "error" in report:
        raise AssertionError(f"child failed: {report['error']}")
    return report


def import_fake_cuda(blob: bytes, x: torch.Tensor, q: mp.Queue) -> None:  # type: ignore[type-arg]
    """On the fake CUDA runtime: map the exported parameters through the fake's IPC, run the model as a
    host function on a fake stream (as a node's instance does) and report its output and the mappings."""
    from gpuprims.cuda import share_parameters
    from gpuprims.testing import fake

    try:
        rt = fake.runtime()
        model = build_tied(seed=999)
        shared = share_parameters(blob, model)
        box: list[Any] = []

        def run() -> None:
            with torch.no_grad():
                box.append(shared.model(x).numpy())

        rt.launch_host_func(0, run)
        rt.cuda_device_synchronize(0)
        report: dict[str, Any] = {"out": box[0], "mapped": len(rt.live("ipc_open"))}
        shared.close()
        del model
        import gc

        gc.collect()
        report["closed_after"] = len(rt.live("ipc_open"))
        q.put(report)
    except Exception as exc:
        q.put({"error": repr(exc)})
