"""Typed control-plane messages and their wire encoding (no pickle).

A message is a frozen dataclass with a one-byte ``TAG``. On the wire it is a list of frames::

    [token, header, *blobs]

``token`` is the per-run secret (see `orchestrator.control.channel`), ``header`` is the tag byte followed by a
UTF-8 JSON object of the message's fields, and ``blobs`` are big payloads (CUDA IPC handles, arrays)
carried as separate frames so they are never JSON-escaped or copied into the header. A field that is a
record (`orchestrator.control.records.InstanceStats`) travels as its ``to_wire()`` object and is
rebuilt, and checked field by field, by its ``from_wire``. The tag values
of Finish (2) and Ended (3) are those of the paper (V-C).

`decode` checks everything: the tag is known, the JSON is an object with exactly the message's fields,
each of the right type, and the frame count and sizes are within bounds. Anything else raises
`ProtocolError` whose ``reason`` is a short counter key (``unknown_tag``, ``malformed``, ...); the
transports count those and drop the message, never crash.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from orchestrator.control.records import InstanceStats

__all__ = [
    "FROM_CLI",
    "FROM_INSTANCE",
    "FROM_ORCHESTRATOR",
    "MAX_BLOBS",
    "MAX_HEADER_BYTES",
    "MESSAGE_TYPES",
    "BatchDone",
    "Ended",
    "Error",
    "Finish",
    "Heartbeat",
    "InitGpu",
    "Message",
    "ProtocolError",
    "Ready",
    "Result",
    "RunBatch",
    "SetGpuRequest",
    "Shutdown",
    "StatsReply",
    "StatsRequest",
    "StatusReply",
    "StatusRequest",
    "StopRequest",
    "decode",
    "decode_header",
    "encode",
    "encode_header",
]

#: Largest JSON header frame accepted, in bytes (a status reply of many apps fits easily).
MAX_HEADER_BYTES = 1 << 20
#: Most blob frames one message may carry.
MAX_BLOBS = 64


class ProtocolError(ValueError):
    """A frame list that is not a valid message. ``reason`` is the counter key it is counted under."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (type(self), (self.reason, self.detail))


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """Base of all control messages. ``blobs`` travel as separate frames after the header."""

    TAG: ClassVar[int] = 0
    blobs: tuple[bytes, ...] = field(default=(), repr=False, compare=True)


# ---- instance -> orchestrator


@dataclass(frozen=True, slots=True, kw_only=True)
class Ready(Message):
    """An instance finished starting (model loaded, or CPU side ready for a shadow)."""

    TAG: ClassVar[int] = 1
    instance: str
    pid: int
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class Ended(Message):
    """The active instance drained its queue after Finish (paper <3, Ended>)."""

    TAG: ClassVar[int] = 3
    instance: str
    drained_count: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat(Message):
    """Periodic liveness plus the instance's counters (its app's `orchestrator.control.stats.AppStatistics` keeps them)."""

    TAG: ClassVar[int] = 4
    instance: str
    stats: InstanceStats = field(default_factory=InstanceStats)


@dataclass(frozen=True, slots=True, kw_only=True)
class StatsReply(Message):
    """Answer to StatsRequest."""

    TAG: ClassVar[int] = 6
    instance: str
    stats: InstanceStats = field(default_factory=InstanceStats)


@dataclass(frozen=True, slots=True, kw_only=True)
class Error(Message):
    """An instance reports a failure; ``kind`` is a short class name (``cuda_oom``, ``model_load``)."""

    TAG: ClassVar[int] = 10
    instance: str
    kind: str
    message: str


# ---- orchestrator -> instance


@dataclass(frozen=True, slots=True, kw_only=True)
class Finish(Message):
    """Stop taking new requests, drain the queue, then send Ended (paper <2, Finish>)."""

    TAG: ClassVar[int] = 2
    instance: str


@dataclass(frozen=True, slots=True, kw_only=True)
class StatsRequest(Message):
    """Ask an instance for its counters now."""

    TAG: ClassVar[int] = 5
    instance: str


@dataclass(frozen=True, slots=True, kw_only=True)
class InitGpu(Message):
    """A shadow initialises its GPU side with this GPU% and loads the model, then sends Ready."""

    TAG: ClassVar[int] = 8
    instance: str
    gpu_pct: int
    # Backend-specific placement decided by the orchestrator, e.g. {"cores": [0], "threads": 1} on cpu.
    settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_pct(self.gpu_pct)


@dataclass(frozen=True, slots=True, kw_only=True)
class Shutdown(Message):
    """Exit; with ``drain`` answer everything queued first, else answer it SHUTTING_DOWN."""

    TAG: ClassVar[int] = 9
    instance: str
    drain: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class RunBatch(Message):
    """The live scheduler's decision for a dispatched instance: take ``batch`` requests from the front
    of stage ``stage``'s queue and run them at ``gpu_pct`` (``action`` "run") or answer them
    DEADLINE_MISSED ("reject"); the instance replies `BatchDone` with the same ``id``."""

    TAG: ClassVar[int] = 16
    instance: str
    id: int
    stage: str
    batch: int
    gpu_pct: int = 100
    action: str = "run"

    def __post_init__(self) -> None:
        if self.id < 0 or self.batch < 1:
            raise ValueError(f"RunBatch needs id >= 0 and batch >= 1, got id={self.id} batch={self.batch}")
        if self.action not in ("run", "reject"):
            raise ValueError(f"RunBatch action must be 'run' or 'reject', got {self.action!r}")
        _check_pct(self.gpu_pct)


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchDone(Message):
    """A `RunBatch` finished: ``taken`` requests left the stage's queue, ``measured_ms`` of model time;
    ``routed`` maps each later stage to the deadlines (ms, CLOCK_MONOTONIC) of the requests this
    batch passed to it, in queue order; ``error`` is set when the batch failed (answered INTERNAL)."""

    TAG: ClassVar[int] = 17
    instance: str
    id: int
    taken: int
    measured_ms: float
    routed: dict[str, Any] = field(default_factory=dict)
    error: str = ""


# ---- CLI <-> orchestrator


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusRequest(Message):
    """Ask the node for its status (`orchestrator.node.node.Node.status`)."""

    TAG: ClassVar[int] = 11


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusReply(Message):
    """The node's status: its view's JSON (`NodeView.to_dict`; the CLI reads it back with `NodeView.from_dict`)."""

    TAG: ClassVar[int] = 12
    status: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class StopRequest(Message):
    """Stop the node; with ``drain`` answer in-flight requests first."""

    TAG: ClassVar[int] = 13
    drain: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class SetGpuRequest(Message):
    """Change an app's GPU% (Overlapped-Execution, or restart when the app has no shadow)."""

    TAG: ClassVar[int] = 14
    app: str
    gpu_pct: int

    def __post_init__(self) -> None:
        _check_pct(self.gpu_pct)


@dataclass(frozen=True, slots=True, kw_only=True)
class Result(Message):
    """Acknowledgement of a request: ``ok`` plus a human-readable message and optional data."""

    TAG: ClassVar[int] = 15
    ok: bool
    message: str = ""
    data: dict[str, Any] = field(default_factory=dict)


def _check_pct(v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 100:
        raise ValueError(f"gpu_pct must be an integer in 1..100, got {v!r}")


MESSAGE_TYPES: dict[int, type[Message]] = {
    cls.TAG: cls
    for cls in (Ready, Finish, Ended, Heartbeat, StatsRequest, StatsReply, InitGpu, Shutdown,
                Error, StatusRequest, StatusReply, StopRequest, SetGpuRequest, Result, RunBatch, BatchDone)
}
assert len(MESSAGE_TYPES) == 16 and all(0 < t < 256 for t in MESSAGE_TYPES)

#: Which tags each side may send; a receiver drops the rest as ``wrong_direction``.
FROM_INSTANCE = frozenset({Ready.TAG, Ended.TAG, Heartbeat.TAG, StatsReply.TAG, Error.TAG, Result.TAG,
                           BatchDone.TAG})
FROM_ORCHESTRATOR = frozenset({Finish.TAG, StatsRequest.TAG, InitGpu.TAG, Shutdown.TAG,
                               RunBatch.TAG})
FROM_CLI = frozenset({StatusRequest.TAG, StopRequest.TAG, SetGpuRequest.TAG})
TO_CLI = frozenset({StatusReply.TAG, Result.TAG})

# Field name -> JSON kind, per message type, derived once from the annotations.
_KINDS = {"int": int, "bool": bool, "str": str, "float": float}
#: Record field types (encoded by ``to_wire()``, decoded and checked by ``from_wire``), by kind name.
_RECORDS: dict[str, Any] = {"InstanceStats": InstanceStats}


def _field_kinds(cls: type[Message]) -> dict[str, str]:
    hints = typing.get_type_hints(cls)
    out: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        if f.name == "blobs":
            continue
        t = hints[f.name]
        origin = typing.get_origin(t)
        if origin is dict:
            out[f.name] = "dict"
        elif t in (int, bool, str, float) or _RECORDS.get(getattr(t, "__name__", "")) is t:
            out[f.name] = t.__name__  # a record travels as its to_wire() object
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: unsupported field type {t!r}")
    return out


_FIELDS: dict[int, dict[str, str]] = {tag: _field_kinds(cls) for tag, cls in MESSAGE_TYPES.items()}
_REQUIRED: dict[int, frozenset[str]] = {
    tag: frozenset(f.name for f in dataclasses.fields(cls) if f.name != "blobs"
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    for tag, cls in MESSAGE_TYPES.items()
}


def _json_default(o: object) -> object:
    # numpy scalars in stats dicts are common; anything else is a programming error.
    for attr in ("item",):
        if hasattr(o, attr):
            return o.item()  # type: ignore[attr-defined]
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")


def encode_header(msg: Message) -> bytes:
    """The header frame of ``msg``: tag byte plus the JSON of its fields (blobs excluded)."""
    tag = type(msg).TAG
    if MESSAGE_TYPES.get(tag) is not type(msg):
        raise TypeError(f"{type(msg).__name__} is not a registered control message")
    body = {name: getattr(msg, name) for name in _FIELDS[tag]}
    for name, kind in _FIELDS[tag].items():
        if kind in _RECORDS:
            body[name] = body[name].to_wire()
    try:
        text = json.dumps(body, separators=(",", ":"), allow_nan=False, default=_json_default)
    except (TypeError, ValueError) as e:
        raise ValueError(f"cannot encode {type(msg).__name__}: {e}") from None
    data = bytes([tag]) + text.encode("utf-8")
    if len(data) > MAX_HEADER_BYTES:
        raise ValueError(f"{type(msg).__name__} header is {len(data)} bytes > {MAX_HEADER_BYTES}; "
                         "send big payloads as blobs")
    return data


def encode(msg: Message, token: bytes) -> list[bytes]:
    """Frames of ``msg`` as sent: [token, header, *blobs]."""
    if len(msg.blobs) > MAX_BLOBS:
        raise ValueError(f"{type(msg).__name__} carries {len(msg.blobs)} blobs > {MAX_BLOBS}")
    return [token, encode_header(msg), *(bytes(b) for b in msg.blobs)]


def _check_value(kind: str, value: object) -> bool:
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if kind == "dict" or kind in _RECORDS:
        return isinstance(value, dict)
    return isinstance(value, _KINDS[kind])


def decode_header(header: bytes, blobs: tuple[bytes, ...] = ()) -> Message:
    """Rebuild a message from its header frame and blobs, or raise ProtocolError."""
    if len(header) < 1:
        raise ProtocolError("malformed", "empty header frame")
    if len(header) > MAX_HEADER_BYTES:
        raise ProtocolError("oversized", f"header frame of {len(header)} bytes > {MAX_HEADER_BYTES}")
    tag = header[0]
    cls = MESSAGE_TYPES.get(tag)
    if cls is None:
        raise ProtocolError("unknown_tag", f"unknown message tag {tag}")
    try:
        body = json.loads(bytes(header[1:]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError("malformed", f"{cls.__name__} body is not UTF-8 JSON: {e}") from None
    if not isinstance(body, dict):
        raise ProtocolError("malformed", f"{cls.__name__} body must be a JSON object, got {type(body).__name__}")
    kinds = _FIELDS[tag]
    unknown = set(body) - set(kinds)
    if unknown:
        raise ProtocolError("malformed", f"{cls.__name__} has unknown fields {sorted(unknown)}")
    missing = _REQUIRED[tag] - set(body)
    if missing:
        raise ProtocolError("malformed", f"{cls.__name__} lacks fields {sorted(missing)}")
    for name, value in body.items():
        if not _check_value(kinds[name], value):
            raise ProtocolError("malformed", f"{cls.__name__}.{name} must be {kinds[name]}, got {value!r:.80}")
    try:
        for name, value in body.items():
            if kinds[name] in _RECORDS:
                body[name] = _RECORDS[kinds[name]].from_wire(value)
        return cls(**body, blobs=tuple(blobs))
    except (TypeError, ValueError) as e:
        raise ProtocolError("malformed", f"{cls.__name__}: {e}") from None


def decode(frames: list[bytes] | tuple[bytes, ...]) -> tuple[bytes, Message]:
    """Split [token, header, *blobs] into the token and the message, or raise ProtocolError."""
    if len(frames) < 2:
        raise ProtocolError("malformed", f"expected at least 2 frames (token, header), got {len(frames)}")
    if len(frames) - 2 > MAX_BLOBS:
        raise ProtocolError("oversized", f"{len(frames) - 2} blob frames > {MAX_BLOBS}")
    return bytes(frames[0]), decode_header(frames[1], tuple(bytes(b) for b in frames[2:]))
