"""Named tensors of any Triton datatype: the vocabulary of models users bring (torch-free).

A model has any number of named inputs and outputs (:class:`TensorSpec`), each of one of Triton's
datatypes (:class:`DataType`) with per-request dimensions where ``-1`` is dynamic; its
:class:`ModelSignature` adds ``max_batch_size`` (0: the model takes no batch dimension and is never
batched; its outputs may differ in size from request to request). These are the records the model
repository reads from ``config.pbtxt`` (or from the model file), the front door reports as model
metadata, the instance checks each request against and the engines run: one vocabulary from the
repository to the engine, as Triton's ``model_config.proto`` is for Triton.

Importing this module imports numpy only.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np


class DataType(enum.Enum):
    """Triton's tensor datatypes. ``.value`` is the OIP name (``FP32``); :attr:`config_name` is the
    ``config.pbtxt`` name (``TYPE_FP32``); :attr:`code` is the one-byte code a multi-tensor wire body
    names it by (docs/wire-format.md)."""

    BOOL = "BOOL"
    UINT8 = "UINT8"
    UINT16 = "UINT16"
    UINT32 = "UINT32"
    UINT64 = "UINT64"
    INT8 = "INT8"
    INT16 = "INT16"
    INT32 = "INT32"
    INT64 = "INT64"
    FP16 = "FP16"
    BF16 = "BF16"
    FP32 = "FP32"
    FP64 = "FP64"
    BYTES = "BYTES"

    @property
    def config_name(self) -> str:
        """The name in ``config.pbtxt`` (``data_type: TYPE_FP32``); BYTES is ``TYPE_STRING`` there."""
        return "TYPE_STRING" if self is DataType.BYTES else f"TYPE_{self.value}"

    @property
    def numpy(self) -> np.dtype:
        """The numpy dtype that holds it. numpy has no bfloat16: BF16 travels as its raw 16 bits
        (``uint16``), and the engines reinterpret them (torch ``view(torch.bfloat16)``)."""
        return _NUMPY[self]

    @property
    def itemsize(self) -> int:
        """Bytes per element (BYTES: 0, variable)."""
        return 0 if self is DataType.BYTES else self.numpy.itemsize

    @property
    def code(self) -> int:
        return _CODES[self]

    @property
    def numeric(self) -> bool:
        return self is not DataType.BYTES

    @classmethod
    def from_config(cls, name: str) -> DataType:
        """From a ``config.pbtxt`` name (``TYPE_FP32``); ValueError names the unknown one."""
        if name == "TYPE_STRING":
            return cls.BYTES
        if name.startswith("TYPE_"):
            try:
                return cls(name[5:])
            except ValueError:
                pass
        raise ValueError(f"unknown data_type {name!r} (one of {', '.join(d.config_name for d in cls)})")

    @classmethod
    def from_oip(cls, name: str) -> DataType:
        """From an OIP datatype name (``FP32``); ValueError names the unknown one."""
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"unknown datatype {name!r} (one of {', '.join(d.value for d in cls)})") from None

    @classmethod
    def from_code(cls, code: int) -> DataType:
        found = _BY_CODE.get(code)
        if found is None:
            raise ValueError(f"unknown tensor datatype code {code}")
        return found

    @classmethod
    def from_numpy(cls, dtype: np.dtype | str | type) -> DataType:
        """The datatype a numpy array of ``dtype`` carries (``uint16`` is UINT16, never BF16)."""
        dt = np.dtype(dtype)
        if dt.kind in "SUO":
            return cls.BYTES
        found = _FROM_NUMPY.get(dt.newbyteorder("=") if dt.byteorder == "<" else dt)
        if found is None:
            raise ValueError(f"no tensor datatype for numpy dtype {dt}")
        return found


_NUMPY: dict[DataType, np.dtype] = {
    DataType.BOOL: np.dtype(np.bool_), DataType.UINT8: np.dtype(np.uint8), DataType.UINT16: np.dtype("<u2"),
    DataType.UINT32: np.dtype("<u4"), DataType.UINT64: np.dtype("<u8"), DataType.INT8: np.dtype(np.int8),
    DataType.INT16: np.dtype("<i2"), DataType.INT32: np.dtype("<i4"), DataType.INT64: np.dtype("<i8"),
    DataType.FP16: np.dtype("<f2"), DataType.BF16: np.dtype("<u2"), DataType.FP32: np.dtype("<f4"),
    DataType.FP64: np.dtype("<f8"), DataType.BYTES: np.dtype(np.object_),
}
_CODES: dict[DataType, int] = {d: i + 1 for i, d in enumerate(DataType)}
_BY_CODE: dict[int, DataType] = {c: d for d, c in _CODES.items()}
_FROM_NUMPY: dict[np.dtype, DataType] = {v: k for k, v in _NUMPY.items()
                                         if k not in (DataType.BF16, DataType.BYTES)}


class SignatureError(ValueError):
    """A request's tensors do not fit the model: the message names the tensor and what the model wants."""


def _dims(value: Iterable[int], what: str) -> tuple[int, ...]:
    dims = tuple(value)
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or not (d == -1 or d >= 1):
            raise ValueError(f"{what}: dims must be integers >= 1, or -1 (any size), got {list(dims)}")
    return tuple(int(d) for d in dims)


@dataclass(frozen=True)
class TensorSpec:
    """One named input or output of a model.

    ``dims`` are the per-request dimensions (without the batch dimension a batched model adds), ``-1``
    where any size is taken. ``reshape`` (config.pbtxt's) is the shape the model itself sees for a
    request whose tensor has ``dims``. ``optional`` inputs may be left out of a request.
    """

    name: str
    datatype: DataType
    dims: tuple[int, ...]
    reshape: tuple[int, ...] | None = None
    optional: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a tensor needs a non-empty name, got {self.name!r}")
        if not isinstance(self.datatype, DataType):
            raise ValueError(f"tensor {self.name!r}: datatype must be a DataType, got {self.datatype!r}")
        object.__setattr__(self, "dims", _dims(self.dims, f"tensor {self.name!r}"))
        if self.reshape is not None:
            object.__setattr__(self, "reshape", _dims(self.reshape, f"tensor {self.name!r} reshape"))

    @property
    def dynamic(self) -> bool:
        return any(d == -1 for d in self.dims)

    def fixed_bytes(self) -> int | None:
        """Bytes of one request's tensor when every dimension is fixed and the type numeric, else None."""
        if self.dynamic or not self.datatype.numeric:
            return None
        return math.prod(self.dims) * self.datatype.itemsize

    def accepts(self, shape: tuple[int, ...]) -> bool:
        """Whether a per-request tensor of ``shape`` fits ``dims`` (-1 takes any size)."""
        return len(shape) == len(self.dims) and all(d == -1 or d == s for d, s in zip(self.dims, shape))

    def describe(self) -> str:
        """``name FP32 [3,-1]`` for error messages."""
        return f"{self.name!r} {self.datatype.value} [{','.join(map(str, self.dims))}]"


@dataclass(frozen=True)
class ModelSignature:
    """A model's inputs, outputs and batching: what a request must carry and what it gets back.

    ``max_batch_size`` > 0: every tensor has a leading batch dimension the node fills by stacking
    requests of the same shapes (up to that many); 0: no batch dimension, one request per run.
    """

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int = 0
    extra: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        if not self.inputs:
            raise ValueError("a model needs at least one input")
        if not self.outputs:
            raise ValueError("a model needs at least one output")
        for what, specs in (("input", self.inputs), ("output", self.outputs)):
            names = [s.name for s in specs]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"{what} names must be unique, repeated: {dup}")
        if isinstance(self.max_batch_size, bool) or not isinstance(self.max_batch_size, int) \
                or self.max_batch_size < 0:
            raise ValueError(f"max_batch_size must be an integer >= 0, got {self.max_batch_size!r}")

    @property
    def batched(self) -> bool:
        return self.max_batch_size > 0

    def input(self, name: str) -> TensorSpec:
        for s in self.inputs:
            if s.name == name:
                return s
        raise SignatureError(f"unknown input {name!r}: the model's inputs are "
                             f"{', '.join(s.describe() for s in self.inputs)}")

    def output(self, name: str) -> TensorSpec:
        for s in self.outputs:
            if s.name == name:
                return s
        raise SignatureError(f"unknown output {name!r}: the model's outputs are "
                             f"{', '.join(s.describe() for s in self.outputs)}")

    def check_request(self, tensors: Mapping[str, np.ndarray]) -> None:
        """Check one request's tensors (per-request shapes, no batch dimension): every required input
        present, nothing unknown, each of its datatype and dims. Raises :class:`SignatureError` naming
        the first tensor that does not fit and what the model wants."""
        for name in tensors:
            self.input(name)
        for spec in self.inputs:
            arr = tensors.get(spec.name)
            if arr is None:
                if spec.optional:
                    continue
                raise SignatureError(f"missing input {spec.describe()}")
            want = spec.datatype.numpy
            got = arr.dtype
            if spec.datatype is DataType.BYTES:
                fits = got.kind in "SUO"
            else:
                fits = got.newbyteorder("=") == want.newbyteorder("=")
            if not fits:
                raise SignatureError(f"input {spec.name!r} has datatype {_name_of(got)}, the model wants "
                                     f"{spec.datatype.value}")
            if not spec.accepts(tuple(arr.shape)):
                raise SignatureError(f"input {spec.name!r} has shape {list(arr.shape)}, the model wants "
                                     f"[{','.join(map(str, spec.dims))}] (-1: any size)")

    def shape_key(self, tensors: Mapping[str, np.ndarray]) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """What requests must share to be batched together: the names and shapes of their inputs."""
        return tuple((name, tuple(tensors[name].shape)) for name in sorted(tensors))

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form (the instance spec, status)."""
        def one(s: TensorSpec) -> dict[str, object]:
            d: dict[str, object] = {"name": s.name, "datatype": s.datatype.value, "dims": list(s.dims)}
            if s.reshape is not None:
                d["reshape"] = list(s.reshape)
            if s.optional:
                d["optional"] = True
            return d
        return {"inputs": [one(s) for s in self.inputs], "outputs": [one(s) for s in self.outputs],
                "max_batch_size": self.max_batch_size}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> ModelSignature:
        def one(d: Mapping[str, object]) -> TensorSpec:
            reshape = d.get("reshape")
            return TensorSpec(str(d["name"]), DataType.from_oip(str(d["datatype"])), tuple(d["dims"]),  # type: ignore[arg-type]
                              tuple(reshape) if reshape is not None else None,  # type: ignore[arg-type]
                              bool(d.get("optional", False)))
        return cls(tuple(one(d) for d in data["inputs"]), tuple(one(d) for d in data["outputs"]),  # type: ignore[union-attr]
                   int(data.get("max_batch_size", 0)))  # type: ignore[arg-type]


def _name_of(dt: np.dtype) -> str:
    try:
        return DataType.from_numpy(dt).value
    except ValueError:
        return str(dt)
