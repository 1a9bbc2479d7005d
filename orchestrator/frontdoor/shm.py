"""Triton's shared-memory extensions: inputs read from, and outputs written into, memory a local client
registered, over HTTP and gRPC.

- **System shared memory**: a POSIX shared-memory object (``shm_open`` key, as
  ``tritonclient.utils.shared_memory`` makes) registered as a region ``[offset, offset + byte_size)`` of
  it. HTTP ``/v2/systemsharedmemory/region/<name>/register|unregister|status``,
  ``/v2/systemsharedmemory/unregister|status``; gRPC ``SystemSharedMemoryRegister|Unregister|Status``.
- **CUDA shared memory**: a 64-byte ``cudaIpcMemHandle_t`` (base64 in HTTP, as
  ``tritonclient.utils.cuda_shared_memory`` sends it) opened with cudaIpcOpenMemHandle
  (cudaIpcMemLazyEnablePeerAccess, the only flag the call takes) and closed with cudaIpcCloseMemHandle at
  unregister. HTTP ``/v2/cudasharedmemory/...``; gRPC ``CudaSharedMemoryRegister|Unregister|Status``.

An input or requested output names a region with the parameters ``shared_memory_region``,
``shared_memory_byte_size`` (both required) and ``shared_memory_offset`` (optional, 0). Inputs are read
when the request is decoded; outputs are written when the answer is ready, and the answer then carries
the parameters and no data, as Triton's does. Region names are one namespace over both kinds.

Bounds: a system region must lie inside its object (``fstat``) when registered; every tensor must lie
inside its region (offset + byte_size <= the registered byte_size), and a region is mapped only
``offset + byte_size`` bytes long, so nothing is read or written outside it. A CUDA region is checked
against its registered byte_size (and, on the fake runtime, the size of the allocation the handle names;
a real ``cudaIpcMemHandle_t`` does not carry it, so the client's byte_size is trusted there, as Triton
trusts it).

Unregistering a region in use: reads and writes hold the registry's lock, and a region is unmapped only
under it, so an input already read is served and an output whose region went away meanwhile fails its
request with ``invalid`` ("unregistered while this request used it"): never a read of unmapped memory.

Trust model: this is for clients on the same machine. Registering, unregistering and using regions are
refused (``unauthenticated``) for a peer that is not loopback (or a Unix socket), since the key or handle
names memory of this machine only. A region is named by the client that registered it and anyone local
who knows the name may use it: the name is the capability, as in Triton; a client that wants isolation
picks names nobody else can guess.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import mmap
import os
import re
import stat
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from aiohttp import web

from gpuprims.cuda import runtime
from gpuprims.cuda.errors import CudaError
from orchestrator.frontdoor import shm_pb2
from orchestrator.frontdoor.core import Core, OipError

REGION = "shared_memory_region"
OFFSET = "shared_memory_offset"
BYTE_SIZE = "shared_memory_byte_size"
#: The server-metadata extensions these add.
EXTENSIONS = ["system_shared_memory", "cuda_shared_memory"]
#: At most this many regions are registered at once (each holds a mapping and a file descriptor).
MAX_REGIONS = 256
#: A system region's key: a POSIX shared-memory name (one leading slash, no other).
_KEY = re.compile(r"^/?[A-Za-z0-9_.\-]{1,250}$")
_SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor lies: ``byte_size`` bytes at ``offset`` into region ``region``."""

    region: str
    offset: int
    byte_size: int


@dataclass(frozen=True)
class SystemRegionStatus:
    name: str
    key: str
    offset: int
    byte_size: int


@dataclass(frozen=True)
class CudaRegionStatus:
    name: str
    device_id: int
    byte_size: int


class _SystemRegion:
    """``byte_size`` bytes at ``offset`` of a POSIX shared-memory object, mapped read-write."""

    kind = "system"

    def __init__(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not _KEY.match(key) or key.strip("/") in (".", ".."):
            raise OipError("invalid", f"shared memory region {name!r}: key {key!r} is not a POSIX "
                                      "shared-memory name ('/name')")
        path = os.path.join(_SHM_DIR, key.lstrip("/"))
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as e:
            raise OipError("invalid", f"shared memory region {name!r}: cannot open key {key!r}: "
                                      f"{e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OipError("invalid", f"shared memory region {name!r}: key {key!r} is not a shared-memory "
                                          "object")
            if offset + byte_size > st.st_size:
                raise OipError("invalid", f"shared memory region {name!r}: offset {offset} + byte_size "
                                          f"{byte_size} is past the end of key {key!r} ({st.st_size} bytes)")
            self._map = mmap.mmap(fd, offset + byte_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.status = SystemRegionStatus(name, key, offset, byte_size)
        self.byte_size = byte_size

    def read(self, offset: int, n: int) -> bytes:
        start = self.status.offset + offset
        return self._map[start:start + n]

    def write(self, offset: int, data: memoryview) -> None:
        start = self.status.offset + offset
        self._map[start:start + len(data)] = data

    def close(self) -> None:
        self._map.close()


class _CudaRegion:
    """A cudaIpcOpenMemHandle mapping of another process's device allocation, copied through a pinned
    staging buffer of the region's size (cudaMemcpyAsync on the default stream, then synchronised)."""

    kind = "cuda"

    def __init__(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        if len(raw_handle) != 64:
            raise OipError("invalid", f"CUDA shared memory region {name!r}: raw_handle is {len(raw_handle)} "
                                      "bytes, a cudaIpcMemHandle_t is 64")
        if not 0 <= device_id < 1 << 31:
            raise OipError("invalid", f"CUDA shared memory region {name!r}: device_id {device_id} is out of range")
        try:
            rt = runtime.cuda()
            if device_id >= rt.cuda_device_count():
                raise OipError("invalid", f"CUDA shared memory region {name!r}: no device {device_id}")
            known = _fake_handle_bytes(raw_handle)
            if known is not None and byte_size > known:
                raise OipError("invalid", f"CUDA shared memory region {name!r}: byte_size {byte_size} is larger "
                                          f"than the {known}-byte allocation the handle names")
            self.ptr = int(rt.cuda_ipc_open_mem_handle(device_id, raw_handle))
        except (CudaError, runtime.CudaUnavailableError) as e:
            raise OipError("invalid", f"CUDA shared memory region {name!r}: cannot open the handle: {e}") from None
        self._close = weakref.finalize(self, rt.cuda_ipc_close_mem_handle, device_id, self.ptr)
        self._close.atexit = False
        try:
            self._staging = runtime.PinnedBuffer(byte_size)  # mapped, portable
        except (CudaError, ValueError) as e:
            self._close()
            raise OipError("invalid", f"CUDA shared memory region {name!r}: no staging buffer: {e}") from None
        self._rt = rt
        self.status = CudaRegionStatus(name, device_id, byte_size)
        self.byte_size = byte_size

    def read(self, offset: int, n: int) -> bytes:
        try:
            self._rt.cuda_memcpy_async(self._staging.address, self.ptr + offset, n, 0)
            self._rt.cuda_stream_synchronize(0)
        except CudaError as e:
            raise OipError("internal", f"CUDA shared memory region {self.status.name!r}: read failed: {e}") from None
        return self._staging.array()[:n].tobytes()

    def write(self, offset: int, data: memoryview) -> None:
        n = len(data)
        self._staging.array()[:n] = np.frombuffer(data, np.uint8)
        try:
            self._rt.cuda_memcpy_async(self.ptr + offset, self._staging.address, n, 0)
            self._rt.cuda_stream_synchronize(0)
        except CudaError as e:
            raise OipError("internal", f"CUDA shared memory region {self.status.name!r}: write failed: {e}") from None

    def close(self) -> None:
        self._close()  # cudaIpcCloseMemHandle
        self._staging.close()


def _fake_handle_bytes(raw: bytes) -> int | None:
    """The allocation size a fake runtime's handle names (None for a real cudaIpcMemHandle_t, which is opaque)."""
    if runtime.is_fake() and raw.startswith(b"FAKEIPC"):
        return int.from_bytes(raw[8:16], "little")
    return None


class SharedMemory:
    """The registered regions of one front door (HTTP and gRPC share them), under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[str, _SystemRegion | _CudaRegion] = {}

    def _add(self, name: str, make: Callable[[], _SystemRegion | _CudaRegion]) -> None:
        if not name:
            raise OipError("invalid", "a shared memory region needs a name")
        with self._lock:
            if name in self._regions:
                raise OipError("invalid", f"shared memory region {name!r} is already registered; unregister it "
                                          "first")
            if len(self._regions) >= MAX_REGIONS:
                raise OipError("invalid", f"{MAX_REGIONS} shared memory regions are registered, the most this "
                                          "server holds; unregister some")
            self._regions[name] = make()

    def register_system(self, name: str, key: str, offset: int, byte_size: int) -> None:
        _check_size(name, offset, byte_size)
        self._add(name, lambda: _SystemRegion(name, key, offset, byte_size))

    def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        _check_size(name, 0, byte_size)
        self._add(name, lambda: _CudaRegion(name, raw_handle, device_id, byte_size))

    def unregister(self, kind: str, name: str = "") -> None:
        """Unregister region ``name`` of ``kind`` (every one of that kind without a name); an unknown name
        is no error, as in Triton."""
        with self._lock:
            names = [n for n, r in self._regions.items() if r.kind == kind and (not name or n == name)]
            for n in names:
                self._regions.pop(n).close()

    def status(self, kind: str, name: str = "") -> list[Any]:
        with self._lock:
            if name and (name not in self._regions or self._regions[name].kind != kind):
                raise OipError("not_found", f"no {kind} shared memory region {name!r} is registered")
            return [r.status for n, r in sorted(self._regions.items()) if r.kind == kind and (not name or n == name)]

    def close(self) -> None:
        with self._lock:
            for r in self._regions.values():
                r.close()
            self._regions.clear()

    def _region(self, ref: TensorRef, what: str, n: int) -> _SystemRegion | _CudaRegion:
        r = self._regions.get(ref.region)
        if r is None:
            raise OipError("invalid", f"{what}: shared memory region {ref.region!r} is not registered")
        if ref.offset + n > r.byte_size:
            raise OipError("invalid", f"{what}: offset {ref.offset} + {n} bytes is past the end of shared memory "
                                      f"region {ref.region!r} ({r.byte_size} bytes)")
        return r

    def check(self, ref: TensorRef, what: str) -> None:
        """Refuse a reference to an unknown region or one reaching past its end."""
        with self._lock:
            self._region(ref, what, ref.byte_size)

    def read(self, ref: TensorRef, what: str) -> bytes:
        """A copy of the ``byte_size`` bytes ``ref`` names."""
        with self._lock:
            return self._region(ref, what, ref.byte_size).read(ref.offset, ref.byte_size)

    def write(self, ref: TensorRef, arr: np.ndarray, what: str) -> None:
        """Write ``arr`` at ``ref``; refused when it is larger than ``ref.byte_size`` or the region has gone."""
        data = memoryview(np.ascontiguousarray(arr)).cast("B")
        if len(data) > ref.byte_size:
            raise OipError("invalid", f"{what}: {len(data)} bytes do not fit the shared_memory_byte_size "
                                      f"{ref.byte_size} given for it")
        with self._lock:
            if ref.region not in self._regions:
                raise OipError("invalid", f"{what}: shared memory region {ref.region!r} was unregistered while "
                                          "this request used it")
            self._region(ref, what, len(data)).write(ref.offset, data)


def _check_size(name: str, offset: int, byte_size: int) -> None:
    for field, v in (("offset", offset), ("byte_size", byte_size)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 48:
            raise OipError("invalid", f"shared memory region {name!r}: {field} must be a non-negative integer, "
                                      f"got {v!r}")
    if byte_size == 0:
        raise OipError("invalid", f"shared memory region {name!r}: byte_size must be positive")


_registries: weakref.WeakKeyDictionary[Core, SharedMemory] = weakref.WeakKeyDictionary()
_registries_lock = threading.Lock()


def of(core: Core) -> SharedMemory:
    """The regions of ``core``'s front door (one registry per Core, for HTTP and gRPC alike)."""
    with _registries_lock:
        mem = _registries.get(core)
        if mem is None:
            mem = _registries[core] = SharedMemory()
            weakref.finalize(core, mem.close)
        return mem


def local_peer(peer: str) -> bool:
    """Whether a peer address (``127.0.0.1``, aiohttp's ``request.remote``; or grpc's ``ipv4:127.0.0.1:5``,
    ``ipv6:[::1]:5``, ``unix:...``) is this machine's loopback or a Unix socket."""
    if not peer:
        return False
    if peer.startswith(("unix:", "unix-abstract:")):
        return True
    host = peer
    if peer.startswith(("ipv4:", "ipv6:")):
        host = peer.split(":", 1)[1].rsplit(":", 1)[0].strip("[]")
    host = host.split("%", 1)[0]
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _require_local(peer: str) -> None:
    if not local_peer(peer):
        raise OipError("unauthenticated", f"shared memory is for clients on this machine; peer {peer!r} is not "
                                          "loopback")


def _int(v: Any, what: str, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 48:
        raise OipError("invalid", f"{what}: {name} must be a non-negative integer, got {v!r}")
    return v


def ref_from(params: Mapping[str, Any], what: str) -> TensorRef | None:
    """The region a tensor's parameters name (plain values: HTTP JSON), or None."""
    if REGION not in params and BYTE_SIZE not in params:
        return None
    if REGION not in params or BYTE_SIZE not in params:
        raise OipError("invalid", f"{what}: {REGION} and {BYTE_SIZE} go together")
    region = params[REGION]
    if not isinstance(region, str) or not region:
        raise OipError("invalid", f"{what}: {REGION} must be a region's name, got {region!r}")
    return TensorRef(region, _int(params.get(OFFSET, 0), what, OFFSET), _int(params[BYTE_SIZE], what, BYTE_SIZE))


def _grpc_params(params: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in (REGION, OFFSET, BYTE_SIZE):
        if key in params:
            p = params[key]
            which = p.WhichOneof("parameter_choice")
            out[key] = getattr(p, which) if which else None
    return out


# -- inference hooks --------------------------------------------------------------------------------

def http_request(core: Core, peer: str, req: dict[str, Any], binary: memoryview) -> tuple[dict[str, Any], memoryview]:
    """The request with every input in shared memory read into its binary data (in the inputs' order,
    with ``binary_data_size``), so the rest of the door decodes it as any binary request. Unchanged (and
    nothing copied) when no input names a region."""
    inputs = req.get("inputs")
    if not isinstance(inputs, list) or not any(
            isinstance(t, dict) and isinstance(t.get("parameters"), dict) and
            (REGION in t["parameters"] or BYTE_SIZE in t["parameters"]) for t in inputs):
        return req, binary
    _require_local(peer)
    mem = of(core)
    chunks: list[bytes | memoryview] = []
    out_inputs = []
    at = 0
    for t in inputs:
        params = t.get("parameters") if isinstance(t, dict) else None
        if not isinstance(params, dict):
            out_inputs.append(t)
            continue
        what = f"input {t.get('name')!r}"
        ref = ref_from(params, what)
        if ref is not None:
            chunks.append(mem.read(ref, what))
            rest = {k: v for k, v in params.items() if k not in (REGION, OFFSET, BYTE_SIZE)}
            out_inputs.append({**t, "parameters": {**rest, "binary_data_size": ref.byte_size}})
            continue
        size = params.get("binary_data_size")
        if isinstance(size, int) and not isinstance(size, bool) and 0 <= size <= len(binary) - at:
            chunks.append(binary[at:at + size])
            at += size
        out_inputs.append(t)
    chunks.append(binary[at:])  # what no input claims: the door's own check refuses it
    chunks = [c for c in chunks if len(c)]
    joined = chunks[0] if len(chunks) == 1 else b"".join(chunks)  # one input: no second copy
    return {**req, "inputs": out_inputs}, memoryview(joined)


def http_targets(core: Core, peer: str, req: Mapping[str, Any]) -> dict[str, TensorRef]:
    """The requested outputs to be written into shared memory, by name (checked before the inference)."""
    outputs = req.get("outputs")
    if not isinstance(outputs, list):
        return {}
    targets: dict[str, TensorRef] = {}
    for o in outputs:
        params = o.get("parameters") if isinstance(o, dict) else None
        if isinstance(params, dict):
            what = f"output {o.get('name')!r}"
            ref = ref_from(params, what)
            if ref is not None:
                targets[str(o.get("name"))] = ref
    if targets:
        _require_local(peer)
        mem = of(core)
        for name, ref in targets.items():
            mem.check(ref, f"output {name!r}")
    return targets


def put_output(core: Core, ref: TensorRef, name: str, arr: np.ndarray) -> dict[str, Any]:
    """Write output ``name`` into its region; the parameters its description in the answer carries."""
    of(core).write(ref, arr, f"output {name!r}")
    return {REGION: ref.region, BYTE_SIZE: int(arr.nbytes), OFFSET: ref.offset}


def grpc_request(core: Core, ctx: Any, req: Any) -> None:
    """Fill ``req.raw_input_contents`` (a ModelInferRequest of call ``ctx``) with the inputs in shared
    memory, in the inputs' order beside the raw contents of the others; nothing happens (and the peer is
    not asked) when no input names a region."""
    refs = [ref_from(_grpc_params(t.parameters), f"input {t.name!r}") if
            (REGION in t.parameters or BYTE_SIZE in t.parameters) else None for t in req.inputs]
    if not any(refs):
        return
    _require_local(ctx.peer())
    others = sum(r is None for r in refs)
    if len(req.raw_input_contents) != others:
        raise OipError("invalid", f"{len(req.raw_input_contents)} raw_input_contents for the {others} input(s) "
                                  "not in shared memory (with shared memory, the others travel as raw contents)")
    mem = of(core)
    given = iter(list(req.raw_input_contents))
    raws = [mem.read(r, f"input {t.name!r}") if r is not None else next(given) for t, r in zip(req.inputs, refs)]
    del req.raw_input_contents[:]
    req.raw_input_contents.extend(raws)


def grpc_targets(core: Core, ctx: Any, req: Any) -> dict[str, TensorRef]:
    """The requested outputs of a ModelInferRequest (of call ``ctx``) to be written into shared memory,
    checked."""
    targets: dict[str, TensorRef] = {}
    for o in req.outputs:
        if REGION in o.parameters or BYTE_SIZE in o.parameters:
            ref = ref_from(_grpc_params(o.parameters), f"output {o.name!r}")
            assert ref is not None
            targets[o.name] = ref
    if targets:
        _require_local(ctx.peer())
        mem = of(core)
        for name, ref in targets.items():
            mem.check(ref, f"output {name!r}")
    return targets


def grpc_output_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`put_output`'s parameters as InferParameter fields (for InferOutputTensor.parameters)."""
    return {k: {"string_param": v} if isinstance(v, str) else {"int64_param": v} for k, v in params.items()}


# -- the register / unregister / status API ---------------------------------------------------------

def add_http_routes(app: web.Application, core: Core) -> None:
    """Triton's ``/v2/systemsharedmemory/...`` and ``/v2/cudasharedmemory/...`` routes over ``core``'s regions.
    Errors are raised as OipError (the app's middleware answers them)."""
    mem = of(core)

    async def body(request: web.Request) -> dict[str, Any]:
        _require_local(request.remote or "")
        try:
            doc = await request.json()
        except (ValueError, UnicodeDecodeError):
            raise OipError("invalid", "the register request must be a JSON object") from None
        if not isinstance(doc, dict):
            raise OipError("invalid", "the register request must be a JSON object")
        return doc

    async def sys_register(request: web.Request) -> web.Response:
        doc = await body(request)
        name = request.match_info["name"]
        key = doc.get("key")
        if not isinstance(key, str):
            raise OipError("invalid", f"shared memory region {name!r}: 'key' must be a string, got {key!r}")
        mem.register_system(name, key, doc.get("offset", 0), doc.get("byte_size"))
        return web.json_response({})

    async def cuda_register(request: web.Request) -> web.Response:
        doc = await body(request)
        name = request.match_info["name"]
        raw = doc.get("raw_handle")
        b64 = raw.get("b64") if isinstance(raw, dict) else None
        if not isinstance(b64, str):
            raise OipError("invalid", f"CUDA shared memory region {name!r}: 'raw_handle' must be {{\"b64\": ...}}")
        try:
            handle = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            raise OipError("invalid", f"CUDA shared memory region {name!r}: raw_handle is not base64") from None
        device_id = doc.get("device_id", 0)
        if isinstance(device_id, bool) or not isinstance(device_id, int):
            raise OipError("invalid", f"CUDA shared memory region {name!r}: device_id must be an integer")
        mem.register_cuda(name, handle, device_id, doc.get("byte_size"))
        return web.json_response({})

    def unregister(kind: str) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.Response:
            _require_local(request.remote or "")
            mem.unregister(kind, request.match_info.get("name", ""))
            return web.json_response({})
        return handler

    def status(kind: str) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.Response:
            _require_local(request.remote or "")
            return web.json_response([s.__dict__ for s in mem.status(kind, request.match_info.get("name", ""))])
        return handler

    r = app.router
    for kind, base, register in (("system", "/v2/systemsharedmemory", sys_register),
                                 ("cuda", "/v2/cudasharedmemory", cuda_register)):
        r.add_post(base + "/region/{name}/register", register)
        r.add_post(base + "/region/{name}/unregister", unregister(kind))
        r.add_post(base + "/unregister", unregister(kind))
        r.add_get(base + "/region/{name}/status", status(kind))
        r.add_get(base + "/status", status(kind))


def grpc_methods(core: Core, wrap: Callable[[Callable[[Any, Any], Any]], Callable[[Any, Any], Any]]
                 ) -> dict[str, grpc.RpcMethodHandler]:
    """The shared-memory RPCs of ``inference.GRPCInferenceService`` over ``core``'s regions; ``wrap`` turns
    OipError into the call's status (grpc_server._wrap)."""
    mem = of(core)
    pb = shm_pb2

    def sys_status(req: Any) -> Any:
        return pb.SystemSharedMemoryStatusResponse(regions={
            s.name: pb.SystemSharedMemoryStatusResponse.RegionStatus(name=s.name, key=s.key, offset=s.offset,
                                                                     byte_size=s.byte_size)
            for s in mem.status("system", req.name)})

    def sys_register(req: Any) -> Any:
        mem.register_system(req.name, req.key, req.offset, req.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    def cuda_status(req: Any) -> Any:
        return pb.CudaSharedMemoryStatusResponse(regions={
            s.name: pb.CudaSharedMemoryStatusResponse.RegionStatus(name=s.name, device_id=s.device_id,
                                                                   byte_size=s.byte_size)
            for s in mem.status("cuda", req.name)})

    def cuda_register(req: Any) -> Any:
        mem.register_cuda(req.name, req.raw_handle, req.device_id, req.byte_size)
        return pb.CudaSharedMemoryRegisterResponse()

    def unregister(kind: str, answer: Any) -> Callable[[Any], Any]:
        def handler(req: Any) -> Any:
            mem.unregister(kind, req.name)
            return answer()
        return handler

    def local(fn: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
        """An RPC of ``fn`` for callers on this machine only (shared memory is local by nature)."""
        async def handler(req: Any, ctx: Any) -> Any:
            _require_local(ctx.peer())
            return fn(req)
        return handler

    # Each RPC's request and response messages are <name>Request and <name>Response.
    table: dict[str, Callable[[Any], Any]] = {
        "SystemSharedMemoryStatus": sys_status,
        "SystemSharedMemoryRegister": sys_register,
        "SystemSharedMemoryUnregister": unregister("system", pb.SystemSharedMemoryUnregisterResponse),
        "CudaSharedMemoryStatus": cuda_status,
        "CudaSharedMemoryRegister": cuda_register,
        "CudaSharedMemoryUnregister": unregister("cuda", pb.CudaSharedMemoryUnregisterResponse),
    }
    return {name: grpc.unary_unary_rpc_method_handler(
                wrap(local(fn)), request_deserializer=getattr(pb, f"{name}Request").FromString,
                response_serializer=getattr(pb, f"{name}Response").SerializeToString)
            for name, fn in table.items()}
