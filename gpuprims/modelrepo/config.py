"""A model's ``config.pbtxt`` (Triton's ``ModelConfig`` message) read into typed records.

:func:`parse_config` reads the text against Triton's own message (:mod:`gpuprims.modelrepo.proto`),
then decides every field the text sets: *supported* fields become records of :class:`ModelConfig`;
*ignored* fields only tune Triton's own internals, are accepted and listed in ``ModelConfig.ignored``
(the node logs them and ``status`` shows them); *refused* fields would change results or resources in
a way gpuprims does not support and raise :class:`ModelConfigError` naming the file, line and field.
A field nobody has decided (one a newer Triton adds) is refused by default: the table below is
:data:`FIELDS`, and a test holds it to the message's descriptor.

| field | decision |
|---|---|
| ``name`` | supported; must equal the model's directory name (the directory's name by default) |
| ``platform``, ``backend`` | supported: onnxruntime_onnx/onnxruntime, tensorrt_plan/tensorrt, pytorch_libtorch/pytorch, openvino; others refused |
| ``max_batch_size`` | supported (>= 0) |
| ``input``: ``name``, ``data_type``, ``dims``, ``reshape``, ``optional`` | supported; TYPE_STRING (BYTES) refused for now |
| ``input.format`` | ignored (a layout hint; ``dims`` say the shape) |
| ``input.is_shape_tensor``, ``input.allow_ragged_batch`` | refused |
| ``output``: ``name``, ``data_type``, ``dims``, ``reshape`` | supported; TYPE_STRING refused for now |
| ``output.label_filename`` | ignored (no classification extension: the tensors are returned) |
| ``output.is_shape_tensor`` | refused |
| ``batch_input``, ``batch_output`` | refused |
| ``version_policy`` (``latest``, ``all``, ``specific``) | supported |
| ``dynamic_batching``: ``max_queue_delay_microseconds``, ``preferred_batch_size``, ``default_queue_policy``, ``priority_levels``, ``default_priority_level`` | supported |
| ``dynamic_batching.preserve_ordering`` | ignored (every request is answered on its own) |
| ``dynamic_batching.priority_queue_policy`` | refused (one queue policy per model) |
| ``sequence_batching`` | refused (stateful models) |
| ``ensemble_scheduling`` | refused (ensembles come with pipelines) |
| ``instance_group``: ``count``, ``kind``, ``gpus`` | supported; ``KIND_MODEL`` refused |
| ``instance_group``: ``name``, ``rate_limiter``, ``profile``, ``host_policy`` | ignored |
| ``instance_group``: ``secondary_devices``, ``passive`` | refused |
| ``default_model_filename`` | supported |
| ``cc_model_filenames`` | refused (one file per version) |
| ``metric_tags`` | ignored |
| ``parameters`` | gpuprims' keys supported: ``gpu_pct`` (1-100), ``slo_ms`` (> 0), ``engine``, ``overflow`` (none, cpu); other keys ignored |
| ``model_warmup`` (``name``, ``batch_size``, ``inputs``, ``count``) | supported |
| ``optimization.execution_accelerators`` (gpu ``tensorrt``/``cuda``, cpu ``openvino``) | supported (ONNX models); ``tensorrt``'s ``precision_mode`` FP32/FP16 (INT8 refused), other parameters ignored |
| ``optimization``: ``graph``, ``priority``, ``cuda.*``, ``input_pinned_memory``, ``output_pinned_memory``, ``gather_kernel_buffer_threshold``, ``eager_batching`` | ignored |
| ``model_operations`` | refused (custom operation libraries) |
| ``model_transaction_policy.decoupled`` | supported when false; true refused (one answer per request) |
| ``model_repository_agents`` | refused |
| ``response_cache`` | ignored |

:func:`load_config` reads a model directory: its ``config.pbtxt`` completed from the model file
where the config leaves inputs, outputs or the platform out (:mod:`gpuprims.modelrepo.complete`).
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from google.protobuf import json_format

from gpuprims.modelrepo import formats, proto
from gpuprims.modelrepo.complete import PLATFORM_OF_FORMAT, complete_from_file, complete_message
from gpuprims.modelrepo.errors import ModelConfigError, TextIndex, field_name
from gpuprims.tensors import DataType, ModelSignature, TensorSpec

SUPPORTED = "supported"
IGNORED = "ignored"
REFUSED = "refused"

_S = (SUPPORTED, "")
_I = (IGNORED, "")

#: Every field of Triton's ModelConfig gpuprims has decided, by dotted path: (decision, why refused).
#: A field set in a config that is not here is refused ("not known to gpuprims").
FIELDS: dict[str, tuple[str, str]] = {
    "name": _S, "platform": _S, "backend": _S, "max_batch_size": _S,
    "version_policy": _S, "version_policy.latest": _S, "version_policy.latest.num_versions": _S,
    "version_policy.all": _S, "version_policy.specific": _S, "version_policy.specific.versions": _S,
    "input": _S, "input.name": _S, "input.data_type": _S, "input.dims": _S, "input.reshape": _S,
    "input.reshape.shape": _S, "input.optional": _S, "input.format": _I,
    "input.is_shape_tensor": (REFUSED, "shape tensors are not supported"),
    "input.allow_ragged_batch": (REFUSED, "ragged batches are not supported: requests are batched only "
                                          "with requests of the same shapes"),
    "output": _S, "output.name": _S, "output.data_type": _S, "output.dims": _S, "output.reshape": _S,
    "output.reshape.shape": _S, "output.label_filename": _I,
    "output.is_shape_tensor": (REFUSED, "shape tensors are not supported"),
    "batch_input": (REFUSED, "batch inputs are not supported"),
    "batch_output": (REFUSED, "batch outputs are not supported"),
    "optimization": _S, "optimization.graph": _I, "optimization.priority": _I, "optimization.cuda": _S,
    "optimization.cuda.graphs": _I, "optimization.cuda.busy_wait_events": _I,
    "optimization.cuda.graph_spec": _I, "optimization.cuda.output_copy_stream": _I,
    "optimization.execution_accelerators": _S,
    "optimization.execution_accelerators.gpu_execution_accelerator": _S,
    "optimization.execution_accelerators.gpu_execution_accelerator.name": _S,
    "optimization.execution_accelerators.gpu_execution_accelerator.parameters": _S,
    "optimization.execution_accelerators.cpu_execution_accelerator": _S,
    "optimization.execution_accelerators.cpu_execution_accelerator.name": _S,
    "optimization.execution_accelerators.cpu_execution_accelerator.parameters": _S,
    "optimization.input_pinned_memory": _I, "optimization.output_pinned_memory": _I,
    "optimization.gather_kernel_buffer_threshold": _I, "optimization.eager_batching": _I,
    "dynamic_batching": _S, "dynamic_batching.preferred_batch_size": _S,
    "dynamic_batching.max_queue_delay_microseconds": _S, "dynamic_batching.preserve_ordering": _I,
    "dynamic_batching.priority_levels": _S, "dynamic_batching.default_priority_level": _S,
    "dynamic_batching.default_queue_policy": _S,
    "dynamic_batching.default_queue_policy.timeout_action": _S,
    "dynamic_batching.default_queue_policy.default_timeout_microseconds": _S,
    "dynamic_batching.default_queue_policy.allow_timeout_override": _S,
    "dynamic_batching.default_queue_policy.max_queue_size": _S,
    "dynamic_batching.priority_queue_policy": (REFUSED, "per-priority queue policies are not supported: "
                                                        "use default_queue_policy"),
    "sequence_batching": (REFUSED, "stateful (sequence) models are not supported"),
    "ensemble_scheduling": (REFUSED, "ensembles are not supported yet: they come with pipelines"),
    "instance_group": _S, "instance_group.name": _I, "instance_group.kind": _S, "instance_group.count": _S,
    "instance_group.rate_limiter": _I, "instance_group.gpus": _S,
    "instance_group.secondary_devices": (REFUSED, "secondary devices (NVDLA) are not supported"),
    "instance_group.profile": _I,
    "instance_group.passive": (REFUSED, "passive instances are not supported: every instance serves"),
    "instance_group.host_policy": _I,
    "default_model_filename": _S,
    "cc_model_filenames": (REFUSED, "per-compute-capability model files are not supported: use "
                                    "default_model_filename"),
    "metric_tags": _I,
    "parameters": _S,
    "model_warmup": _S, "model_warmup.name": _S, "model_warmup.batch_size": _S, "model_warmup.inputs": _S,
    "model_warmup.count": _S,
    "model_operations": (REFUSED, "custom operation libraries are not supported"),
    "model_transaction_policy": _S, "model_transaction_policy.decoupled": _S,
    "model_repository_agents": (REFUSED, "repository agents are not supported (they change the model "
                                         "files at load)"),
    "response_cache": _I,
}

#: gpuprims' own keys of ``parameters``.
GPUPRIMS_PARAMETERS = ("gpu_pct", "slo_ms", "engine", "overflow")
#: Execution accelerators gpuprims maps to an engine, by device.
ACCELERATORS: dict[str, tuple[str, ...]] = {"gpu": ("tensorrt", "cuda"), "cpu": ("openvino",)}
#: The accelerator parameters that change the engine (the others only tune it: listed as ignored).
ACCELERATOR_PARAMETERS: dict[str, tuple[str, ...]] = {"tensorrt": ("precision_mode",), "cuda": (),
                                                      "openvino": ()}
#: TensorRT accelerator precisions the engines take (INT8 needs a calibration gpuprims does not run).
PRECISION_MODES = ("FP32", "FP16")
#: The largest slo_ms (an hour), as apps.yaml's.
MAX_SLO_MS = 3_600_000.0

Step = tuple[str, "int | str | None"]


class InstanceKind(enum.Enum):
    """Where an instance group's instances run (``KIND_AUTO``: the GPU where there is one)."""

    AUTO = "KIND_AUTO"
    GPU = "KIND_GPU"
    CPU = "KIND_CPU"


class TimeoutAction(enum.Enum):
    """What happens to a request whose queue timeout passes: rejected, or kept behind the others."""

    REJECT = "REJECT"
    DELAY = "DELAY"


def _nonneg(value: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be an integer >= 0, got {value!r}")


@dataclass(frozen=True)
class QueuePolicy:
    """``dynamic_batching.default_queue_policy``: ``max_queue_size`` requests at most (0: no bound),
    each waiting ``default_timeout_us`` at most (0: no timeout) before ``timeout_action``."""

    max_queue_size: int = 0
    default_timeout_us: int = 0
    timeout_action: TimeoutAction = TimeoutAction.REJECT
    allow_timeout_override: bool = False

    def __post_init__(self) -> None:
        _nonneg(self.max_queue_size, "max_queue_size")
        _nonneg(self.default_timeout_us, "default_timeout_us")
        if not isinstance(self.timeout_action, TimeoutAction):
            raise ValueError(f"timeout_action must be a TimeoutAction, got {self.timeout_action!r}")


@dataclass(frozen=True)
class DynamicBatching:
    """``dynamic_batching``: how long a request may wait for others (``max_queue_delay_us``), the batch
    sizes run at once when they can be formed, the queue policy and the priority levels (0: none)."""

    max_queue_delay_us: int = 0
    preferred_batch_sizes: tuple[int, ...] = ()
    default_queue_policy: QueuePolicy = field(default_factory=QueuePolicy)
    priority_levels: int = 0
    default_priority_level: int = 0

    def __post_init__(self) -> None:
        _nonneg(self.max_queue_delay_us, "max_queue_delay_us")
        object.__setattr__(self, "preferred_batch_sizes", tuple(self.preferred_batch_sizes))
        for b in self.preferred_batch_sizes:
            if isinstance(b, bool) or not isinstance(b, int) or b < 1:
                raise ValueError(f"preferred batch sizes must be integers >= 1, got {list(self.preferred_batch_sizes)}")
        _nonneg(self.priority_levels, "priority_levels")
        _nonneg(self.default_priority_level, "default_priority_level")
        if self.priority_levels and not 1 <= self.default_priority_level <= self.priority_levels:
            raise ValueError(f"default_priority_level must be 1..{self.priority_levels} (priority_levels), "
                             f"got {self.default_priority_level}")
        if not self.priority_levels and self.default_priority_level:
            raise ValueError(f"default_priority_level {self.default_priority_level} needs priority_levels")


@dataclass(frozen=True)
class InstanceGroup:
    """``instance_group``: ``count`` instances of ``kind`` (per listed GPU for GPU groups; ``gpus``
    empty: every GPU)."""

    count: int = 1
    kind: InstanceKind = InstanceKind.AUTO
    gpus: tuple[int, ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"count must be an integer >= 1, got {self.count!r}")
        if not isinstance(self.kind, InstanceKind):
            raise ValueError(f"kind must be an InstanceKind, got {self.kind!r}")
        object.__setattr__(self, "gpus", tuple(self.gpus))
        for g in self.gpus:
            _nonneg(g, "gpus")
        if self.gpus and self.kind is InstanceKind.CPU:
            raise ValueError(f"gpus {list(self.gpus)} given for a KIND_CPU group")


@dataclass(frozen=True)
class VersionPolicy:
    """``version_policy``: which of the versions present are served. ``latest``: the
    ``num_versions`` highest (Triton's default is ``latest { num_versions: 1 }``); ``all``; ``specific``:
    ``versions``."""

    kind: Literal["latest", "all", "specific"] = "latest"
    num_versions: int = 1
    versions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("latest", "all", "specific"):
            raise ValueError(f"version policy must be latest, all or specific, got {self.kind!r}")
        object.__setattr__(self, "versions", tuple(sorted(set(self.versions))))
        if self.kind == "latest" and (isinstance(self.num_versions, bool) or not isinstance(self.num_versions, int)
                                      or self.num_versions < 1):
            raise ValueError(f"latest num_versions must be an integer >= 1, got {self.num_versions!r}")
        if self.kind == "specific":
            if not self.versions:
                raise ValueError("specific lists no versions")
            bad = [v for v in self.versions if isinstance(v, bool) or not isinstance(v, int) or v < 1]
            if bad:
                raise ValueError(f"versions must be integers >= 1, got {bad}")

    def select(self, available: Iterable[int]) -> tuple[int, ...]:
        """The versions served out of ``available``, ascending (``specific`` ones not present left out;
        :meth:`missing` names them)."""
        have = sorted(set(available))
        if self.kind == "all":
            return tuple(have)
        if self.kind == "latest":
            return tuple(have[-self.num_versions:])
        return tuple(v for v in self.versions if v in have)

    def missing(self, available: Iterable[int]) -> tuple[int, ...]:
        """The ``specific`` versions that have no directory (empty for the other policies)."""
        have = set(available)
        return tuple(v for v in self.versions if v not in have) if self.kind == "specific" else ()

    def describe(self) -> str:
        if self.kind == "latest":
            return f"latest {self.num_versions}"
        if self.kind == "all":
            return "all"
        return "specific " + ",".join(map(str, self.versions))


@dataclass(frozen=True)
class WarmupInput:
    """One input of a warm-up request: its datatype and per-request dims, filled with zeros, random
    values, or the bytes of ``data_file`` (a file in the model directory's ``warmup/``)."""

    name: str
    datatype: DataType
    dims: tuple[int, ...]
    data: Literal["zero", "random", "file"] = "zero"
    data_file: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", tuple(self.dims))
        if self.data not in ("zero", "random", "file"):
            raise ValueError(f"warmup input {self.name!r}: data must be zero, random or file, got {self.data!r}")
        if (self.data == "file") != bool(self.data_file):
            raise ValueError(f"warmup input {self.name!r}: data_file goes with data 'file'")


@dataclass(frozen=True)
class Warmup:
    """``model_warmup``: a request of ``batch_size`` run ``count`` times before the model serves."""

    name: str
    batch_size: int
    inputs: tuple[WarmupInput, ...]
    count: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        for what, v in (("batch_size", self.batch_size), ("count", self.count)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"warmup {self.name!r}: {what} must be an integer >= 1, got {v!r}")


@dataclass(frozen=True)
class Accelerator:
    """``optimization.execution_accelerators``: a named accelerator on ``device`` (gpu, cpu) with its
    parameters (Triton's strings, such as ``precision_mode: FP16``)."""

    name: str
    device: Literal["gpu", "cpu"]
    parameters: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.device not in ACCELERATORS:
            raise ValueError(f"accelerator device must be gpu or cpu, got {self.device!r}")
        if self.name not in ACCELERATORS[self.device]:
            raise ValueError(f"unknown {self.device} execution accelerator {self.name!r} (one of "
                             f"{', '.join(ACCELERATORS[self.device])})")
        object.__setattr__(self, "parameters", tuple(sorted(self.parameters)))

    def parameter(self, key: str, default: str | None = None) -> str | None:
        return dict(self.parameters).get(key, default)


@dataclass(frozen=True)
class GpuprimsParameters:
    """gpuprims' own keys of ``parameters``: the model's GPU share (%), its latency objective (ms), the
    file engine that runs it and where requests overflow (none, cpu); None where not given."""

    gpu_pct: int | None = None
    slo_ms: float | None = None
    engine: str | None = None
    overflow: str | None = None

    def __post_init__(self) -> None:
        if self.gpu_pct is not None and (isinstance(self.gpu_pct, bool) or not isinstance(self.gpu_pct, int)
                                         or not 1 <= self.gpu_pct <= 100):
            raise ValueError(f"gpu_pct must be an integer percentage 1..100, got {self.gpu_pct!r}")
        if self.slo_ms is not None and not (isinstance(self.slo_ms, (int, float)) and math.isfinite(self.slo_ms)
                                            and 0 < self.slo_ms <= MAX_SLO_MS):
            raise ValueError(f"slo_ms must be a number of milliseconds > 0 and <= {MAX_SLO_MS:.0f}, "
                             f"got {self.slo_ms!r}")
        if self.engine is not None and self.engine not in formats.ALL_ENGINE_KINDS:
            raise ValueError(f"engine must be one of {', '.join(formats.ALL_ENGINE_KINDS)}, got {self.engine!r}")
        if self.overflow is not None and self.overflow not in ("none", "cpu"):
            raise ValueError(f"overflow must be none or cpu, got {self.overflow!r}")


@dataclass(frozen=True)
class EngineChoice:
    """The file engine kind (gpuprims.engines.files) that runs a model on a device, and its options."""

    kind: str
    options: Mapping[str, str] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class ModelConfig:
    """One model's configuration, completed and checked (see the module docstring for the fields).

    ``message`` is the completed ``ModelConfig`` protobuf itself, what :meth:`to_json` carries to the
    instance and what the front door's ``config`` endpoint reports; every other field is read from it.
    """

    name: str
    platform: str
    backend: str
    signature: ModelSignature
    model_format: str
    default_model_filename: str = ""
    dynamic_batching: DynamicBatching | None = None
    instance_groups: tuple[InstanceGroup, ...] = ()
    version_policy: VersionPolicy = field(default_factory=VersionPolicy)
    warmup: tuple[Warmup, ...] = ()
    accelerators: tuple[Accelerator, ...] = ()
    parameters: GpuprimsParameters = field(default_factory=GpuprimsParameters)
    ignored: tuple[str, ...] = ()
    source: str = ""
    message: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a model needs a non-empty name, got {self.name!r}")
        if self.model_format not in formats.DEFAULT_FILENAMES:
            raise ValueError(f"model_format must be one of {', '.join(formats.DEFAULT_FILENAMES)}, "
                             f"got {self.model_format!r}")
        if not isinstance(self.signature, ModelSignature):
            raise ValueError(f"signature must be a ModelSignature, got {type(self.signature).__name__}")
        for name in ("instance_groups", "warmup", "accelerators", "ignored"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def max_batch_size(self) -> int:
        return self.signature.max_batch_size

    @property
    def model_filename(self) -> str:
        """The model file's name in each version directory."""
        return self.default_model_filename or formats.DEFAULT_FILENAMES[self.model_format]

    def accelerator(self, device: str, name: str) -> Accelerator | None:
        return next((a for a in self.accelerators if a.device == device and a.name == name), None)

    def engine(self, device: str = "cpu") -> EngineChoice:
        """The file engine that runs this model on ``device`` (``cpu`` or ``cuda``, the node's backend):
        ``parameters.engine`` where given, else the format's default engine; for ONNX, a cpu
        ``openvino`` accelerator picks OpenVINO on the CPU, and on a GPU ONNX Runtime runs with the
        TensorRT provider under a gpu ``tensorrt`` accelerator (FP16 with ``precision_mode: FP16``),
        else the CUDA provider, as Triton's ONNX Runtime backend does."""
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {device!r}")
        if self.backend == "openvino":
            return EngineChoice("openvino")
        kind = self.parameters.engine
        if self.model_format != "onnx":
            return EngineChoice(kind or formats.ENGINE_KINDS[self.model_format][0])
        if kind is None:
            kind = "openvino" if device == "cpu" and self.accelerator("cpu", "openvino") else "onnxruntime"
        if kind != "onnxruntime":
            return EngineChoice(kind)
        if device == "cpu":
            return EngineChoice(kind, {"provider": "cpu"})
        trt = self.accelerator("gpu", "tensorrt")
        if trt is None:
            return EngineChoice(kind, {"provider": "cuda"})
        precision = (trt.parameter("precision_mode") or "FP32").lower()
        return EngineChoice(kind, {"provider": "tensorrt", "precision": precision})

    def engine_kind(self, device: str = "cpu") -> str:
        """The kind of :meth:`engine` on ``device``."""
        return self.engine(device).kind

    def to_dict(self) -> dict[str, Any]:
        """The completed message as JSON-ready data with the proto's field names (the front door's
        ``config`` endpoint, as Triton reports it)."""
        if self.message is None:
            raise ValueError(f"model {self.name!r}: this ModelConfig was made without its message (build it with "
                             "parse_config, load_config or build_config)")
        return proto.to_dict(self.message)

    def to_json(self) -> str:
        """The completed message and its source, for the instance process (:meth:`from_json`)."""
        return json.dumps({"source": self.source, "config": self.to_dict()})

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        """The record :meth:`to_json` wrote, rebuilt from its message (so the instance checks it too)."""
        try:
            data = json.loads(text)
            source = str(data["source"])
            msg = proto.from_dict(data["config"])
        except (ValueError, KeyError, TypeError, json_format.ParseError) as e:
            raise ModelConfigError("<json>", None, "config", f"not a ModelConfig JSON: {e}") from None
        return build_config(msg, source)


# -- reading ------------------------------------------------------------------------------------------

_SYNTAX = re.compile(r"^\d+:\d+ : (.*)$", re.DOTALL)
_NO_FIELD = re.compile(r'has no field named "([^"]+)"')


def _parse(text: str, path: str) -> Any:
    try:
        return proto.parse_text(text)
    except proto.ParseError as e:
        m = _SYNTAX.match(str(e))
        what = m.group(1) if m else str(e)
        line = e.GetLine() if e.GetLine() and e.GetLine() > 0 else None
        lines = text.splitlines()
        src = lines[line - 1] if line and line <= len(lines) else ""
        quoted = f"'{src}': "
        if src and what.startswith(quoted):
            what = what[len(quoted):]  # protobuf repeats the line; the location says it
        fm = _NO_FIELD.search(what)
        if fm:
            fld = fm.group(1)
            what = f"unknown field (Triton's ModelConfig has no {fld!r}): {what}"
        else:
            # The field is the name written just before the offending token (its column), else the
            # first name on the line.
            col = e.GetColumn() if e.GetColumn() and e.GetColumn() > 0 else len(src) + 1
            before = re.search(r"([A-Za-z_]\w*)\s*:?\s*[\[{<]?\s*$", src[:col - 1])
            named = re.findall(r"([A-Za-z_]\w*)\s*:", src[:col - 1])
            head = re.match(r"\s*([A-Za-z_]\w*)", src)
            fld = (before.group(1) if before else named[-1] if named else head.group(1) if head else "syntax")
        raise ModelConfigError(path, line, fld, what) from None


def parse_config(text: str, path: str, name: str | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of a complete ``config.pbtxt`` text (inputs, outputs and a platform or
    backend given). ``path`` names the file in errors; the model's name defaults to ``name`` or the
    name of the directory holding ``path``. Raises :class:`ModelConfigError`."""
    msg = _parse(text, path)
    return build_config(msg, path, text, default_name=name or Path(path).parent.name)


def load_config(model_dir: str | Path, torch_ok: bool = True) -> ModelConfig:
    """The :class:`ModelConfig` of a repository's model directory: its ``config.pbtxt``, completed from
    the model file of its highest version where the config leaves out inputs, outputs or the platform
    (or is absent). The config's ``name``, when given, must be the directory's name. ``torch_ok``
    False keeps torch out of this process (a torch.export file then needs its config). Raises
    :class:`ModelConfigError`."""
    d = Path(model_dir)
    cfg = d / "config.pbtxt"
    text = ""
    if cfg.is_file():
        try:
            text = cfg.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelConfigError(str(cfg), None, "config.pbtxt", f"cannot be read: {e}") from None
        msg = _parse(text, str(cfg))
        if msg.name and msg.name != d.name:
            idx = TextIndex(text)
            raise ModelConfigError(str(cfg), idx.line([("name", None)]), "name",
                                   f"{msg.name!r} differs from its directory's name {d.name!r} (Triton's "
                                   "rule: a model is named by its directory)")
    else:
        msg = proto.ModelConfigMessage()
    source = complete_message(msg, d, str(cfg), text or None, torch_ok)
    return build_config(msg, source, text or None, default_name=d.name)


def config_for_file(model_path: str | Path, text: str | None = None, source: str | None = None,
                    name: str | None = None, torch_ok: bool = True) -> ModelConfig:
    """The :class:`ModelConfig` of a model file outside a repository (apps.yaml ``model: path``):
    ``text`` (config.pbtxt keys, optional; ``source`` names it in errors) completed from the file,
    whose name becomes ``default_model_filename``. The model's name is ``name`` or the file's stem.
    Raises :class:`ModelConfigError`."""
    p = Path(model_path)
    fmt = formats.format_of_file(p)
    if fmt is None:
        raise ModelConfigError(str(p), None, "model", f"{p.name!r} is not a model file gpuprims knows (one of "
                                                      f"{', '.join(formats.EXTENSIONS)})")
    if formats.model_file(p.parent, p.name) is None:
        raise ModelConfigError(str(p), None, "model", "no such model file")
    src = source or str(p)
    msg = _parse(text, src) if text else proto.ModelConfigMessage()
    if not (msg.platform or msg.backend):
        msg.platform, msg.backend = PLATFORM_OF_FORMAT[fmt]
    if not msg.default_model_filename:
        msg.default_model_filename = p.name
    if not len(msg.input) or not len(msg.output):
        complete_from_file(msg, formats.model_file(p.parent, p.name) or p, fmt, src, torch_ok, text or None)
    return build_config(msg, src, text or None, default_name=name or p.stem)


def build_config(msg: Any, source: str, text: str | None = None, default_name: str = "") -> ModelConfig:
    """Decide every field ``msg`` sets and read it into a :class:`ModelConfig` (``msg`` is copied, its
    name filled). ``text`` (the config's text, when there is one) places errors on their lines."""
    return _Builder(msg, source, text).build(default_name)


def _plain_name(name: str) -> bool:
    """Whether ``name`` names a file inside one directory (no separator, not ``.`` or ``..``): a config
    never reaches outside its model's directory."""
    return bool(name) and name not in (".", "..") and not any(c in name for c in "/\\\0")


class _Builder:
    def __init__(self, msg: Any, source: str, text: str | None) -> None:
        self.msg = proto.ModelConfigMessage()
        self.msg.CopyFrom(msg)
        self.source = source
        self.index = TextIndex(text) if text else None
        self.ignored: list[str] = []

    def error(self, steps: list[Step], message: str) -> ModelConfigError:
        line = self.index.line(steps) if self.index is not None else None
        return ModelConfigError(self.source, line, field_name(steps), message)

    # -- the decision of every field set -------------------------------------------------------------
    def classify(self, msg: Any, prefix: str, steps: list[Step]) -> None:
        for fd, value in msg.ListFields():
            key = f"{prefix}.{fd.name}" if prefix else fd.name
            decision, why = FIELDS.get(key, (REFUSED, "not known to gpuprims (a field of a newer Triton?)"))
            is_map = fd.message_type is not None and fd.message_type.GetOptions().map_entry
            if decision == REFUSED:
                raise self.error([*steps, (fd.name, None)], f"refused: {why}")
            if decision == IGNORED:
                if key not in self.ignored:
                    self.ignored.append(key)
                continue
            if fd.message_type is None or is_map:
                continue
            if fd.is_repeated:
                for i, sub in enumerate(value):
                    self.classify(sub, key, [*steps, (fd.name, i)])
            else:
                self.classify(value, key, [*steps, (fd.name, None)])

    # -- the records ---------------------------------------------------------------------------------
    def build(self, default_name: str) -> ModelConfig:
        m = self.msg
        self.classify(m, "", [])
        if not m.name:
            if not default_name:
                raise self.error([("name", None)], "the model has no name")
            m.name = default_name
        problem = formats.platform_problem(m.platform, m.backend)
        if problem is not None:
            raise self.error([(problem[0], None)], problem[1])
        backend = formats.backend_of(m.platform, m.backend)
        if not backend:
            raise self.error([("platform", None)], "neither platform nor backend is given (gpuprims finds "
                                                   "them from the model file when config.pbtxt is read from "
                                                   "a model directory)")
        if m.default_model_filename and not _plain_name(m.default_model_filename):
            raise self.error([("default_model_filename", None)],
                             f"{m.default_model_filename!r} must be a file name in the version directory, not a path")
        fmt = formats.format_of(backend, m.default_model_filename)
        allowed = {"onnxruntime": ("onnx",), "tensorrt": ("tensorrt_plan",),
                   "pytorch": ("torchscript", "torch_export"), "openvino": ("openvino_ir", "onnx")}[backend]
        if fmt not in allowed:
            raise self.error([("default_model_filename", None)],
                             f"{m.default_model_filename!r} is a {fmt} file, which backend {backend!r} does not "
                             f"run (it runs {', '.join(allowed)})")
        assert fmt is not None
        if m.max_batch_size < 0:
            raise self.error([("max_batch_size", None)], f"must be >= 0, got {m.max_batch_size}")
        signature = self.signature()
        params = self.parameters()
        if params.engine is not None:
            kinds = ("openvino",) if backend == "openvino" else formats.ENGINE_KINDS[fmt]
            if params.engine not in kinds:
                raise self.error([("parameters", "engine")],
                                 f"engine {params.engine!r} does not run a {fmt} model (it takes "
                                 f"{', '.join(kinds)})")
        if m.HasField("model_transaction_policy") and m.model_transaction_policy.decoupled:
            raise self.error([("model_transaction_policy", None), ("decoupled", None)],
                             "refused: decoupled models (any number of responses per request) are not "
                             "supported: every request gets one answer")
        return ModelConfig(
            name=m.name, platform=m.platform, backend=backend, signature=signature, model_format=fmt,
            default_model_filename=m.default_model_filename, dynamic_batching=self.batching(),
            instance_groups=self.instance_groups(), version_policy=self.version_policy(),
            warmup=self.warmups(signature), accelerators=self.accelerators(fmt), parameters=params,
            ignored=tuple(self.ignored), source=self.source, message=m)

    def enum_name(self, enum: Any, value: int, steps: list[Step]) -> str:
        """The name of an enum value; protobuf takes numbers no enum value has (``data_type: 99``)."""
        try:
            return str(enum.Name(value))
        except ValueError:
            raise self.error(steps, f"{value} is not a value of {enum.DESCRIPTOR.name} (one of "
                                    f"{', '.join(enum.keys())})") from None

    def _datatype(self, steps: list[Step], t: Any, what: str) -> DataType:
        name = self.enum_name(proto.pb.DataType, t.data_type, [*steps, ("data_type", None)])
        if name == "TYPE_INVALID":
            raise self.error([*steps, ("data_type", None)], f"{what} {t.name!r} has no data_type")
        dt = DataType.from_config(name)
        if dt is DataType.BYTES:
            raise self.error([*steps, ("data_type", None)],
                             f"BYTES tensors are not supported yet: {what} {t.name!r} is TYPE_STRING")
        return dt

    def _dims(self, steps: list[Step], values: Iterable[int], what: str, name: str, fld: str) -> tuple[int, ...]:
        dims = tuple(int(d) for d in values)
        bad = [d for d in dims if d == 0 or d < -1]
        if bad:
            raise self.error([*steps, (fld, None)], f"{what} {name!r}: {fld} must be >= 1 or -1 (any size), "
                                                    f"got {list(dims)}")
        return dims

    def _tensor(self, t: Any, i: int, what: str) -> TensorSpec:
        steps: list[Step] = [(what, i)]
        if not t.name:
            raise self.error([*steps, ("name", None)], f"{what} {i} has no name")
        dt = self._datatype(steps, t, what)
        if not len(t.dims):
            raise self.error([*steps, ("dims", None)], f"{what} {t.name!r} has no dims (a scalar per request "
                                                       "is dims: [ 1 ] with reshape: { shape: [ ] })")
        dims = self._dims(steps, t.dims, what, t.name, "dims")
        reshape = None
        if t.HasField("reshape"):
            rsteps = [*steps, ("reshape", None)]
            reshape = self._dims(rsteps, t.reshape.shape, what, t.name, "shape")
            fixed_d, fixed_r = -1 not in dims, -1 not in reshape
            if fixed_d != fixed_r or (fixed_d and math.prod(dims) != math.prod(reshape)):
                raise self.error(rsteps, f"{what} {t.name!r}: reshape {list(reshape)} does not hold the "
                                         f"elements of dims {list(dims)}")
        optional = bool(getattr(t, "optional", False)) if what == "input" else False
        return TensorSpec(t.name, dt, dims, reshape, optional)

    def signature(self) -> ModelSignature:
        m = self.msg
        for what, items in (("input", m.input), ("output", m.output)):
            if not len(items):
                raise self.error([(what, None)], f"the model has no {what} (give {what} in config.pbtxt, or "
                                                 "let gpuprims complete it from an ONNX file)")
        inputs = tuple(self._tensor(t, i, "input") for i, t in enumerate(m.input))
        outputs = tuple(self._tensor(t, i, "output") for i, t in enumerate(m.output))
        for what, specs in (("input", inputs), ("output", outputs)):
            seen: set[str] = set()
            for i, s in enumerate(specs):
                if s.name in seen:
                    raise self.error([(what, i), ("name", None)], f"{what} name {s.name!r} is repeated")
                seen.add(s.name)
        return ModelSignature(inputs, outputs, int(m.max_batch_size))

    def batching(self) -> DynamicBatching | None:
        m = self.msg
        if not m.HasField("dynamic_batching"):
            return None
        db = m.dynamic_batching
        steps: list[Step] = [("dynamic_batching", None)]
        for b in db.preferred_batch_size:
            if b < 1 or b > m.max_batch_size:
                raise self.error([*steps, ("preferred_batch_size", None)],
                                 f"preferred batch sizes must be 1..max_batch_size ({m.max_batch_size}), got "
                                 f"{list(db.preferred_batch_size)}" if m.max_batch_size else
                                 "preferred batch sizes need max_batch_size > 0 (this model is not batched)")
        policy = QueuePolicy()
        if db.HasField("default_queue_policy"):
            q = db.default_queue_policy
            policy = QueuePolicy(int(q.max_queue_size), int(q.default_timeout_microseconds),
                                 TimeoutAction(self.enum_name(proto.pb.ModelQueuePolicy.TimeoutAction, q.timeout_action,
                                                              [*steps, ("default_queue_policy", None),
                                                               ("timeout_action", None)])),
                                 bool(q.allow_timeout_override))
        try:
            return DynamicBatching(int(db.max_queue_delay_microseconds), tuple(db.preferred_batch_size), policy,
                                   int(db.priority_levels), int(db.default_priority_level))
        except ValueError as e:
            raise self.error([*steps, ("default_priority_level", None)], str(e)) from None

    def instance_groups(self) -> tuple[InstanceGroup, ...]:
        out = []
        for i, g in enumerate(self.msg.instance_group):
            steps: list[Step] = [("instance_group", i)]
            kind_name = self.enum_name(proto.pb.ModelInstanceGroup.Kind, g.kind, [*steps, ("kind", None)])
            if kind_name == "KIND_MODEL":
                raise self.error([*steps, ("kind", None)], "refused: KIND_MODEL (the model places itself) is not "
                                                           "supported: use KIND_GPU or KIND_CPU")
            if g.count < 0:
                raise self.error([*steps, ("count", None)], f"must be >= 1, got {g.count}")
            if len(g.gpus) and kind_name == "KIND_CPU":
                raise self.error([*steps, ("gpus", None)], f"gpus {list(g.gpus)} given for a KIND_CPU group")
            bad = [x for x in g.gpus if x < 0]
            if bad:
                raise self.error([*steps, ("gpus", None)], f"GPU ids must be >= 0, got {list(g.gpus)}")
            out.append(InstanceGroup(int(g.count) or 1, InstanceKind(kind_name), tuple(g.gpus), g.name))
        return tuple(out)

    def version_policy(self) -> VersionPolicy:
        m = self.msg
        if not m.HasField("version_policy"):
            return VersionPolicy()
        vp = m.version_policy
        which = vp.WhichOneof("policy_choice")
        steps: list[Step] = [("version_policy", None)]
        if which == "all":
            return VersionPolicy("all")
        if which == "specific":
            versions = tuple(int(v) for v in vp.specific.versions)
            if not versions or any(v < 1 for v in versions):
                raise self.error([*steps, ("specific", None)], f"specific needs versions >= 1, got {list(versions)}")
            return VersionPolicy("specific", versions=versions)
        if which == "latest":
            if vp.latest.num_versions < 1:
                raise self.error([*steps, ("latest", None)],
                                 f"latest needs num_versions >= 1, got {vp.latest.num_versions}")
            return VersionPolicy("latest", int(vp.latest.num_versions))
        return VersionPolicy()

    def warmups(self, signature: ModelSignature) -> tuple[Warmup, ...]:
        out = []
        for i, w in enumerate(self.msg.model_warmup):
            steps: list[Step] = [("model_warmup", i)]
            name = w.name or f"warmup {i}"
            batch = int(w.batch_size) or 1
            top = max(signature.max_batch_size, 1)
            if batch > top:
                raise self.error([*steps, ("batch_size", None)],
                                 f"warmup {name!r}: batch_size {batch} is more than the model takes ({top})")
            if not len(w.inputs):
                raise self.error(steps, f"warmup {name!r} has no inputs")
            inputs = []
            for key in sorted(w.inputs):
                inp = w.inputs[key]
                isteps: list[Step] = [*steps, ("inputs", key)]
                try:
                    spec = signature.input(key)
                except ValueError as e:
                    raise self.error(isteps, f"warmup {name!r}: {e}") from None
                dt_name = self.enum_name(proto.pb.DataType, inp.data_type, isteps)
                dt = DataType.from_config(dt_name) if dt_name != "TYPE_INVALID" else None
                if dt is not spec.datatype:
                    raise self.error(isteps, f"warmup {name!r}: input {key!r} is {dt_name}, the model takes "
                                             f"{spec.datatype.config_name}")
                dims = tuple(int(d) for d in inp.dims)
                if any(d < 1 for d in dims) or not spec.accepts(dims):
                    raise self.error(isteps, f"warmup {name!r}: input {key!r} dims {list(dims)} do not fit the "
                                             f"model's {list(spec.dims)} (a warm-up request has fixed dims)")
                which = inp.WhichOneof("input_data_type")
                if which is None:
                    raise self.error(isteps, f"warmup {name!r}: input {key!r} needs zero_data, random_data or "
                                             "input_data_file")
                data = {"zero_data": "zero", "random_data": "random", "input_data_file": "file"}[which]
                if data == "file" and not _plain_name(inp.input_data_file):
                    raise self.error(isteps, f"warmup {name!r}: input_data_file {inp.input_data_file!r} must be a "
                                             "file name in the model's warmup/ directory, not a path")
                inputs.append(WarmupInput(key, dt, dims, data,  # type: ignore[arg-type]
                                          inp.input_data_file if data == "file" else None))
            missing = [s.name for s in signature.inputs if not s.optional and s.name not in w.inputs]
            if missing:
                raise self.error(steps, f"warmup {name!r} leaves out inputs {missing}")
            out.append(Warmup(name, batch, tuple(inputs), int(w.count) or 1))
        return tuple(out)

    def accelerators(self, fmt: str) -> tuple[Accelerator, ...]:
        m = self.msg
        if not (m.HasField("optimization") and m.optimization.HasField("execution_accelerators")):
            return ()
        ea = m.optimization.execution_accelerators
        out = []
        for device, items in (("gpu", ea.gpu_execution_accelerator), ("cpu", ea.cpu_execution_accelerator)):
            for i, a in enumerate(items):
                steps: list[Step] = [("optimization", None), ("execution_accelerators", None),
                                     (f"{device}_execution_accelerator", i)]
                if a.name not in ACCELERATORS[device]:
                    raise self.error([*steps, ("name", None)],
                                     f"unknown {device} execution accelerator {a.name!r} (gpuprims maps "
                                     f"{', '.join(ACCELERATORS[device])})")
                if fmt != "onnx":
                    raise self.error([*steps, ("name", None)],
                                     f"execution accelerator {a.name!r} applies to ONNX models, not {fmt}")
                mode = a.parameters.get("precision_mode")
                if a.name == "tensorrt" and mode is not None and mode.upper() not in PRECISION_MODES:
                    raise self.error([*steps, ("parameters", "precision_mode")],
                                     f"precision_mode {mode!r} is not supported (one of {', '.join(PRECISION_MODES)})")
                for key in sorted(a.parameters):
                    if key not in ACCELERATOR_PARAMETERS[a.name]:
                        ign = f"optimization.execution_accelerators.{device}_execution_accelerator.{a.name}.{key}"
                        if ign not in self.ignored:
                            self.ignored.append(ign)
                out.append(Accelerator(a.name, device, tuple(a.parameters.items())))  # type: ignore[arg-type]
        return tuple(out)

    def parameters(self) -> GpuprimsParameters:
        params = self.msg.parameters
        values: dict[str, Any] = {}
        for key in sorted(params):
            if key not in GPUPRIMS_PARAMETERS:
                self.ignored.append(f"parameters.{key}")
                continue
            raw = params[key].string_value.strip()
            steps: list[Step] = [("parameters", key)]
            try:
                if key == "gpu_pct":
                    values[key] = int(raw)
                elif key == "slo_ms":
                    values[key] = float(raw)
                else:
                    values[key] = raw
                GpuprimsParameters(**{key: values[key]})
            except ValueError as e:
                msg = str(e) if key in values else f"{key} must be a number, got {raw!r}"
                if key == "gpu_pct" and key not in values:
                    msg = f"gpu_pct must be an integer percentage 1..100, got {raw!r}"
                raise self.error(steps, msg) from None
        return GpuprimsParameters(**values)
