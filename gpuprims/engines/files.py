"""Engines that run a model *file* (ONNX, OpenVINO IR, TorchScript, torch.export, a TensorRT plan) with any
named tensors: the interface, the registry and the batching helpers the serving loop uses.

The engines of :mod:`gpuprims.engines.base` run zoo torch modules on one ``(n, C, H, W)`` float32 input;
these run the file a user brings, with the inputs and outputs its :class:`~gpuprims.tensors.ModelSignature`
names, numpy in and numpy out (BF16 as its uint16 bits):

- :meth:`FileEngine.check` (a class method, no build, no engine library imported): can this kind run on
  this backend with these options? Raises :class:`EngineUnavailable` with the reason.
- :meth:`FileEngine.prepare`: load the file (and where the library can save an optimised artefact, build
  it once and keep it in the engine cache under the file's content hash, the options, the library
  versions and the device, so a second start is a cache hit). The file's own inputs and outputs are
  checked against the signature here: a name or datatype that disagrees is an :class:`EngineError`
  naming the tensor. Never on the serving path.
- :meth:`FileEngine.run`: one whole batch (with the leading batch dimension when ``signature.batched``,
  else exactly the per-request shapes) to the outputs named as the signature names them.
- :meth:`FileEngine.describe`: what status shows.

A request tensor whose shape or datatype does not fit the signature is a
:class:`~gpuprims.tensors.SignatureError` (the request's fault); anything the engine cannot do is an
:class:`EngineError` (the model's or the configuration's).

Importing this module imports numpy, never torch nor an engine library.
"""

from __future__ import annotations

import abc
import hashlib
import importlib
import importlib.util
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from gpuprims.engines.base import BuildInfo, EngineError, EngineUnavailable, KindOptions, Target
from gpuprims.engines.cache import EngineCache, device_identity, fingerprint, library_versions
from gpuprims.engines.kinds import FILE_ENGINE_KINDS, EngineKind, file_engine_kind
from gpuprims.tensors import DataType, ModelSignature, SignatureError, TensorSpec

#: Every kind a model file may be served by: the kinds table (:data:`gpuprims.engines.kinds.FILE_ENGINE_KINDS`).
FILE_KINDS: dict[str, EngineKind] = FILE_ENGINE_KINDS
#: The kind that serves a file by default, by its suffix (Triton's default file names: model.onnx,
#: model.plan, model.pt, model.pt2; OpenVINO's IR is model.xml beside model.bin).
DEFAULT_KIND_BY_SUFFIX: dict[str, str] = {
    ".onnx": "onnxruntime", ".xml": "openvino", ".pt": "torchscript", ".pth": "torchscript",
    ".pt2": "torch_export", ".plan": "tensorrt", ".engine": "tensorrt",
}
#: What a file of each suffix is, for messages that say why a kind does not take it.
FILE_TYPES: dict[str, str] = {
    ".onnx": "an ONNX model", ".xml": "an OpenVINO IR model", ".pt": "a TorchScript archive",
    ".pth": "a TorchScript archive", ".pt2": "a torch.export program", ".plan": "a TensorRT plan",
    ".engine": "a TensorRT plan",
}


#: The suffixes each kind takes (the classes' ``suffixes``, here too so that choosing a kind imports none).
_SUFFIXES: dict[str, tuple[str, ...]] = {
    "onnxruntime": (".onnx",), "openvino": (".onnx", ".xml"), "torchscript": (".pt", ".pth"),
    "torch_export": (".pt2",), "compile": (".pt2",), "tensorrt": (".plan", ".engine"),
}


def default_file_kind(path: str | Path) -> str:
    """The kind that serves ``path`` when the configuration names none (by its suffix); EngineError
    names the suffixes known."""
    suffix = Path(path).suffix.lower()
    kind = DEFAULT_KIND_BY_SUFFIX.get(suffix)
    if kind is None:
        raise EngineError(f"model file {str(path)!r}: no engine serves {suffix or 'files without a suffix'} "
                          f"(known: {', '.join(DEFAULT_KIND_BY_SUFFIX)})")
    return kind


def file_kinds_for(path: str | Path) -> list[str]:
    """Every kind that takes ``path`` by its suffix (the default first); builds and imports nothing."""
    suffix = Path(path).suffix.lower()
    default = DEFAULT_KIND_BY_SUFFIX.get(suffix)
    takes = [k for k in FILE_KINDS if suffix in _SUFFIXES.get(k, ())]
    return sorted(takes, key=lambda k: k != default)


def resolve_file_kind(kind: str | None, path: str | Path) -> str:
    """The file engine kind an app's ``engine:`` means for ``path``: a file kind as it is; None, or
    ``eager`` for a torch file (the file run by torch as it is: ``torchscript`` for .pt, ``torch_export``
    for .pt2), the file's default kind. Anything else is an EngineError naming the kinds that take the
    file."""
    if kind in FILE_KINDS:
        return kind  # type: ignore[return-value]
    suffix = Path(path).suffix.lower()
    if kind is None or (kind == "eager" and suffix in (".pt", ".pth", ".pt2")):
        return default_file_kind(path)
    takes = file_kinds_for(path)
    raise EngineError(f"engine {kind!r} does not run model files like {Path(path).name}; "
                      + (f"it runs on {', '.join(takes)}" if takes else f"known file kinds: {', '.join(FILE_KINDS)}"))


def file_fingerprint(path: str | Path, related: Sequence[str | Path] = ()) -> str:
    """SHA-256 (32 hex digits) of the model file's bytes and of the ``related`` files it loads (an ONNX
    model's external data); for OpenVINO IR also of its weights (``.bin`` beside the ``.xml``), which
    change the model as much as the graph does."""
    p = Path(path)
    h = hashlib.sha256()
    files = [p, *(Path(r) for r in related)]
    if p.suffix.lower() == ".xml" and p.with_suffix(".bin").is_file():
        files.append(p.with_suffix(".bin"))
    try:
        for f in files:
            h.update(f.name.encode())
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    except OSError as e:
        raise EngineError(f"model file {str(p)!r} cannot be read: {e.strerror or e}") from e
    return h.hexdigest()[:32]


def first_line(e: BaseException) -> str:
    """``Type: first line of the message``: a library's multi-line error in one line."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")


class FileEngine(KindOptions, abc.ABC):
    """One model file on one device, named tensors in and out (see the module docstring).

    Subclasses set :attr:`kind`, :attr:`backends`, :attr:`option_defaults`, :attr:`tolerance`,
    :attr:`suffixes` and :attr:`libraries`, and implement :meth:`_prepare` and :meth:`_run`.
    """

    #: (rtol, atol) within which this engine's floating outputs equal the file run directly in its own
    #: runtime (tests/gpuprims/engines/test_files.py holds every kind to it).
    tolerance: ClassVar[tuple[float, float]] = (1e-5, 1e-6)
    #: The file suffixes this kind takes (lower case, with the dot).
    suffixes: ClassVar[tuple[str, ...]] = ()
    #: The python packages the kind needs (check() refuses without them; their versions key the cache).
    libraries: ClassVar[tuple[str, ...]] = ()
    #: The install line check() gives when a library is missing.
    install_hint: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "spec" in cls.__dict__ and cls.spec is not None:
            cls.libraries = cls.spec.libraries
            cls.install_hint = cls.spec.install_hint

    def __init__(self, path: str | Path, signature: ModelSignature, target: Target,
                 options: Mapping[str, Any] | None = None, fingerprint: str | None = None) -> None:
        self.check(target.backend, options)
        if not isinstance(signature, ModelSignature):
            raise EngineError(f"engine {self.kind!r}: signature must be a ModelSignature, got {signature!r}")
        for spec in (*signature.inputs, *signature.outputs):
            if spec.datatype is DataType.BYTES:
                raise EngineError(f"engine {self.kind!r}: tensor {spec.name!r} is BYTES, which no engine takes yet")
        self.path = Path(path)
        suffix = self.path.suffix.lower()
        if suffix not in self.suffixes:
            what = FILE_TYPES.get(suffix, f"a {suffix or 'suffix-less'} file")
            other = DEFAULT_KIND_BY_SUFFIX.get(suffix)
            hint = f" (use engine {other!r})" if other is not None and other != self.kind else ""
            raise EngineError(f"engine {self.kind!r} runs {' or '.join(self.suffixes)} files; {self.path.name} is "
                              f"{what}{hint}")
        if not self.path.is_file():
            raise EngineError(f"engine {self.kind!r}: model file {str(self.path)!r} does not exist")
        self.signature = signature
        self.target = target
        self.options = self.validate_options(options)
        self.given_fingerprint = fingerprint
        self.info = BuildInfo()
        self.prepared = False
        self.runs = 0

    # -- configuration -----------------------------------------------------------------------------------
    @classmethod
    def check(cls, backend: str, options: Mapping[str, Any] | None = None) -> None:
        """Raise :class:`EngineUnavailable` when this kind cannot run on ``backend`` or its library is
        missing, :class:`EngineError` for bad options. Builds nothing and imports no engine library."""
        super().check(backend, options)
        if cls.spec is not None:  # the kinds table's row checked the libraries too
            return
        for lib in cls.libraries:
            if importlib.util.find_spec(lib) is None:
                raise EngineUnavailable(f"engine {cls.kind!r} needs the {lib} package"
                                        + (f": {cls.install_hint}" if cls.install_hint else ""))

    # -- identity ----------------------------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        """The model file's content hash: the caller's, else computed from the file once."""
        if self.given_fingerprint is None:
            self.given_fingerprint = file_fingerprint(self.path, self.related_files())
        return self.given_fingerprint

    def related_files(self) -> list[Path]:
        """The other files loading the model reads (an ONNX model's external data), for the fingerprint."""
        return []

    def device_identity(self) -> dict[str, Any]:
        """The device an artefact is built for (the cache key's ``device``)."""
        return device_identity(self.target)

    def cache_key(self, extra: Mapping[str, Any] | None = None) -> str:
        """The engine cache key of this file's artefact: the file's content, the kind and options, the
        signature (its shapes shape a build), the library versions and the device. The threads a share
        gives are not in it (they change no artefact), so a change of share finds the same entry."""
        return fingerprint({"file_kind": self.kind, "file": self.fingerprint, "options": dict(self.options),
                            "signature": self.signature.to_dict(), "libraries": library_versions(*self.libraries),
                            "device": self.device_identity(), "extra": dict(extra or {})})

    # -- life cycle --------------------------------------------------------------------------------------
    def prepare(self, cache: EngineCache | None = None) -> BuildInfo:
        """Load the file (building and caching an optimised artefact where the library makes one, or
        taking it from ``cache``: the default cache when None) and check it against the signature;
        returns what happened. Idempotent. Raises :class:`EngineError` naming the file and the reason."""
        if self.prepared:
            return self.info
        t0 = time.perf_counter()
        self._prepare(cache if cache is not None else EngineCache())
        self.prepared = True
        if not self.info.build_ms and not self.info.load_ms:
            self.info.load_ms = (time.perf_counter() - t0) * 1e3
        if self.info.fingerprint is None:
            self.info.fingerprint = self.fingerprint
        return self.info

    @abc.abstractmethod
    def _prepare(self, cache: EngineCache) -> None:
        """Load (or build and cache) the model, check it against the signature, fill ``self.info``."""

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Run one whole batch: ``inputs`` by name (each with the leading batch dimension when the
        signature is batched, else exactly a request's shapes), returns ``outputs`` (default: every
        output of the signature) by name, as numpy arrays the caller owns. ``reshape`` in the signature
        applies both ways. Raises :class:`SignatureError` for tensors that do not fit the signature,
        :class:`EngineError` when the model fails."""
        if not self.prepared:
            raise EngineError(f"engine {self.kind!r} is not prepared: call prepare() first")
        feed = self.model_inputs(inputs)
        wanted = self.wanted_outputs(outputs)
        try:
            got = self._run(feed, wanted)
        except (EngineError, SignatureError):
            raise
        except Exception as e:
            raise EngineError(f"engine {self.kind!r} failed to run {self.path.name}: {self.error_text(e)}") from e
        self.runs += 1
        return self.request_outputs(got, wanted)

    def error_text(self, e: BaseException) -> str:
        """A library's error from a run, in one line (the first of its message, unless a kind knows better)."""
        return first_line(e)

    @abc.abstractmethod
    def _run(self, feed: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        """Run the model on ``feed`` (the shapes the model sees) to the ``outputs`` named."""

    # -- the tensors at the boundary ---------------------------------------------------------------------
    def model_inputs(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``inputs`` checked against the signature (names, datatypes, per-request dims, one batch size
        within max_batch_size) and reshaped to what the model sees (``reshape``); contiguous arrays."""
        sig = self.signature
        for name in inputs:
            sig.input(name)  # SignatureError names the unknown one and the model's inputs
        batch: int | None = None
        feed: dict[str, np.ndarray] = {}
        for spec in sig.inputs:
            arr = inputs.get(spec.name)
            if arr is None:
                if spec.optional:
                    continue
                raise SignatureError(f"missing input {spec.describe()}")
            arr = np.asarray(arr)
            want = spec.datatype.numpy
            if arr.dtype.newbyteorder("=") != want.newbyteorder("=") or arr.dtype.byteorder == ">":
                raise SignatureError(f"input {spec.name!r} has numpy dtype {arr.dtype}, the model wants "
                                     f"{spec.datatype.value} ({want})")
            shape = tuple(int(d) for d in arr.shape)
            if sig.batched:
                if not shape or not 1 <= shape[0] <= sig.max_batch_size:
                    raise SignatureError(f"input {spec.name!r} has shape {_shape(shape)}: a batch of 1.."
                                         f"{sig.max_batch_size} rows of [{','.join(map(str, spec.dims))}] is wanted")
                if batch is not None and shape[0] != batch:
                    raise SignatureError(f"input {spec.name!r} has {shape[0]} rows, the other inputs {batch}")
                batch = shape[0]
                per = shape[1:]
            else:
                per = shape
            if not spec.accepts(per):
                raise SignatureError(f"input {spec.name!r} has per-request shape {_shape(per)}, the model wants "
                                     f"[{','.join(map(str, spec.dims))}] (-1: any size)")
            if spec.reshape is not None:
                lead = shape[:1] if sig.batched else ()
                try:
                    arr = arr.reshape(*lead, *spec.reshape)
                except ValueError as e:
                    raise SignatureError(f"input {spec.name!r} of shape {_shape(per)} does not reshape to "
                                         f"{_shape(spec.reshape)}: {e}") from None
            feed[spec.name] = np.ascontiguousarray(arr)
        return feed

    def wanted_outputs(self, outputs: Sequence[str] | None) -> list[str]:
        """The outputs to compute: the signature's, or those named (each checked)."""
        if outputs is None:
            return [s.name for s in self.signature.outputs]
        names = list(outputs)
        for name in names:
            self.signature.output(name)
        return names

    def request_outputs(self, got: Mapping[str, np.ndarray], wanted: Sequence[str]) -> dict[str, np.ndarray]:
        """The model's outputs as the signature names and shapes them: each of its datatype (else
        EngineError), reshaped back from ``reshape`` to ``dims``."""
        out: dict[str, np.ndarray] = {}
        for name in wanted:
            spec = self.signature.output(name)
            if name not in got:
                raise EngineError(f"engine {self.kind!r}: {self.path.name} gave no output {name!r} "
                                  f"(it gave {sorted(got)})")
            arr = np.asarray(got[name])
            want = spec.datatype.numpy
            if arr.dtype.newbyteorder("=") != want.newbyteorder("="):
                raise EngineError(f"engine {self.kind!r}: output {name!r} of {self.path.name} is {arr.dtype}, "
                                  f"the signature says {spec.datatype.value} ({want})")
            if spec.reshape is not None:
                arr = _reshape_back(arr, spec, self.signature.batched)
            out[name] = arr
        return out

    # -- the file's own signature ------------------------------------------------------------------------
    def check_file_signature(self, inputs: Mapping[str, tuple[DataType | None, tuple[int | None, ...] | None]],
                             outputs: Mapping[str, tuple[DataType | None, tuple[int | None, ...] | None]]) -> None:
        """Check what the file says it takes and gives (name -> (datatype or None when unknown, shape with
        None for a dynamic dimension, or None when unknown)) against the signature: every signature
        tensor present in the file with its datatype and a shape that fits; every required file input
        in the signature. Raises :class:`EngineError` naming the first disagreement."""
        where = f"engine {self.kind!r}: {self.path.name}"
        sig = self.signature
        for what, specs, have in (("input", sig.inputs, inputs), ("output", sig.outputs, outputs)):
            for spec in specs:
                if spec.name not in have:
                    raise EngineError(f"{where} has no {what} {spec.name!r} (its {what}s: "
                                      f"{', '.join(repr(n) for n in have) or 'none'}); the signature wants "
                                      f"{spec.describe()}")
                dtype, shape = have[spec.name]
                if dtype is not None and dtype is not spec.datatype:
                    raise EngineError(f"{where}: {what} {spec.name!r} is {dtype.value} in the file, the signature "
                                      f"says {spec.datatype.value}")
                if shape is not None:
                    model_dims = spec.reshape if spec.reshape is not None else spec.dims
                    want = ((-1,) if sig.batched else ()) + tuple(model_dims)
                    if len(shape) != len(want) or any(s is not None and w != -1 and s != w
                                                      for s, w in zip(shape, want)):
                        shown = ["?" if s is None else str(s) for s in shape]
                        raise EngineError(f"{where}: {what} {spec.name!r} has shape [{','.join(shown)}] in the file, "
                                          f"the signature gives [{','.join(map(str, want))}]"
                                          + (" (with the batch dimension first: max_batch_size "
                                             f"{sig.max_batch_size})" if sig.batched else " (max_batch_size 0)"))
                    if what == "input" and sig.batched and shape and shape[0] is not None \
                            and shape[0] < sig.max_batch_size:
                        raise EngineError(f"{where}: input {spec.name!r} has a fixed first dimension of {shape[0]}, "
                                          f"so it takes no batch of up to {sig.max_batch_size} (max_batch_size): "
                                          "export the model with a dynamic batch axis, or set max_batch_size 0")
        names = {s.name for s in sig.inputs}
        extra = [n for n in inputs if n not in names]
        if extra:
            raise EngineError(f"{where} takes input(s) {extra} that the signature does not name")

    # -- status and cleanup ------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """What status shows about this engine."""
        return {"kind": self.kind, "path": str(self.path), "options": dict(self.options),
                "backend": self.target.backend, "threads": self.target.threads, "prepared": self.prepared,
                "tolerance": list(self.tolerance), "runs": self.runs, "signature": self.signature.to_dict(),
                **self.info.to_dict()}

    def close(self) -> None:
        """Release what the engine holds (sessions, modules, device memory). Idempotent; subclasses that
        hold something release it and call this."""
        self.prepared = False

    def __enter__(self) -> FileEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _shape(shape: Sequence[int] | None) -> str:
    """``[3,4]``: a shape as the signature's messages write dims."""
    return "[" + ",".join(str(int(d)) for d in (shape or ())) + "]"


def _reshape_back(arr: np.ndarray, spec: TensorSpec, batched: bool) -> np.ndarray:
    lead = arr.shape[:1] if batched else ()
    try:
        return arr.reshape(*lead, *spec.dims)
    except ValueError as e:
        raise EngineError(f"output {spec.name!r} of shape {_shape(arr.shape)} does not reshape back to "
                          f"[{','.join(map(str, spec.dims))}]: {e}") from None


# -- the registry ----------------------------------------------------------------------------------------
def file_engine_class(kind: str) -> type[FileEngine]:
    """The class implementing ``kind`` (its module imported now); raises :class:`EngineError` naming the
    known kinds."""
    return file_engine_kind(kind).load()  # type: ignore[no-any-return]


def check_file_engine(kind: str, backend: str, options: Mapping[str, Any] | None = None) -> None:
    """Validate a file engine kind and its options for ``backend`` without building anything or importing
    the engine's module (:data:`~gpuprims.engines.kinds.FILE_ENGINE_KINDS`)."""
    file_engine_kind(kind).check(backend, options)


def make_file_engine(kind: str | None, path: str | Path, signature: ModelSignature, target: Target,
                     options: Mapping[str, Any] | None = None, fingerprint: str | None = None) -> FileEngine:
    """An unprepared engine for the file (call :meth:`FileEngine.prepare` before :meth:`FileEngine.run`):
    ``kind`` as :func:`resolve_file_kind` reads it. ``fingerprint``: the file's content hash, when the
    caller has it."""
    return file_engine_class(resolve_file_kind(kind, path))(path, signature, target, options, fingerprint)


# -- batching requests of a batched model -----------------------------------------------------------------
def _group_key(request: Mapping[str, np.ndarray]) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    return tuple(sorted((name, tuple(np.shape(a)), np.asarray(a).dtype.str) for name, a in request.items()))


def batch_groups(requests: Sequence[Mapping[str, np.ndarray]]) -> list[list[int]]:
    """Indices of ``requests`` grouped by identical input names, shapes and dtypes (only those can be
    stacked into one batch). Groups come in the order of their first request; indices keep their order."""
    groups: dict[tuple[tuple[str, tuple[int, ...], str], ...], list[int]] = {}
    for i, req in enumerate(requests):
        groups.setdefault(_group_key(req), []).append(i)
    return list(groups.values())


def stack(requests: Sequence[Mapping[str, np.ndarray]], idx: Sequence[int]) -> dict[str, np.ndarray]:
    """The requests at ``idx`` (one group of :func:`batch_groups`) stacked into one batch, each input
    with a new leading dimension of ``len(idx)`` rows in the order of ``idx``."""
    if not len(idx):
        raise ValueError("stack needs at least one request")
    first = _group_key(requests[idx[0]])
    for i in idx[1:]:
        if _group_key(requests[i]) != first:
            raise ValueError(f"request {i} has other input names, shapes or dtypes than request {idx[0]}: "
                             "only requests of one batch_groups group stack")
    return {name: np.stack([np.asarray(requests[i][name]) for i in idx]) for name in requests[idx[0]]}


def split(outputs: Mapping[str, np.ndarray], n: int) -> list[dict[str, np.ndarray]]:
    """A batch's outputs back into ``n`` requests' outputs (row ``i`` of each, along dim 0). Raises
    :class:`EngineError` when an output's first dimension is not the batch of ``n`` (a model whose
    outputs are not batched must have max_batch_size 0)."""
    for name, arr in outputs.items():
        shape = np.shape(arr)
        if not shape or shape[0] != n:
            raise EngineError(f"output {name!r} has shape {_shape(shape)}: its first dimension is not the batch of "
                              f"{n} requests, so it cannot be split per request (a model whose outputs are not "
                              "batched needs max_batch_size: 0)")
    return [{name: arr[i] for name, arr in outputs.items()} for i in range(n)]
