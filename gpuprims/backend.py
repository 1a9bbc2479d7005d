"""Which compute backends this process can use, probed lazily.

`cuda_available()` asks the CUDA driver through torch only when called, never at import, and only
counts a device if torch was built with CUDA and a driver answers. :func:`cuda_probe` asks the native
CUDA layer itself (its runtime against the driver, a device, the GPU-DMA kernels for that device):
torch working is not enough, because the extension carries its own CUDA runtime and kernel images.
``backend: auto`` picks cuda only when both say yes, and otherwise says why.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Literal

from gpuprims.cuda import runtime
from gpuprims.cuda.errors import CudaError, CudaUnavailableError

BackendName = Literal["cpu", "cuda"]

log = logging.getLogger("gpuprims.backend")


@functools.cache
def native_available() -> bool:
    """True if the private native extension gpuprims._native imports."""
    try:
        from gpuprims import _native  # noqa: F401
    except ImportError:
        return False
    return True


def cuda_kernels_built() -> bool:
    """True if the native extension was built with its CUDA kernels (nvcc was found at build), or the
    fake CUDA runtime stands in for them (:func:`gpuprims.cuda.runtime.kernels_built`)."""
    return runtime.kernels_built()


def cuda_available() -> bool:
    """True if torch sees at least one CUDA device with a working driver.

    This initialises nothing until called; after a call torch has queried the driver (but created
    no context), so call it in the process that will use the GPU, not in a parent that forks.
    """
    try:
        import torch
    except ImportError:
        return False
    if not torch.backends.cuda.is_built():
        return False
    try:
        return bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0
    except RuntimeError:
        return False


def torch_device(backend: str, gpu: int = 0) -> Any:
    """The torch device an instance's model and inputs live on: ``cuda:<gpu>`` on the cuda backend,
    ``cpu`` on the cpu backend and on the fake CUDA runtime. torch is imported here on first call, not
    at this module's head: the node resolves backends and maps no torch."""
    import torch

    if backend == "cuda" and not runtime.is_fake():
        return torch.device("cuda", gpu)
    return torch.device("cpu")


def _version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}" if v else "none"


@dataclass
class CudaProbe:
    """What the native CUDA layer can do here: ``ok`` with the facts, or not ``ok`` with ``reason``."""

    ok: bool
    reason: str = ""
    fake: bool = False
    runtime_version: int = 0  # cudaRuntimeGetVersion of the runtime inside the extension (e.g. 12080)
    driver_version: int = 0   # cudaDriverGetVersion: the newest CUDA the driver supports; 0 = no driver
    devices: list[dict[str, Any]] = field(default_factory=list)  # per device: name, capability, kernels

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "reason": self.reason, "fake": self.fake, "runtime_version": self.runtime_version,
                "driver_version": self.driver_version, "devices": self.devices}


_CHILD = "import json, sys; from gpuprims.backend import cuda_probe; print(json.dumps(cuda_probe({dev}).as_dict()))"


def _probe_in_child(device: int | None, timeout_s: float) -> CudaProbe:
    try:
        r = subprocess.run([sys.executable, "-c", _CHILD.format(dev=device)], capture_output=True, text=True,
                           timeout=timeout_s, env=dict(os.environ))
        d = json.loads(r.stdout.strip().splitlines()[-1])
        return CudaProbe(**d)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError, TypeError) as e:
        return CudaProbe(False, f"the CUDA probe process failed: {e}")


_RESOLVE_CHILD = ("import json; from gpuprims.backend import cuda_available, cuda_probe; t = cuda_available(); "
                  "print(json.dumps({{'torch_cuda': t, 'probe': cuda_probe({dev}).as_dict() if t else None}}))")


#: _resolve_in_child's answers by device: a node's `validate` and `start` ask once between them.
_RESOLVED: dict[int | None, tuple[bool, CudaProbe]] = {}


def _resolve_in_child(device: int | None, timeout_s: float = 120.0) -> tuple[bool, CudaProbe]:
    """(torch sees a CUDA device, the native probe) asked of a short-lived child, so the caller imports
    no torch and creates no CUDA context. A child that fails says no device (and is asked again next
    time); an answer is kept for the process."""
    if device in _RESOLVED:
        return _RESOLVED[device]
    try:
        r = subprocess.run([sys.executable, "-c", _RESOLVE_CHILD.format(dev=device)], capture_output=True,
                           text=True, timeout=timeout_s, env=dict(os.environ))
        d = json.loads(r.stdout.strip().splitlines()[-1])
        probe = CudaProbe(**d["probe"]) if d["probe"] is not None else CudaProbe(False, "torch sees no CUDA device")
        _RESOLVED[device] = (bool(d["torch_cuda"]), probe)
        return _RESOLVED[device]
    except (OSError, subprocess.SubprocessError, ValueError, IndexError, TypeError, KeyError) as e:
        log.warning("backend: the CUDA check process failed (%s); taking no GPU", e)
        return False, CudaProbe(False, f"the CUDA check process failed: {e}")


def cuda_probe(device: int | None = None, *, isolated: bool = False, timeout_s: float = 120.0) -> CudaProbe:
    """Ask the native CUDA layer whether it can run here (never raises).

    Loading the kernels creates a CUDA context in the calling process; ``isolated=True`` probes in
    a short-lived child process instead (for a supervisor such as the node, which must hold no
    context of its own and whose instances are separate processes).

    Checks, in order: kernels built; the extension's runtime against the driver (a 13.x runtime on a
    CUDA 12 driver fails every call with cudaErrorInsufficientDriver while torch, with its own 12.x
    runtime, works); a device; and, for `device` (every device if None), that the driver can load
    the GPU-DMA kernels (an image for its architecture, or PTX it can JIT).
    """
    if isolated:
        return _probe_in_child(device, timeout_s)
    fake = runtime.is_fake()
    if not cuda_kernels_built():
        return CudaProbe(False, "gpuprims._native was built without CUDA kernels (no nvcc at build time)")
    try:
        rt = runtime.cuda()
    except CudaUnavailableError as e:
        return CudaProbe(False, str(e), fake)
    probe = CudaProbe(False, fake=fake)
    try:
        probe.runtime_version = int(rt.cuda_runtime_version())
        probe.driver_version = int(rt.cuda_driver_version())
    except CudaError as e:
        probe.reason = f"the CUDA runtime cannot report versions: {e}"
        return probe
    if probe.driver_version == 0:
        probe.reason = "no NVIDIA driver is installed (cudaDriverGetVersion reports none)"
        return probe
    if probe.driver_version // 1000 < probe.runtime_version // 1000:
        probe.reason = (
            f"the extension's CUDA runtime is {_version(probe.runtime_version)} but the driver supports CUDA "
            f"{_version(probe.driver_version)}: a {probe.runtime_version // 1000}.x runtime needs a "
            f"{probe.runtime_version // 1000}.x driver; rebuild gpuprims with a CUDA "
            f"{probe.driver_version // 1000}.x nvcc (CUDACXX=...; docs/gpu-machine.md) or update the driver")
        return probe
    try:
        count = int(rt.cuda_device_count())
    except CudaError as e:
        probe.reason = f"the CUDA runtime finds no usable device: {e}"
        return probe
    if count == 0:
        probe.reason = "no CUDA device is visible (CUDA_VISIBLE_DEVICES?)"
        return probe
    wanted = range(count) if device is None else [device]
    for dev in wanted:
        info: dict[str, Any] = {"index": dev}
        try:
            info["name"] = str(rt.cuda_device_name(dev))
            major, minor = rt.cuda_device_capability(dev)
            info["capability"] = f"{major}.{minor}"
            info["kernels"] = dict(rt.cuda_kernel_image(dev))
        except CudaError as e:
            info["error"] = str(e)
            probe.devices.append(info)
            probe.reason = (f"device {dev} ({info.get('name', '?')}, sm_{info.get('capability', '?')}) cannot run "
                            f"the GPU-DMA kernels: {e}")
            return probe
        probe.devices.append(info)
    probe.ok = True
    return probe


def resolve_backend(requested: str, *, device: int | None = None, isolated: bool = False) -> BackendName:
    """Map 'auto' / 'cpu' / 'cuda' to the backend that will run.

    cuda needs torch with CUDA (except on the fake runtime, where torch runs on the CPU) and
    :func:`cuda_probe` to pass. 'cuda' refuses with the reason where they do not; 'auto' falls back to
    cpu and logs the reason at WARNING (silent only where there is no driver at all). A supervisor
    that must not create a CUDA context passes ``isolated=True`` (the probe runs in a child).
    """
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"backend must be 'auto', 'cpu' or 'cuda', got {requested!r}")
    if requested == "cpu":
        return "cpu"
    fake = runtime.is_fake()
    if isolated and not fake:
        # torch's CUDA check imports torch (libtorch: ~200 MB mapped): a supervisor asks a child.
        torch_cuda, probe = _resolve_in_child(device)
        if not torch_cuda:
            if requested == "cuda":
                raise RuntimeError("backend 'cuda' was requested but torch sees no CUDA device with a driver")
            return "cpu"
        return _from_probe(requested, probe)
    if not fake and not cuda_available():
        if requested == "cuda":
            raise RuntimeError("backend 'cuda' was requested but torch sees no CUDA device with a driver")
        return "cpu"
    return _from_probe(requested, cuda_probe(device, isolated=isolated))


def _from_probe(requested: str, probe: CudaProbe) -> BackendName:
    """cuda when the native layer's probe passed (torch sees a device); else cpu for auto, or the
    reason for cuda."""
    if probe.ok:
        return "cuda"
    if requested == "cuda":
        raise RuntimeError(f"backend 'cuda' was requested but the gpuprims CUDA layer cannot run: {probe.reason}")
    log.warning("backend auto: using cpu although torch sees a GPU, because %s", probe.reason)
    return "cpu"
