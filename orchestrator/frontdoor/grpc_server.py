"""The Open Inference Protocol over gRPC (grpc.aio), registered as ``inference.GRPCInferenceService``.

RPCs: ServerLive, ServerReady, ServerMetadata, ModelReady, ModelMetadata, ModelInfer (typed
``contents`` or ``raw_input_contents`` in; ``raw_output_contents`` out), and Triton's ModelConfig,
ModelStatistics and RepositoryIndex, and the shared-memory RPCs (System/CudaSharedMemory Register,
Unregister, Status: orchestrator/frontdoor/shm.py). Others (streaming, load/unload) answer UNIMPLEMENTED.
Errors abort the call with the code of :data:`GRPC_CODE`.

Messages are bounded by what the models can take (:attr:`ModelInfo.max_message_bytes`): gRPC itself
refuses one larger than the largest model's bound with RESOURCE_EXHAUSTED before it is parsed, and
ModelInfer refuses one larger than its own model's bound the same way. A front door whose models can
change while it runs takes messages up to :data:`CHANGING_MODELS_MESSAGE_BYTES` before ModelInfer's
own check (:func:`max_message_bytes`).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
import numpy as np
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from gpuprims import __version__
from orchestrator.frontdoor import oip_pb2 as pb
from orchestrator.frontdoor import shm, tensors
from orchestrator.frontdoor.admission import AdmissionError, grpc_params
from orchestrator.frontdoor.core import Core, OipError
from orchestrator.frontdoor.http_server import EXTENSIONS
from orchestrator.frontdoor.models import NUMPY_OF, OUTPUT_NAME
from orchestrator.frontdoor.transport import Marks

SERVICE = "inference.GRPCInferenceService"
GRPC_CODE = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "not_found": grpc.StatusCode.NOT_FOUND,
             "unavailable": grpc.StatusCode.UNAVAILABLE, "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
             "internal": grpc.StatusCode.INTERNAL, "too_large": grpc.StatusCode.RESOURCE_EXHAUSTED,
             "unauthenticated": grpc.StatusCode.UNAUTHENTICATED}
#: Send limit of the server (an answer is max_batch x K floats; gRPC's default send limit is unbounded).
MAX_SEND_BYTES = 256 << 20
#: gRPC's receive limit at least, when models can be loaded or routed after the server starts: 64 MiB
#: (eight 3x1024x1024 float32 rows would not fit; such a model's requests over gRPC are refused
#: RESOURCE_EXHAUSTED, over HTTP served). ModelInfer still holds each message to its model's own bound.
CHANGING_MODELS_MESSAGE_BYTES = 64 << 20
#: Typed contents field of each datatype.
CONTENTS_FIELD = {"FP32": "fp32_contents", "UINT8": "uint_contents", "FP16": None, "INT64": "int64_contents",
                  "FP64": "fp64_contents", "INT32": "int_contents", "INT8": "int_contents", "BOOL": "bool_contents"}


def call_deadline_us(ctx: Any) -> int | None:
    """Microseconds left before the call's gRPC deadline (0: passed), or None without one. A deadline
    further than the OIP ``timeout`` parameter can say (2**32 µs, 71 min) counts as none: grpc reports
    a call without a deadline as one in the far future on some versions."""
    time_remaining = getattr(ctx, "time_remaining", None)
    left = time_remaining() if time_remaining is not None else None
    if left is None or left * 1e6 >= 2**32 - 1:
        return None
    return max(0, int(left * 1e6))


class Servicer:
    """The RPC implementations over one Core."""

    def __init__(self, core: Core) -> None:
        self.core = core

    async def ServerLive(self, req: pb.ServerLiveRequest, ctx: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, req: pb.ServerReadyRequest, ctx: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.core.server_ready())

    async def ServerMetadata(self, req: pb.ServerMetadataRequest, ctx: Any) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="gpuprims", version=__version__, extensions=EXTENSIONS)

    async def ModelReady(self, req: pb.ModelReadyRequest, ctx: Any) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=self.core.model_ready(req.name, req.version))

    async def ModelMetadata(self, req: pb.ModelMetadataRequest, ctx: Any) -> pb.ModelMetadataResponse:
        return json_format.ParseDict(self.core.model(req.name, req.version).metadata(), pb.ModelMetadataResponse())

    async def ModelConfig(self, req: pb.ModelConfigRequest, ctx: Any) -> pb.ModelConfigResponse:
        cfg = self.core.model(req.name, req.version).config()
        # A model file's config has more of Triton's fields than this service's ModelConfig carries.
        return pb.ModelConfigResponse(config=json_format.ParseDict(cfg, pb.ModelConfig(), ignore_unknown_fields=True))

    async def ModelStatistics(self, req: pb.ModelStatisticsRequest, ctx: Any) -> pb.ModelStatisticsResponse:
        stats = self.core.statistics(req.name, req.version)
        return json_format.ParseDict({"model_stats": stats}, pb.ModelStatisticsResponse())

    async def RepositoryIndex(self, req: pb.RepositoryIndexRequest, ctx: Any) -> pb.RepositoryIndexResponse:
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**m)
                                                  for m in self.core.index(req.ready)])

    async def ModelInfer(self, raw: bytes, ctx: Any) -> bytes:
        """Takes and returns the messages' bytes, so their parse and encode count in its stage times."""
        marks = Marks()
        try:
            req = pb.ModelInferRequest.FromString(raw)
        except DecodeError as e:
            raise OipError("invalid", f"ModelInferRequest does not parse: {e}") from None
        marks.lap("parse")
        info = self.core.model(req.model_name, req.model_version)
        left_us = call_deadline_us(ctx)
        self.core.admit(info, grpc_params(req, left_us))  # before the tensor is checked, decoded and placed
        if left_us == 0:  # it waited out its deadline before it reached the loop: no work is spent on it
            raise OipError("deadline", f"the call's deadline passed before model {info.name!r} was asked")
        size = req.ByteSize()
        if size > info.max_message_bytes:
            raise OipError("too_large", f"request of {size} bytes is larger than model {info.name!r} can take "
                                        f"({info.max_message_bytes} bytes: max_batch {info.max_batch} x its input)")
        shm.grpc_request(self.core, ctx, req)  # inputs in shared memory into raw_input_contents
        targets = shm.grpc_targets(self.core, ctx, req)  # outputs to shared memory
        if info.signature is not None:
            return await self._infer_tensors(info, req, left_us, marks, targets)
        if len(req.inputs) != 1:
            raise OipError("invalid", f"model {info.name!r} takes exactly one input, 'input'")
        t = req.inputs[0]
        shape = list(t.shape)
        self.core.check_input(info, t.name, t.datatype, shape)
        for o in req.outputs:
            if o.name != OUTPUT_NAME:
                raise OipError("invalid", f"unknown output {o.name!r}; the only output is {OUTPUT_NAME!r}")
        dtype = NUMPY_OF[info.datatype]
        n = math.prod(shape)  # not np.prod: tens of µs on a list, on every request
        if req.raw_input_contents:
            if len(req.raw_input_contents) != 1:
                raise OipError("invalid", f"{len(req.raw_input_contents)} raw_input_contents for one input")
            raw = req.raw_input_contents[0]
            if len(raw) != n * dtype.itemsize:
                raise OipError("invalid", f"input 'input' needs {n * dtype.itemsize} bytes of raw contents, "
                                          f"got {len(raw)}")
            x = np.frombuffer(raw, dtype=dtype).reshape(shape)
        else:
            field = CONTENTS_FIELD.get(info.datatype)
            values = getattr(t.contents, field) if field else []
            if len(values) != n:
                raise OipError("invalid", f"input 'input' has {len(values)} elements in contents.{field}, "
                                          f"shape {shape} needs {n}")
            x = np.asarray(values, dtype=dtype).reshape(shape)
        timeout = _timeout_us(req, left_us)
        marks.lap("decode")
        out = await self.core.infer(info, x, deadline_us=timeout, marks=marks)
        resp = _response(self.core, pb.ModelInferResponse(model_name=info.name, model_version="1", id=req.id),
                         {OUTPUT_NAME: out}, {OUTPUT_NAME: "FP32"}, targets)
        marks.lap("encode")
        self.core.commit("grpc", marks)
        return resp


    async def _infer_tensors(self, info: Any, req: Any, left_us: int | None, marks: Marks,
                             targets: dict[str, shm.TensorRef]) -> bytes:
        """An inference of a model file: named inputs in, the requested (or all) outputs back as raw
        contents."""
        inputs = tensors.grpc_inputs(info, req)
        wanted = tensors.requested_outputs(info, [o.name for o in req.outputs])
        timeout = _timeout_us(req, left_us)
        marks.lap("decode")
        answers = await self.core.infer_tensors(info, tensors.rows_of(info, inputs), deadline_us=timeout, marks=marks)
        out = tensors.gather_outputs(info, answers, wanted)
        resp = _response(self.core, pb.ModelInferResponse(model_name=info.name, model_version=info.version, id=req.id),
                         {n: out[n] for n in wanted}, {n: tensors.datatype_of(info, n).value for n in wanted}, targets)
        marks.lap("encode")
        self.core.commit("grpc", marks)
        return resp


def _response(core: Core, resp: Any, out: dict[str, np.ndarray], datatypes: dict[str, str],
              targets: dict[str, shm.TensorRef]) -> bytes:
    """The answer's bytes: each output described, its data as raw contents, or written into the shared
    memory its request named (then described by the region's parameters, with empty raw contents where
    other outputs have some: clients find an output's raw contents by its position among the outputs)."""
    aligned = any(name not in targets for name in out)
    for name, arr in out.items():
        t = resp.outputs.add(name=name, datatype=datatypes[name], shape=list(arr.shape))
        if name in targets:
            for k, v in shm.grpc_output_params(shm.put_output(core, targets[name], name, arr)).items():
                t.parameters[k].CopyFrom(pb.InferParameter(**v))
            if aligned:
                resp.raw_output_contents.append(b"")
        else:
            resp.raw_output_contents.append(np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes())
    return bytes(resp.SerializeToString())


def _timeout_us(req: Any, left_us: int | None) -> int:
    """The request's ``timeout`` parameter (microseconds, 0: the model's SLO), bounded by what is left of
    the call's own deadline."""
    timeout = req.parameters["timeout"].int64_param if "timeout" in req.parameters else 0
    if not 0 <= timeout < 2**32:
        raise OipError("invalid", f"parameter 'timeout' must be microseconds in 0..2**32-1, got {timeout}")
    if left_us is not None:  # the client's own deadline bounds the node's too
        timeout = left_us if timeout == 0 else min(timeout, left_us)
    return timeout


def _wrap(fn: Callable[[Any, Any], Awaitable[Any]]) -> Callable[[Any, Any], Awaitable[Any]]:
    async def call(req: Any, ctx: Any) -> Any:
        try:
            return await fn(req, ctx)
        except OipError as e:
            await ctx.abort(GRPC_CODE[e.kind], str(e))
        except AdmissionError as e:  # a refusal's Retry-After goes as trailing metadata "retry-after"
            await ctx.abort(GRPC_CODE[e.kind], str(e), tuple((k.lower(), v) for k, v in e.headers.items()))

    return call


def make_handler(core: Core) -> grpc.GenericRpcHandler:
    """The generic handler serving every implemented RPC of ``core``."""
    s = Servicer(core)
    methods = {}
    for name, (req_t, resp_t) in {
        "ServerLive": (pb.ServerLiveRequest, pb.ServerLiveResponse),
        "ServerReady": (pb.ServerReadyRequest, pb.ServerReadyResponse),
        "ServerMetadata": (pb.ServerMetadataRequest, pb.ServerMetadataResponse),
        "ModelReady": (pb.ModelReadyRequest, pb.ModelReadyResponse),
        "ModelMetadata": (pb.ModelMetadataRequest, pb.ModelMetadataResponse),
        "ModelInfer": (pb.ModelInferRequest, pb.ModelInferResponse),
        "ModelConfig": (pb.ModelConfigRequest, pb.ModelConfigResponse),
        "ModelStatistics": (pb.ModelStatisticsRequest, pb.ModelStatisticsResponse),
        "RepositoryIndex": (pb.RepositoryIndexRequest, pb.RepositoryIndexResponse),
    }.items():
        raw = name == "ModelInfer"  # parses and encodes its own messages (Servicer.ModelInfer)
        methods[name] = grpc.unary_unary_rpc_method_handler(
            _wrap(getattr(s, name)), request_deserializer=None if raw else req_t.FromString,
            response_serializer=None if raw else resp_t.SerializeToString)
    methods.update(shm.grpc_methods(core, _wrap))
    return grpc.method_handlers_generic_handler(SERVICE, methods)


def max_message_bytes(core: Core, *, models_change: bool = False) -> int:
    """gRPC's receive limit: the largest message any model can take (each ModelInfer has its own).
    gRPC fixes it when the server starts, so a front door whose models can change while it runs (the
    repository API loads them, a fleet's table routes them) takes at least
    :data:`CHANGING_MODELS_MESSAGE_BYTES`: a model loaded or routed later is held to its own bound by
    ModelInfer, not refused by a limit made for the models of the start."""
    bound = max((m.max_message_bytes for m in core.models.values()), default=4 << 20)
    return max(bound, CHANGING_MODELS_MESSAGE_BYTES) if models_change else bound


def make_server(core: Core, *, models_change: bool = False,
                interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> grpc.aio.Server:
    """A grpc.aio server with the service added (add a port, then ``await start()``); ``models_change``:
    see :func:`max_message_bytes`; ``interceptors`` see every call first (security.TokenGuard's)."""
    limit = max_message_bytes(core, models_change=models_change)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit),
                                      ("grpc.max_send_message_length", MAX_SEND_BYTES)],
                             interceptors=list(interceptors) or None)
    server.add_generic_rpc_handlers((make_handler(core),))
    return server
