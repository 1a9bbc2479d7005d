"""Triton's ``ModelConfig`` protobuf message: the one place gpuprims takes it from.

A ``config.pbtxt`` is a ``inference.ModelConfig`` message in protobuf's text format
(Triton's ``model_config.proto``). gpuprims does not copy the schema: it uses the generated module
``tritonclient`` ships (``tritonclient.grpc.model_config_pb2``), so a field Triton adds is parsed
the same way (and refused by :mod:`gpuprims.modelrepo.config` until someone decides it).

Importing this module imports protobuf and tritonclient's generated message module only (no gRPC
channel, no numpy).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

#: The generated module (enums such as ``pb.DataType``, nested messages such as ``pb.ModelInput``).
pb = model_config_pb2
#: The message class of one model's configuration.
ModelConfigMessage = model_config_pb2.ModelConfig
#: protobuf's text-format parse error (carries the line and column of a syntax error).
ParseError = text_format.ParseError


def parse_text(text: str) -> Any:
    """A ``ModelConfig`` message from ``config.pbtxt`` text; raises :data:`ParseError` (line and
    column) on a syntax error, an unknown field or enum value."""
    msg = ModelConfigMessage()
    text_format.Parse(text, msg, allow_unknown_field=False)
    return msg


def to_dict(msg: Any) -> dict[str, Any]:
    """The message as JSON-ready data with the proto's own field names (as Triton's ``config``
    endpoint reports it; 64-bit integers as strings, protobuf's JSON mapping)."""
    return json_format.MessageToDict(msg, preserving_proto_field_name=True)


def from_dict(data: dict[str, Any]) -> Any:
    """The message back from :func:`to_dict`'s data; raises ``json_format.ParseError`` on bad data."""
    msg = ModelConfigMessage()
    json_format.ParseDict(data, msg)
    return msg


def to_text(msg: Any) -> str:
    """The message in ``config.pbtxt`` text format."""
    return text_format.MessageToString(msg)


def text_from_dict(data: Mapping[str, Any]) -> str:
    """``config.pbtxt`` text of config keys given as a mapping (apps.yaml's ``config:``), in the proto's
    field names. A ``max_batch_size: 0`` the mapping writes is kept in the text, where protobuf would
    drop it as a default: completion tells a written 0 (no batching) from an absent one. Raises
    ``json_format.ParseError`` on a key or value the message does not have."""
    text = to_text(from_dict(dict(data)))
    if "max_batch_size" in data and from_dict({"max_batch_size": data["max_batch_size"]}).max_batch_size == 0:
        text += "max_batch_size: 0\n"
    return text
