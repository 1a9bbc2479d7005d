"""Every engine kind an app's ``engine:`` may name, as a table the node validates against without
importing any engine's implementation (and so without torch or an engine library).

Each :class:`EngineKind` says what a kind takes and costs: its options with their defaults and the
checks of their values, the backends it runs on, the Python packages it needs (looked up, not
imported), whether its instances run torch, and the ``module:Class`` that implements it, imported
only when an instance builds the engine (:meth:`EngineKind.load`). Two tables:

- :data:`ENGINE_KINDS`: the engines of a zoo or ``module:factory`` model (:mod:`gpuprims.engines.base`);
- :data:`FILE_ENGINE_KINDS`: the engines of a model file (:mod:`gpuprims.engines.files`).

The engine classes take their option checks from here (``Engine.validate_options``/``check``), so a
rule is written once. ``needs_torch`` is what an instance of the kind imports to serve: the fork server
it is forked from preloads torch only for those (``orchestrator.node.launcher``). A zoo model on a kind that
does not need torch still needs it once, to export the model (``gpuprims-engine build``, or the first
start); a model file on such a kind never does.

Importing this module imports neither torch, numpy nor any engine library.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from gpuprims.engines.errors import EngineError, EngineUnavailable

__all__ = ["BACKENDS", "ENGINE_KINDS", "FILE_ENGINE_KINDS", "EngineKind", "engine_kind", "file_engine_kind"]

#: Backends an instance runs on (``auto`` is resolved by the node before an engine is made).
BACKENDS = ("cpu", "cuda")

#: onnxruntime's providers by option value, and its graph optimization levels.
ORT_PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider",
                 "tensorrt": "TensorrtExecutionProvider"}
ORT_OPTIMIZATION_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC",
                           "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}
PRECISIONS = ("fp32", "fp16")
#: OpenVINO's performance hints by option value.
OV_HINTS = {"latency": "LATENCY", "throughput": "THROUGHPUT"}
#: torch.compile's modes; its compilers: inductor, and aot_eager (traces and runs the graph with eager
#: kernels, compiling nothing: for checking a model traces, in seconds rather than minutes); the batch
#: buckets engine: compile builds.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILERS = ("inductor", "aot_eager")
COMPILE_BUCKETS = ("pow2", "all", "max")
#: cudagraph's stream modes and the most streams an Opara plan may use.
STREAM_MODES = ("single", "opara")
#: far above any plan of the zoo (GoogLeNet: 28, BERT: 25).
MAX_STREAMS = 256
#: The largest ``repeats`` accepted (profiling runs per subgraph and device, at prepare).
MAX_REPEATS = 1000
#: The most CPU cores chrion's option ``cores`` may ask for.
MAX_CORES = 256
TENSORRT_INSTALL = ("engine 'tensorrt' needs the tensorrt package (TensorRT 10 or 11): install it on the GPU host "
                    "with pip install 'gpuprims[gpu-engines]'")

#: check(kind, options): value checks of a kind's options (defaults filled in); raises EngineError.
ValueCheck = Callable[[str, dict[str, Any]], None]
#: check(kind, backend, options): what a kind needs of the backend beyond the list; raises EngineUnavailable.
BackendCheck = Callable[[str, str, dict[str, Any]], None]


@dataclass(frozen=True)
class EngineKind:
    """One kind of engine: what ``engine: <name>`` takes, where it runs and what it imports."""

    name: str
    #: ``module:Class`` implementing it, imported by :meth:`load` (at build time, in the instance).
    impl: str
    #: Whether the engine runs the model with torch, so its instance imports torch to serve. (A zoo app's
    #: instance imports torch whatever its kind today: its gather makes torch tensors.)
    needs_torch: bool
    backends: tuple[str, ...] = BACKENDS
    #: Every option the kind takes, with its default: anything else is refused by name.
    options: Mapping[str, Any] = field(default_factory=dict)
    #: Python packages the kind needs (looked up with find_spec, never imported here).
    libraries: tuple[str, ...] = ()
    #: What a missing library's error says to do.
    install_hint: str = ""
    values: ValueCheck | None = None
    backend_check: BackendCheck | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    def validate_options(self, options: Mapping[str, Any] | None) -> dict[str, Any]:
        """The options with defaults filled in; unknown keys and bad values are refused by name."""
        if options is not None and not isinstance(options, Mapping):
            raise EngineError(f"engine {self.name!r}: options must be a mapping, got {options!r}")
        given = dict(options or {})
        unknown = sorted(set(given) - set(self.options))
        if unknown:
            allowed = ", ".join(sorted(self.options)) or "none"
            raise EngineError(f"engine {self.name!r} has no option(s) {unknown} (it takes: {allowed})")
        opts = {**self.options, **given}
        if self.values is not None:
            self.values(self.name, opts)
        return opts

    def check(self, backend: str, options: Mapping[str, Any] | None = None) -> None:
        """Raise :class:`EngineUnavailable` when this kind cannot run on ``backend`` or a library it
        needs is not installed, :class:`EngineError` for bad options. Builds and imports nothing."""
        if backend not in self.backends:
            raise EngineUnavailable(f"engine {self.name!r} needs the {' or '.join(self.backends)} backend; "
                                    f"this node runs on {backend}")
        opts = self.validate_options(options)
        if self.backend_check is not None:
            self.backend_check(self.name, backend, opts)
        for lib in self.libraries:
            if not _installed(lib):
                raise EngineUnavailable(f"engine {self.name!r} needs the {lib} package"
                                        + (f": {self.install_hint}" if self.install_hint else ""))

    def load(self) -> Any:
        """The class implementing the kind (its module imported now: torch too, where it needs it)."""
        module, _, name = self.impl.partition(":")
        return getattr(importlib.import_module(module), name)


def _installed(lib: str) -> bool:
    loaded = sys.modules.get(lib)
    if loaded is not None and getattr(loaded, "__spec__", None) is None:
        return True  # a module put in sys.modules without a spec (a test's stand-in); find_spec raises on it
    return importlib.util.find_spec(lib) is not None


def _one_of(kind: str, opts: dict[str, Any], key: str, allowed: Mapping[str, Any] | tuple[str, ...]) -> None:
    if opts[key] not in allowed:
        raise EngineError(f"engine {kind!r}: {key} must be one of {', '.join(allowed)}, got {opts[key]!r}")


def _int_in(kind: str, opts: dict[str, Any], key: str, lo: int, hi: int | None, what: str = "",
            none_ok: bool = False) -> None:
    v = opts[key]
    if v is None and none_ok:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        span = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
        raise EngineError(f"engine {kind!r} option {key}{what} must be an integer {span}"
                          + (" or null" if none_ok else "") + f", got {v!r}")


# -- the option checks of each kind ------------------------------------------------------------------------
def _ort_values(kind: str, opts: dict[str, Any]) -> None:
    _one_of(kind, opts, "provider", ORT_PROVIDERS)
    _one_of(kind, opts, "optimization", ORT_OPTIMIZATION_LEVELS)
    _one_of(kind, opts, "precision", PRECISIONS)
    if opts["precision"] == "fp16" and opts["provider"] != "tensorrt":
        raise EngineError(f"engine {kind!r}: precision 'fp16' needs provider 'tensorrt' (provider "
                          f"{opts['provider']!r} runs the float32 model)")


def _ort_backend(kind: str, backend: str, opts: dict[str, Any]) -> None:
    if opts["provider"] != "cpu" and backend != "cuda":
        raise EngineUnavailable(f"engine {kind!r} with provider {opts['provider']!r} needs the cuda backend; "
                                f"this node runs on {backend} (use provider 'cpu')")


def _ov_values(kind: str, opts: dict[str, Any]) -> None:
    _one_of(kind, opts, "hint", OV_HINTS)


def _compile_values(kind: str, opts: dict[str, Any]) -> None:
    _one_of(kind, opts, "mode", COMPILE_MODES)
    if "buckets" in opts:
        _one_of(kind, opts, "buckets", COMPILE_BUCKETS)
    _one_of(kind, opts, "backend", COMPILERS)
    if "dynamic" in opts and opts["dynamic"] not in (True, False, None):
        raise EngineError(f"engine {kind!r}: dynamic must be true, false or null, got {opts['dynamic']!r}")


def _compile_backend(kind: str, backend: str, opts: dict[str, Any]) -> None:
    if backend == "cpu" and opts["mode"] == "reduce-overhead":
        raise EngineUnavailable(f"engine {kind!r}: mode 'reduce-overhead' is CUDA graphs and needs the cuda "
                                "backend; this node runs on cpu")
    if backend == "cpu" and opts["backend"] == "inductor" and shutil.which(os.environ.get("CXX", "g++")) is None:
        raise EngineUnavailable(f"engine {kind!r} on the cpu backend needs a C++ compiler (g++, or $CXX) for "
                                "inductor's kernels; none is on PATH")


def _cudagraph_values(kind: str, opts: dict[str, Any]) -> None:
    if opts["streams"] not in STREAM_MODES:
        raise EngineError(f"engine {kind!r} option streams must be one of {STREAM_MODES}, got {opts['streams']!r}")
    _int_in(kind, opts, "max_streams", 1, MAX_STREAMS, none_ok=True)
    if opts["max_streams"] is not None and opts["streams"] != "opara":
        raise EngineError(f"engine {kind!r} option max_streams={opts['max_streams']} applies only to streams: "
                          f"opara (streams is {opts['streams']!r})")
    _int_in(kind, opts, "warmup", 1, 100)


def _tensorrt_values(kind: str, opts: dict[str, Any]) -> None:
    if opts["precision"] not in PRECISIONS:
        raise EngineError(f"engine {kind!r} option precision must be one of {PRECISIONS}, "
                          f"got {opts['precision']!r}")
    _int_in(kind, opts, "opt_batch", 1, None, " (unset: max_batch)", none_ok=True)
    _int_in(kind, opts, "workspace_mb", 16, 1 << 20)


def _repeats(kind: str, opts: dict[str, Any]) -> None:
    _int_in(kind, opts, "repeats", 1, MAX_REPEATS)


def _chrion_values(kind: str, opts: dict[str, Any]) -> None:
    _repeats(kind, opts)
    _int_in(kind, opts, "cores", 1, MAX_CORES, none_ok=True)
    a = opts["alpha"]
    if isinstance(a, bool) or not isinstance(a, int | float) or not (math.isfinite(a) and a >= 0):
        raise EngineError(f"engine {kind!r} option alpha must be a finite number >= 0, got {a!r}")


def _auto_values(kind: str, opts: dict[str, Any]) -> None:
    cands = opts["candidates"]
    if cands is not None:
        if isinstance(cands, str) or not isinstance(cands, list | tuple) or not cands:
            raise EngineError(f"engine {kind!r}: candidates must be a non-empty list of engine kinds, got {cands!r}")
        unknown = [c for c in cands if c not in ENGINE_KINDS or c == "auto"]
        if unknown:
            known = ", ".join(k for k in ENGINE_KINDS if k != "auto")
            raise EngineError(f"engine {kind!r}: unknown candidate(s) {unknown} (known: {known})")
        opts["candidates"] = list(cands)
    _int_in(kind, opts, "runs", 1, 1000)


def _tensorrt_plan_values(kind: str, opts: dict[str, Any]) -> None:
    _int_in(kind, opts, "profile", 0, None, " (the plan's optimization profile)")


def _tensorrt_installed(kind: str, backend: str, opts: dict[str, Any]) -> None:
    if not _installed("tensorrt"):
        raise EngineUnavailable(TENSORRT_INSTALL)


_ORT_OPTIONS = {"provider": "cpu", "optimization": "all", "precision": "fp32"}
_ONNX_HINT = "pip install 'gpuprims[onnx]'"
_OV_HINT = "pip install 'gpuprims[openvino]'"

#: The engines of a zoo or ``module:factory`` model, by the name ``engine:`` gives.
ENGINE_KINDS: dict[str, EngineKind] = {k.name: k for k in (
    EngineKind("eager", "gpuprims.engines.eager:EagerEngine", needs_torch=True),
    EngineKind("onnxruntime", "gpuprims.engines.onnxruntime:OnnxRuntimeEngine", needs_torch=False,
               options=_ORT_OPTIONS, libraries=("onnxruntime",), install_hint=_ONNX_HINT, values=_ort_values,
               backend_check=_ort_backend),
    EngineKind("cudagraph", "gpuprims.engines.cudagraph:CudaGraphEngine", needs_torch=True, backends=("cuda",),
               options={"streams": "single", "warmup": 3, "max_streams": None}, values=_cudagraph_values),
    EngineKind("tensorrt", "gpuprims.engines.tensorrt:TensorRTEngine", needs_torch=False, backends=("cuda",),
               options={"precision": "fp32", "opt_batch": None, "workspace_mb": 1024}, values=_tensorrt_values,
               backend_check=_tensorrt_installed),
    EngineKind("compile", "gpuprims.engines.compile:CompileEngine", needs_torch=True,
               options={"mode": "default", "buckets": "pow2", "backend": "inductor"}, values=_compile_values,
               backend_check=_compile_backend),
    EngineKind("openvino", "gpuprims.engines.openvino:OpenVinoEngine", needs_torch=False, backends=("cpu",),
               options={"hint": "latency"}, libraries=("openvino",), install_hint=_OV_HINT, values=_ov_values),
    EngineKind("duet", "gpuprims.engines.duet:DuetEngine", needs_torch=True, options={"repeats": 5},
               values=_repeats),
    EngineKind("chrion", "gpuprims.engines.chrion:ChrionEngine", needs_torch=True,
               options={"cores": None, "alpha": 0.0, "repeats": 20}, values=_chrion_values),
    # auto measures eager beside the others, so its instance runs torch whichever it keeps.
    EngineKind("auto", "gpuprims.engines.auto:AutoEngine", needs_torch=True,
               options={"candidates": None, "runs": 10}, values=_auto_values),
)}

#: The engines of a model file, by the name ``engine:`` gives (or the file's suffix picks).
FILE_ENGINE_KINDS: dict[str, EngineKind] = {k.name: k for k in (
    EngineKind("onnxruntime", "gpuprims.engines.file_onnx:OnnxRuntimeFileEngine", needs_torch=False,
               options=_ORT_OPTIONS, libraries=("onnxruntime",), install_hint=_ONNX_HINT, values=_ort_values,
               backend_check=_ort_backend),
    EngineKind("openvino", "gpuprims.engines.file_onnx:OpenVinoFileEngine", needs_torch=False, backends=("cpu",),
               options={"hint": "latency"}, libraries=("openvino",), install_hint=_OV_HINT, values=_ov_values),
    EngineKind("torchscript", "gpuprims.engines.file_torch:TorchScriptFileEngine", needs_torch=True,
               libraries=("torch",)),
    EngineKind("torch_export", "gpuprims.engines.file_torch:TorchExportFileEngine", needs_torch=True,
               libraries=("torch",)),
    EngineKind("compile", "gpuprims.engines.file_torch:CompileFileEngine", needs_torch=True, libraries=("torch",),
               options={"mode": "default", "backend": "inductor", "dynamic": True}, values=_compile_values,
               backend_check=_compile_backend),
    EngineKind("tensorrt", "gpuprims.engines.file_tensorrt:TensorRTFileEngine", needs_torch=False,
               backends=("cuda",), options={"profile": 0}, values=_tensorrt_plan_values,
               backend_check=_tensorrt_installed),
)}


def engine_kind(kind: str) -> EngineKind:
    """The kind ``engine:`` names for a zoo or ``module:factory`` model; EngineError names the known ones."""
    found = ENGINE_KINDS.get(kind) if isinstance(kind, str) else None
    if found is None:
        raise EngineError(f"unknown engine {kind!r}; known engines: {', '.join(ENGINE_KINDS)}")
    return found


def file_engine_kind(kind: str) -> EngineKind:
    """The kind that serves a model file; EngineError names the known ones."""
    found = FILE_ENGINE_KINDS.get(kind) if isinstance(kind, str) else None
    if found is None:
        raise EngineError(f"unknown model file engine {kind!r}; known: {', '.join(FILE_ENGINE_KINDS)}")
    return found
