"""Param-Share for ONNX Runtime on the CPU: one copy of a model's initializers for every session of it.

The first instance of an app (``export:PATH``) reads the initializers of the ONNX file its session
loads (the cache entry's optimized model, or the file itself), copies them into one POSIX
shared-memory object named after the node (:data:`gpuprims.cuda.ipc.ENV_OWNER_PID`, so the node owns
it and unlinks it, exactly as for eager's shared weights) and writes the handles
(:class:`gpuprims.cuda.ipc.ParameterHandles`, one entry per initializer) to PATH. Every instance, the
exporter included, then maps the object and hands each initializer to its session with
``SessionOptions.add_initializer(name, OrtValue)``, the OrtValue made over the mapping by
``OrtValue.ortvalue_from_numpy`` (on the CPU it wraps the array and keeps a reference; nothing is
copied). ONNX Runtime documents ``AddInitializer`` as "ORT will use this initializer instance instead
of deserializing one from the model file ... useful when you want to share the same initializer across
sessions"; the OrtValue must outlive the session, so :class:`SharedInitializers` stays with the engine.

Pre-packing: MLAS re-lays out some weights (MatMul/Gemm B, some Conv) into buffers of the session's
own at load. For a shared initializer that would be a private copy per session again; the C API's
``CreateSessionWithPrepackedWeightsContainer`` shares those too, but the Python API does not expose
it, so a sharing session sets ``session.disable_prepacking`` (measured in bench/share.py).

Nothing here imports torch or onnx's runtime pieces: exporting needs the ``onnx`` package (to read the
initializers); importing needs only numpy and onnxruntime.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import hashlib
import logging
import mmap
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from gpuprims.cuda.ipc import _SHM_DIR, ENV_OWNER_PID, ParameterHandles, TensorEntry

log = logging.getLogger("gpuprims.engines")

_ALIGN = 256
#: Initializer dtypes shared (numpy names, which are also the torch names ParameterHandles uses).
SHARED_DTYPES = frozenset({"float32", "float16", "float64", "int8", "uint8", "int16", "int32", "int64", "bool"})
#: Session config entry that keeps MLAS from re-packing the shared initializers into private buffers.
DISABLE_PREPACKING = "session.disable_prepacking"


@dataclass
class SharedInitializers:
    """A mapping of shared initializers, by name, and the OrtValues the sessions use (keep alive)."""

    mode: Literal["exported", "imported"]
    handles: ParameterHandles
    arrays: dict[str, np.ndarray]
    _mmap: Any = None
    _values: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of initializer data shared."""
        return self.handles.weights_nbytes

    def add_to(self, ort: Any, so: Any) -> None:
        """Give every shared initializer to ``so`` (a SessionOptions), and switch pre-packing off."""
        for name, arr in self.arrays.items():
            if name not in self._values:  # ORT does not own it: it must outlive every session given it
                self._values[name] = ort.OrtValue.ortvalue_from_numpy(arr)
            so.add_initializer(name, self._values[name])
        so.add_session_config_entry(DISABLE_PREPACKING, "1")

    def describe(self) -> dict[str, Any]:
        """For status: how this session got its initializers."""
        return {"mode": self.mode, "initializers": len(self.arrays), "shared_mb": round(self.nbytes / 2**20, 2),
                "segment": self.handles.handle.decode()}


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim``): the parsed model's
    buffers, freed by ONNX Runtime and by :func:`read_initializers`, otherwise stay in the process's
    heap and count in its PSS. A no-op without glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim(ctypes.c_size_t(0))
    except (OSError, AttributeError):
        return


def model_digest(model_path: Path) -> str:
    """SHA-256 (32 hex digits) of an ONNX file: the model a segment's initializers belong to."""
    h = hashlib.sha256()
    with open(model_path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:32]


def _onnx() -> tuple[Any, Any, Any]:
    """onnx, onnx.numpy_helper and onnx.helper (OSError naming the package when it is missing)."""
    try:
        import onnx
        from onnx import helper, numpy_helper
    except ImportError as e:
        raise OSError(f"sharing an ONNX model's initializers needs the onnx package ({e})") from None
    return onnx, numpy_helper, helper


def _shareable(model: Any, helper: Any) -> list[tuple[Any, np.dtype[Any], tuple[int, ...]]]:
    """(initializer, dtype, shape) of the top-level graph's initializers that can be shared."""
    out = []
    for init in model.graph.initializer:
        try:
            dt = np.dtype(helper.tensor_dtype_to_np_dtype(init.data_type))
        except (KeyError, TypeError, ValueError):
            continue
        shape = tuple(int(d) for d in init.dims)
        if dt.name in SHARED_DTYPES and all(d > 0 for d in shape):
            out.append((init, dt, shape))
    return out


def read_initializers(model_path: Path) -> dict[str, np.ndarray]:
    """The top-level graph's initializers of an ONNX file (external data included) that can be shared."""
    onnx, numpy_helper, helper = _onnx()
    model = onnx.load(str(model_path), load_external_data=True)
    return {init.name: numpy_helper.to_array(init, base_dir=str(model_path.parent))
            for init, _, _ in _shareable(model, helper)}


def export_initializers(model_path: Path, handles_path: Path) -> SharedInitializers:
    """Copy ``model_path``'s initializers into a new shared-memory object, write its handles to
    ``handles_path`` atomically, and return the mapping. One initializer at a time is converted, and
    each one's bytes are dropped from the parsed model once copied, so the exporter's peak is about the
    model once, not twice. Raises OSError when there is nothing to share or the object cannot be made."""
    onnx, numpy_helper, helper = _onnx()
    model = onnx.load(str(model_path), load_external_data=True)
    plan = _shareable(model, helper)
    if not plan:
        raise OSError(f"{model_path.name} has no initializers to share")
    entries: list[TensorEntry] = []
    offset = 0
    for init, dt, shape in plan:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        entries.append(TensorEntry((init.name,), "parameter", dt.name, shape, offset, nbytes))
        offset += -(-max(nbytes, 1) // _ALIGN) * _ALIGN
    token = f"{uuid.uuid4().hex}.{model_digest(model_path)}"  # the export, and the model it is of
    owner = os.environ.get(ENV_OWNER_PID, "")
    name = f"gpuprims-params-{owner if owner.isdigit() else os.getpid()}-{token[:12]}"
    fd = os.open(_SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, offset)
        with mmap.mmap(fd, offset, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
            flat = np.frombuffer(mm, dtype=np.uint8)
            for e, (init, dt, shape) in zip(entries, plan):
                arr = numpy_helper.to_array(init, base_dir=str(model_path.parent))
                if arr.dtype != dt or tuple(arr.shape) != shape:
                    raise OSError(f"initializer {init.name!r} of {model_path.name} reads as {arr.dtype} "
                                  f"{tuple(arr.shape)}, its header says {dt} {shape}")
                flat[e.offset:e.offset + e.nbytes] = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
                del arr
                init.Clear()  # the parsed copy of these bytes goes now
            del flat
    except BaseException:
        os.unlink(_SHM_DIR / name)
        raise
    finally:
        os.close(fd)
    del model, plan
    trim_heap()
    handles = ParameterHandles("cpu", token, os.getpid(), offset, name.encode(), "", tuple(entries))
    tmp = f"{handles_path}.{os.getpid()}"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(handles.to_bytes())
    os.replace(tmp, handles_path)  # importers never see a partial file
    shared = map_initializers(handles, model_path)
    shared.mode = "exported"
    return shared


def map_initializers(handles: ParameterHandles | bytes, model_path: Path | None = None) -> SharedInitializers:
    """Map exported initializers (copy-on-write mapping: ORT gets writable arrays, yet never writes
    initializers, so every page stays the segment's). ValueError when the export is gone or malformed,
    or (given ``model_path``) is of another model file: ORT does not check a given initializer's shape
    against the graph at load, so a segment of another model must never reach a session."""
    if not isinstance(handles, ParameterHandles):
        handles = ParameterHandles.from_bytes(handles)
    if handles.backend != "cpu":
        raise ValueError(f"ONNX Runtime initializers are shared through CPU shared memory, got {handles.backend!r}")
    if model_path is not None:
        _, _, digest = handles.token.partition(".")
        if digest != model_digest(model_path):
            raise ValueError(f"the shared initializers are of another model than {model_path.name} "
                             f"(digest {digest or 'none'})")
    path = _SHM_DIR / handles.handle.decode()
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise ValueError(f"shared initializers {path} do not exist (the export was released)") from None
    try:
        size = os.fstat(fd).st_size
        if size < handles.nbytes:
            raise ValueError(f"{path} holds {size} bytes, less than the {handles.nbytes} exported")
        mm = mmap.mmap(fd, handles.nbytes, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    flat = np.frombuffer(mm, dtype=np.uint8)
    arrays = {e.names[0]: flat[e.offset:e.offset + e.nbytes].view(np.dtype(e.dtype)).reshape(e.shape)
              for e in handles.entries}
    return SharedInitializers("imported", handles, arrays, mm)


class InitializerSource:
    """Where an instance's ONNX Runtime sessions take their initializers from: the node's Param-Share
    mode (``export:PATH`` for the first instance of the weights, ``import:PATH`` after that). The
    mapping is made once and reused by every session of the instance (a shadow's engine is made again
    for its share's threads)."""

    def __init__(self, mode: Literal["export", "import"], path: str, wait: Callable[[str], bytes],
                 error_suffix: str = ".error") -> None:
        self.mode = mode
        self.path = path
        self._wait = wait
        self._error_path = Path(path + error_suffix)
        self.shared: SharedInitializers | None = None

    @classmethod
    def parse(cls, share_params: str | None, wait: Callable[[str], bytes]) -> InitializerSource | None:
        """From an instance spec's ``share_params``; None without one. ValueError on another form."""
        if not share_params:
            return None
        mode, _, path = share_params.partition(":")
        if mode not in ("export", "import") or not path:
            raise ValueError(f"share_params must be 'export:PATH' or 'import:PATH', got {share_params!r}")
        return cls("export" if mode == "export" else "import", path, wait)

    def get(self, model_path: Path) -> SharedInitializers:
        """The shared initializers of ``model_path`` (exported here, or mapped). An exporter that fails
        writes the reason beside the handles' path, so importers waiting for them fail with it."""
        if self.shared is None:
            if self.mode == "export":
                try:
                    self.shared = export_initializers(model_path, Path(self.path))
                except (OSError, ValueError) as e:
                    with contextlib.suppress(OSError):
                        self._error_path.write_text(f"{type(e).__name__}: {e}")
                    raise
            else:
                self.shared = map_initializers(self._wait(self.path), model_path)
        return self.shared


def take_shared(source: InitializerSource | None, model_path: Path, provider: str,
                who: str) -> tuple[SharedInitializers | None, str | None]:
    """The shared initializers a session of ``model_path`` should use, or (None, why not): none asked
    for, a GPU provider (device initializers are not shared yet: docs/primitives.md), or a failure to
    export or map them, after which the session loads its own copy (logged once)."""
    if source is None:
        return None, None
    if provider != "cpu":
        return None, f"provider {provider!r}: ONNX Runtime initializers are shared on the CPU provider only"
    try:
        return source.get(model_path), None
    except (OSError, ValueError, RuntimeError, TimeoutError) as e:
        log.warning("%s: cannot share the initializers of %s (%s: %s); this session loads its own copy", who,
                    model_path.name, type(e).__name__, e)
        return None, f"{type(e).__name__}: {e}"


@runtime_checkable
class SharesInitializers(Protocol):
    """An engine whose ONNX Runtime session can take shared initializers (set before prepare)."""

    initializers_from: InitializerSource | None
    shared: SharedInitializers | None


def open_session(make: Callable[[SharedInitializers | None], Any], shared: SharedInitializers | None,
                 why: str | None, who: str) -> tuple[Any, SharedInitializers | None, str | None]:
    """``make(shared)``, and if a session over the shared initializers fails (a segment of another
    model: a name or shape that does not fit), ``make(None)``: the session loads its own copy rather
    than the instance falling back to another engine. Returns (session, shared or None, why not)."""
    if shared is None:
        return make(None), None, why
    try:
        return make(shared), shared, None
    except ValueError as e:  # (EngineError) a refusal of the shared initializers: load our own
        log.warning("%s: a session over the shared initializers failed (%s: %s); loading its own copy", who,
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return make(None), None, f"{type(e).__name__}: {e}"
