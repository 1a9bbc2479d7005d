"""Param-Share (paper V-E): one copy of a model's parameters, mapped by every instance of it.

:func:`export_parameters` moves the parameters and buffers of a model into one contiguous allocation
it owns, points the model at it (no extra copy stays behind), and returns the handles another
process needs: on CUDA one cudaIpcGetMemHandle of a cudaMalloc'd arena, on the CPU the name of a
POSIX shared-memory object; plus the dtype, shape and offset of every tensor. The handles serialise
to bytes (:meth:`ParameterHandles.to_bytes`) for the control plane.

:func:`share_parameters` maps them in another process (cudaIpcOpenMemHandle / a read-only mmap) and
points a freshly built model of the same architecture at them, copying nothing. The exporting
process itself is refused (CUDA cannot open its own IPC handles, and sharing with oneself means
using the same tensors).

Order of release: importers first (:meth:`SharedParameters.close`, then the mapping is closed with
cudaIpcCloseMemHandle once the last tensor viewing it is gone), then the exporter
(:meth:`ExportedParameters.close`; the arena itself is freed with cudaFree when the exporting
model's tensors are gone). Freeing an exported CUDA allocation while another process still maps it
is undefined behaviour in CUDA, so keep the exporting model alive while instances share it.
"""

from __future__ import annotations

import json
import mmap
import os
import uuid
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from gpuprims.cuda import runtime

_MAGIC = b"GPPARAMS1\n"
_ALIGN = 256
_SHM_DIR = Path("/dev/shm")
#: The pid a CPU export's segment is named after (``gpuprims-params-<pid>-*``): the process whose
#: death makes it stale. A node sets it to its own pid for its instances, whose exports importers use
#: for as long as the node runs; by default the exporting process.
ENV_OWNER_PID = "GPUPRIMS_SHM_OWNER_PID"
#: Tokens of the exports made by this process; importing one of them here is refused.
_exported_tokens: set[str] = set()


@dataclass(frozen=True)
class TensorEntry:
    """One parameter or buffer: every name it has in the model (tied weights share one entry)."""

    names: tuple[str, ...]
    kind: Literal["parameter", "buffer"]
    dtype: str        # torch dtype name, e.g. "float32"
    shape: tuple[int, ...]
    offset: int       # bytes from the start of the shared allocation
    nbytes: int


@dataclass(frozen=True)
class ParameterHandles:
    """What another process needs to map a model's parameters; plain data, serialisable."""

    backend: Literal["cuda", "cpu"]
    token: str                 # identifies this export
    pid: int                   # exporting process
    nbytes: int                # size of the shared allocation
    handle: bytes              # cuda: 64-byte cudaIpcMemHandle_t; cpu: shared-memory object name (utf-8)
    device_bus_id: str         # cuda: PCI bus id of the device holding it; cpu: ""
    entries: tuple[TensorEntry, ...]

    @property
    def weights_nbytes(self) -> int:
        """Bytes of tensor data (without alignment padding)."""
        return sum(e.nbytes for e in self.entries)

    def to_bytes(self) -> bytes:
        """Serialise for the control plane (JSON after a magic line; the handle in hex)."""
        doc = asdict(self)
        doc["handle"] = self.handle.hex()
        return _MAGIC + json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> ParameterHandles:
        """Parse :meth:`to_bytes` output; raises ValueError on anything else."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"expected bytes, got {type(data).__name__}")
        data = bytes(data)
        if not data.startswith(_MAGIC):
            raise ValueError("not serialised ParameterHandles (bad magic)")
        try:
            doc = json.loads(data[len(_MAGIC):])
            entries = tuple(TensorEntry(tuple(e["names"]), e["kind"], e["dtype"], tuple(e["shape"]), int(e["offset"]),
                                        int(e["nbytes"])) for e in doc["entries"])
            h = cls(doc["backend"], doc["token"], int(doc["pid"]), int(doc["nbytes"]), bytes.fromhex(doc["handle"]),
                    doc["device_bus_id"], entries)
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"malformed ParameterHandles: {exc}") from None
        h._validate()
        return h

    def _validate(self) -> None:
        if self.backend not in ("cuda", "cpu"):
            raise ValueError(f"backend must be 'cuda' or 'cpu', got {self.backend!r}")
        if self.backend == "cuda" and len(self.handle) != 64:
            raise ValueError(f"a CUDA IPC handle is 64 bytes, got {len(self.handle)}")
        for e in self.entries:
            if e.kind not in ("parameter", "buffer") or e.offset < 0 or e.offset + e.nbytes > self.nbytes:
                raise ValueError(f"entry {e.names} lies outside the {self.nbytes}-byte allocation or has a bad kind")


def _torch() -> Any:
    import torch

    return torch


def _dtype(name: str) -> Any:
    torch = _torch()
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dt


def _split(name: str) -> tuple[str, str]:
    mod, _, leaf = name.rpartition(".")
    return mod, leaf


def _collect(model: Any) -> list[tuple[str, tuple[str, ...], Any]]:
    """(kind, names, tensor) for each distinct parameter and buffer, in model order."""
    out: list[tuple[str, tuple[str, ...], Any]] = []
    seen: dict[int, int] = {}
    for kind, items in (("parameter", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, t in items:
            if t is None:
                continue
            key = id(t)
            if key in seen:
                k, names, tt = out[seen[key]]
                out[seen[key]] = (k, (*names, name), tt)
            else:
                seen[key] = len(out)
                out.append((kind, (name,), t))
    return out


class _HostHolder:
    """Keeps host memory alive and lets numpy/torch view it; its finalizer is the release."""

    def __init__(self, raw: np.ndarray, readonly: bool) -> None:
        self._raw = raw
        self.__array_interface__ = {"shape": (raw.nbytes,), "typestr": "|u1", "version": 3,
                                    "data": (raw.ctypes.data, readonly)}


class _IpcMapping:
    """A cudaIpcOpenMemHandle mapping; cudaIpcCloseMemHandle when the last view of it is gone."""

    def __init__(self, device: int, handle: bytes, nbytes: int) -> None:
        rt = runtime.cuda()
        self.device = device
        self.nbytes = nbytes
        self.ptr = int(rt.cuda_ipc_open_mem_handle(device, handle))
        self._finalizer = weakref.finalize(self, rt.cuda_ipc_close_mem_handle, device, self.ptr)
        self._finalizer.atexit = False

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        # Not flagged read-only: torch has no read-only tensors and may refuse the flag.
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3,
                "strides": None, "stream": None}


class _FakeDeviceView:
    """Fake CUDA runtime: "device" memory is host memory, viewed by numpy (and so by CPU tensors); it
    keeps ``owner`` (the DeviceMemory or IPC mapping) alive for as long as a view of it lives, as
    ``__cuda_array_interface__`` does for a real tensor."""

    def __init__(self, owner: Any, ptr: int, nbytes: int) -> None:
        self.owner = owner
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "version": 3, "data": (ptr, False)}


def _flat_view(holder: Any, backend: str, device: int | None) -> Any:
    torch = _torch()
    if backend == "cuda" and runtime.is_fake():
        return torch.from_numpy(np.asarray(_FakeDeviceView(holder, holder.ptr, holder.nbytes)))
    if backend == "cuda":
        return torch.as_tensor(holder, device=f"cuda:{device}")
    with warnings.catch_warnings():
        # Importers map read-only; torch warns that it has no read-only tensors. Inference never
        # writes parameters, and a stray write faults instead of corrupting another process.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(holder))


def _entry_views(flat: Any, entries: tuple[TensorEntry, ...]) -> Iterator[tuple[TensorEntry, Any]]:
    for e in entries:
        yield e, flat[e.offset:e.offset + e.nbytes].view(_dtype(e.dtype)).view(e.shape)


def _install(model: Any, e: TensorEntry, tensor: Any, *, as_parameter: bool) -> None:
    torch = _torch()
    value = torch.nn.Parameter(tensor, requires_grad=False) if as_parameter else tensor
    for name in e.names:
        mod_name, leaf = _split(name)
        sub = model.get_submodule(mod_name)
        if e.kind == "parameter":
            if as_parameter:
                sub._parameters[leaf] = value
            else:
                sub._parameters[leaf].data = tensor
        else:
            sub._buffers[leaf] = tensor


class ExportedParameters:
    """The exporting side of a share: owns the shared allocation's name; ``handles`` go to importers."""

    def __init__(self, handles: ParameterHandles, holder: Any) -> None:
        self.handles = handles
        self._holder_ref = weakref.ref(holder)
        self._closed = False

    def to_bytes(self) -> bytes:
        """``handles.to_bytes()``."""
        return self.handles.to_bytes()

    @property
    def released(self) -> bool:
        """True once the shared allocation itself is gone (the exporting model's tensors are gone)."""
        return self._holder_ref() is None

    def close(self) -> None:
        """Stop offering the export: on the CPU, unlink the shared-memory name (mappings stay valid).
        The allocation lives on under the exporting model and is freed with it (cudaFree / munmap).
        Close importers first. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _exported_tokens.discard(self.handles.token)
        if self.handles.backend == "cpu":
            try:
                os.unlink(_SHM_DIR / self.handles.handle.decode())
            except FileNotFoundError:
                pass

    def __enter__(self) -> ExportedParameters:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def export_parameters(model: Any, *, backend: Literal["cuda", "cpu"] | None = None,
                      gpu: int | None = None) -> ExportedParameters:
    """Move `model`'s parameters and buffers into one shared allocation and return its handles.

    All tensors must be on one device: a CUDA device (one cudaMalloc arena, one cudaIpcGetMemHandle)
    or the CPU (a POSIX shared-memory object). The model keeps working, now reading the shared copy;
    its previous tensors are released. Raises ValueError for a model without tensors or with tensors
    on several devices.

    ``backend`` defaults to the tensors' device. On the fake CUDA runtime, where an instance's model
    lives on the CPU, ``backend="cuda"`` (device ``gpu``, default 0) puts the arena in fake device
    memory and exports it with the fake's cudaIpcGetMemHandle, so a node there runs CUDA's IPC path
    and its lifetime rules; anywhere else CPU tensors with ``backend="cuda"`` are a ValueError.
    """
    torch = _torch()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    items = _collect(model)
    if not items:
        raise ValueError("model has no parameters or buffers to share")
    devices = {t.device for _, _, t in items}
    if len(devices) != 1:
        raise ValueError(f"all parameters and buffers must be on one device, found {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"parameters must be on a CUDA device or the CPU, got {device}")
    if backend not in (None, "cuda", "cpu") or (backend is not None and backend != device.type and not (
            backend == "cuda" and device.type == "cpu" and runtime.is_fake())):
        raise ValueError(f"cannot export tensors on {device} with backend={backend!r} (CPU tensors go to a CUDA "
                         "arena only on the fake CUDA runtime)")
    on_fake_gpu = backend == "cuda" and device.type == "cpu"
    entries: list[TensorEntry] = []
    offset = 0
    for kind, names, t in items:
        nbytes = t.numel() * t.element_size()
        entries.append(TensorEntry(names, kind, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes))
        offset += -(-max(nbytes, 1) // _ALIGN) * _ALIGN
    total = offset
    token = uuid.uuid4().hex
    if device.type == "cuda" or on_fake_gpu:
        if on_fake_gpu:
            dev = gpu or 0
        else:
            dev = device.index if device.index is not None else torch.cuda.current_device()
        holder: Any = runtime.DeviceMemory(total, dev)
        flat = _flat_view(holder, "cuda", dev)
        handle = bytes(runtime.cuda().cuda_ipc_get_mem_handle(dev, holder.ptr))
        bus = runtime.pci_bus_id(dev)
        kind: Literal["cuda", "cpu"] = "cuda"
    else:
        if not _SHM_DIR.is_dir():
            raise OSError(f"CPU parameter sharing needs POSIX shared memory at {_SHM_DIR}")
        owner = os.environ.get(ENV_OWNER_PID, "")
        name = f"gpuprims-params-{owner if owner.isdigit() else os.getpid()}-{token[:12]}"
        fd = os.open(_SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, total)
            mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(_SHM_DIR / name)
            raise
        finally:
            os.close(fd)
        holder = _HostHolder(np.frombuffer(mm, dtype=np.uint8), readonly=False)
        flat = torch.from_numpy(np.asarray(holder))
        handle, bus, kind = name.encode(), "", "cpu"
    with torch.no_grad():
        for (_, _, t), (e, view) in zip(items, _entry_views(flat, tuple(entries))):
            view.copy_(t)
            _install(model, e, view, as_parameter=False)
    if kind == "cuda" and not on_fake_gpu:
        torch.cuda.synchronize(device)  # importers must see finished copies
    handles = ParameterHandles(kind, token, os.getpid(), total, handle, bus, tuple(entries))
    _exported_tokens.add(token)
    return ExportedParameters(handles, holder)


class SharedParameters:
    """The importing side: `model` now reads the exporter's tensors. close() detaches the model
    (its shared tensors become meta tensors, so a late use fails loudly instead of reading unmapped
    memory) and the mapping is closed once no tensor views it any more."""

    def __init__(self, model: Any, handles: ParameterHandles, mapping: Any) -> None:
        self.model = model
        self.handles = handles
        self._mapping: Any = mapping
        self._mapping_ref = weakref.ref(mapping)

    @property
    def closed(self) -> bool:
        """True once the mapping is gone (cudaIpcCloseMemHandle done / munmapped)."""
        return self._mapping_ref() is None

    def close(self) -> None:
        """Detach the model and let the mapping close. Idempotent."""
        if self._mapping is None:
            return
        torch = _torch()
        for e in self.handles.entries:
            meta = torch.empty(e.shape, dtype=_dtype(e.dtype), device="meta")
            _install(self.model, e, meta, as_parameter=e.kind == "parameter")
        self._mapping = None

    def __enter__(self) -> SharedParameters:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def share_parameters(handles: ParameterHandles | ExportedParameters | bytes, new_model: Any) -> SharedParameters:
    """Map exported parameters in this process and point `new_model`'s parameters and buffers at them
    without copying (cudaIpcOpenMemHandle on the exporter's device, found by PCI bus id; or a
    read-only mmap of the CPU shared-memory object).

    `new_model` must have exactly the exported names with the same shapes and dtypes (build it on the
    CPU or the meta device so it allocates no device memory of its own for weights). Raises ValueError
    in the exporting process itself, and for a model that does not match.
    """
    torch = _torch()
    if isinstance(handles, ExportedParameters):
        handles = handles.handles
    elif isinstance(handles, (bytes, bytearray, memoryview)):
        handles = ParameterHandles.from_bytes(bytes(handles))
    if not isinstance(handles, ParameterHandles):
        raise TypeError(f"handles must be ParameterHandles or their bytes, got {type(handles).__name__}")
    if not isinstance(new_model, torch.nn.Module):
        raise TypeError(f"new_model must be a torch.nn.Module, got {type(new_model).__name__}")
    if handles.token in _exported_tokens:
        raise ValueError(
            f"these parameters were exported by this process (pid {os.getpid()}); CUDA IPC handles cannot be "
            "opened in the exporting process: use the exporting model's tensors directly, or share with "
            "another process")
    handles._validate()
    _check_match(handles, new_model)
    if handles.backend == "cuda":
        dev = runtime.device_by_pci_bus_id(handles.device_bus_id)
        mapping: Any = _IpcMapping(dev, handles.handle, handles.nbytes)
        flat = _flat_view(mapping, "cuda", dev)
    else:
        path = _SHM_DIR / handles.handle.decode()
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise ValueError(f"shared parameters {path} do not exist (the export was closed or its process "
                             "is gone)") from None
        try:
            size = os.fstat(fd).st_size
            if size < handles.nbytes:
                raise ValueError(f"{path} holds {size} bytes, less than the {handles.nbytes} exported")
            mm = mmap.mmap(fd, handles.nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        mapping = _HostHolder(np.frombuffer(mm, dtype=np.uint8), readonly=True)
        flat = _flat_view(mapping, "cpu", None)
    for e, view in _entry_views(flat, handles.entries):
        _install(new_model, e, view, as_parameter=e.kind == "parameter")
    return SharedParameters(new_model, handles, mapping)


def _check_match(handles: ParameterHandles, model: Any) -> None:
    have = {name: t for name, t in model.named_parameters(remove_duplicate=False)}
    have.update({name: t for name, t in model.named_buffers(remove_duplicate=False) if t is not None})
    wanted = {name: e for e in handles.entries for name in e.names}
    missing = sorted(set(wanted) - set(have))
    extra = sorted(set(have) - set(wanted))
    if missing or extra:
        raise ValueError(f"new_model does not match the exported model: missing {missing[:5]}, "
                         f"not exported {extra[:5]}")
    bad = [f"{n}: {tuple(have[n].shape)} {have[n].dtype} != {e.shape} torch.{e.dtype}"
           for n, e in wanted.items() if tuple(have[n].shape) != e.shape or str(have[n].dtype) != f"torch.{e.dtype}"]
    if bad:
        raise ValueError(f"new_model's tensors differ from the exported ones: {bad[:5]}")
