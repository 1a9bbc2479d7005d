"""The Open Inference Protocol over HTTP/REST (aiohttp), with Triton's binary tensor data extension.

Routes (``/versions/<v>`` may follow a model name: that version; without it a model's highest ready version):

- ``GET /v2/health/live``, ``GET /v2/health/ready``, ``GET /v2``: server liveness, readiness, metadata
- ``GET /v2/models/<name>``, ``GET /v2/models/<name>/ready``: model metadata and readiness
- ``POST /v2/models/<name>/infer``: inference, JSON or JSON + binary (``Inference-Header-Content-Length``);
  gzip/deflate request bodies (``Content-Encoding``) and answers (``Accept-Encoding``)
- ``GET /v2/models/<name>/config``, ``GET /v2/models[/<name>]/stats``: Triton model configuration
  and statistics; ``POST /v2/repository/index``: the model repository index
- ``/v2/systemsharedmemory/...``, ``/v2/cudasharedmemory/...``: Triton's shared-memory extensions
  (orchestrator/frontdoor/shm.py); an inference's inputs and outputs may name their regions

Errors are ``{"error": "<message>"}`` with the code of :data:`core.HTTP_CODE`.

An inference body is bounded by what its model can take (:meth:`ModelInfo.max_body_bytes`): a
declared ``Content-Length`` above it is answered 413 before any of the body is read (and before
``100 Continue`` when the client asks for it); a chunked or compressed body is read only up to it.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
from aiohttp import web

from gpuprims import __version__
from orchestrator.frontdoor import shm, tensors
from orchestrator.frontdoor.admission import AdmissionError, http_params
from orchestrator.frontdoor.core import Core, OipError
from orchestrator.frontdoor.models import NUMPY_OF, OUTPUT_NAME
from orchestrator.frontdoor.repository_api import add_repository_routes
from orchestrator.frontdoor.transport import Marks

HEADER_LENGTH = "Inference-Header-Content-Length"
EXTENSIONS = ["binary_tensor_data", "model_configuration", "statistics", "model_repository", *shm.EXTENSIONS]

CORE_KEY: web.AppKey[Core] = web.AppKey("core", Core)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status)


def _error(e: OipError) -> web.Response:
    return _json({"error": str(e)}, e.http_status)


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except OipError as e:
        return _error(e)
    except AdmissionError as e:  # refused (503/429 with Retry-After) or a bad priority/timeout (400)
        return web.json_response({"error": str(e)}, status=e.http_status, headers=e.headers)


def _core(request: web.Request) -> Core:
    return request.app[CORE_KEY]


def _model(request: web.Request) -> Any:
    return _core(request).model(request.match_info["name"], request.match_info.get("version", ""))


async def live(request: web.Request) -> web.Response:
    return _json({"live": True})


async def ready(request: web.Request) -> web.Response:
    ok = _core(request).server_ready()
    return _json({"ready": ok}, 200 if ok else 503)


async def server_metadata(request: web.Request) -> web.Response:
    return _json({"name": "gpuprims", "version": __version__, "extensions": EXTENSIONS})


async def model_metadata(request: web.Request) -> web.Response:
    return _json(_model(request).metadata())


async def model_ready(request: web.Request) -> web.Response:
    info = _model(request)
    ok = _core(request).model_ready(info.name, request.match_info.get("version", ""))
    return _json({"name": info.name, "ready": ok}, 200 if ok else 503)


async def model_config(request: web.Request) -> web.Response:
    return _json(_model(request).config())


async def model_stats(request: web.Request) -> web.Response:
    core = _core(request)
    return _json({"model_stats": core.statistics(request.match_info.get("name", ""),
                                                 request.match_info.get("version", ""))})


async def repository_index(request: web.Request) -> web.Response:
    core = _core(request)
    ready_only = False
    if request.can_read_body:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            raise OipError("invalid", "the repository index request must be a JSON object") from None
        ready_only = bool(body.get("ready", False)) if isinstance(body, dict) else False
    return _json(core.index(ready_only))


def _parse_body(body: bytes, header_len: str | None) -> tuple[dict[str, Any], memoryview]:
    """Split a request into its JSON header and the binary data after it."""
    if header_len is None:
        json_len = len(body)
    else:
        try:
            json_len = int(header_len)
        except ValueError:
            raise OipError("invalid", f"{HEADER_LENGTH} must be an integer, got {header_len!r}") from None
        if not 0 < json_len <= len(body):
            raise OipError("invalid", f"{HEADER_LENGTH} {json_len} is outside the body of {len(body)} bytes")
    try:
        req = json.loads(body[:json_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise OipError("invalid", f"request is not valid JSON: {e}") from None
    if not isinstance(req, dict):
        raise OipError("invalid", "request must be a JSON object with 'inputs'")
    return req, memoryview(body)[json_len:]


def _input_array(core: Core, info: Any, req: dict[str, Any], binary: memoryview) -> np.ndarray:
    inputs = req.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise OipError("invalid", f"model {info.name!r} takes exactly one input, 'input'")
    t = inputs[0]
    shape = t.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise OipError("invalid", "input 'shape' must be a list of integers")
    core.check_input(info, str(t.get("name")), str(t.get("datatype")), shape)
    dtype = NUMPY_OF[info.datatype]
    want = math.prod(shape) * dtype.itemsize  # not np.prod: tens of µs on a list, on every request
    params = t.get("parameters") or {}
    if "binary_data_size" in params:
        size = params["binary_data_size"]
        if size != want or len(binary) != want:
            raise OipError("invalid", f"input 'input' needs {want} bytes of binary data, binary_data_size is "
                                      f"{size!r} and {len(binary)} bytes follow the JSON header")
        return np.frombuffer(binary, dtype=dtype).reshape(shape)
    if len(binary):
        raise OipError("invalid", f"{len(binary)} bytes of binary data but no input has binary_data_size")
    if "data" not in t:
        raise OipError("invalid", "input 'input' has neither 'data' nor binary_data_size")
    try:
        arr = np.asarray(t["data"], dtype=dtype)
    except (ValueError, TypeError, OverflowError) as e:
        raise OipError("invalid", f"input 'input' data is not {info.datatype}: {e}") from None
    if arr.size != math.prod(shape):
        raise OipError("invalid", f"input 'input' has {arr.size} elements, shape {shape} needs {math.prod(shape)}")
    return arr.reshape(shape)


def _wants_binary(req: dict[str, Any]) -> bool:
    outputs = req.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, list) or not all(isinstance(o, dict) for o in outputs):
            raise OipError("invalid", "'outputs' must be a list of objects")
        for o in outputs:
            if o.get("name") != OUTPUT_NAME:
                raise OipError("invalid", f"unknown output {o.get('name')!r}; the only output is {OUTPUT_NAME!r}")
        if any((o.get("parameters") or {}).get("binary_data") for o in outputs):
            return True
    return bool((req.get("parameters") or {}).get("binary_data_output", False))


def _too_large(info: Any, request: web.Request, size: str) -> OipError:
    limit = info.max_body_bytes(HEADER_LENGTH in request.headers)
    return OipError("too_large", f"request body of {size} is larger than model {info.name!r} can take "
                                 f"({limit} bytes: max_batch {info.max_batch} x its input, and the "
                                 f"{'JSON header' if HEADER_LENGTH in request.headers else 'JSON text'})")


def _check_length(info: Any, request: web.Request) -> int:
    """The body bound of this request's model; OipError too_large when Content-Length exceeds it."""
    limit = int(info.max_body_bytes(HEADER_LENGTH in request.headers))
    declared = request.content_length
    if declared is not None and declared > limit:
        raise _too_large(info, request, f"{declared} bytes")
    return limit


async def _read_bounded(request: web.Request, limit: int, info: Any) -> bytes:
    """The body, read (and decompressed) only up to ``limit`` bytes; OipError too_large past it."""
    body = bytearray()
    while True:
        chunk = await request.content.readany()
        if not chunk:
            return bytes(body)
        if len(body) + len(chunk) > limit:
            raise _too_large(info, request, f"more than {limit} bytes")
        body += chunk


async def infer_expect(request: web.Request) -> web.StreamResponse | None:
    """``Expect: 100-continue``: refuse an unknown model or an oversized body before the client sends it."""
    expect = request.headers.get("Expect", "")
    if expect.lower() != "100-continue":
        raise web.HTTPExpectationFailed(text=f"Unknown Expect: {expect}")
    try:
        _check_length(_model(request), request)
    except OipError as e:
        resp = _error(e)
        resp.force_close()
        return resp
    if request.version >= (1, 1):
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # as aiohttp's own handler: the answer's body has not begun
    return None


async def infer(request: web.Request) -> web.Response:
    core = _core(request)
    marks = Marks()
    info = _model(request)
    try:
        limit = _check_length(info, request)
        body = await _read_bounded(request, limit, info)
    except OipError as e:
        resp = _error(e)
        resp.force_close()  # the rest of the body is not read: the connection cannot carry another request
        return resp
    req, binary = _parse_body(body, request.headers.get(HEADER_LENGTH))
    # Admission: after the body is read (the connection stays usable), before its tensors are decoded.
    core.admit(info, http_params(req))
    req, binary = shm.http_request(core, request.remote or "", req, binary)  # inputs in shared memory
    targets = shm.http_targets(core, request.remote or "", req)  # outputs to shared memory
    marks.lap("parse")
    if info.signature is not None:
        return await _infer_tensors(core, info, req, binary, request, marks, targets)
    x = _input_array(core, info, req, binary)
    binary_out = _wants_binary(req)
    timeout_us = _timeout_us(req)
    marks.lap("decode")
    out = await core.infer(info, x, deadline_us=timeout_us, marks=marks)
    head: dict[str, Any] = {"model_name": info.name, "model_version": "1"}
    if "id" in req:
        head["id"] = req["id"]
    tensor: dict[str, Any] = {"name": OUTPUT_NAME, "datatype": "FP32", "shape": list(out.shape)}
    if OUTPUT_NAME in targets:
        tensor["parameters"] = shm.put_output(core, targets[OUTPUT_NAME], OUTPUT_NAME, out)
        head["outputs"] = [tensor]
        resp = _json(head)
    elif not binary_out:
        tensor["data"] = out.reshape(-1).tolist()
        head["outputs"] = [tensor]
        resp = _json(head)
    else:
        raw = np.ascontiguousarray(out, dtype="<f4").tobytes()
        tensor["parameters"] = {"binary_data_size": len(raw)}
        head["outputs"] = [tensor]
        js = json.dumps(head).encode()
        resp = web.Response(body=js + raw, content_type="application/octet-stream",
                            headers={HEADER_LENGTH: str(len(js))})
    if request.headers.get("Accept-Encoding"):
        resp.enable_compression()  # gzip/deflate as the client accepts (tritonclient's response compression)
    marks.lap("encode")
    core.commit("http", marks)
    return resp


def _timeout_us(req: dict[str, Any]) -> int:
    """The request's ``timeout`` parameter (microseconds, 0: the model's SLO)."""
    timeout_us = (req.get("parameters") or {}).get("timeout", 0)
    if not isinstance(timeout_us, int) or isinstance(timeout_us, bool) or not 0 <= timeout_us < 2**32:
        raise OipError("invalid", f"parameter 'timeout' must be microseconds in 0..2**32-1, got {timeout_us!r}")
    return timeout_us


def _respond(request: web.Request, head: dict[str, Any], raws: list[bytes]) -> web.Response:
    """The answer: JSON alone, or the JSON header and the outputs' binary data after it."""
    if not raws:
        resp = _json(head)
    else:
        js = json.dumps(head).encode()
        resp = web.Response(body=b"".join([js, *raws]), content_type="application/octet-stream",
                            headers={HEADER_LENGTH: str(len(js))})
    if request.headers.get("Accept-Encoding"):
        resp.enable_compression()  # gzip/deflate as the client accepts (tritonclient's response compression)
    return resp


async def _infer_tensors(core: Core, info: Any, req: dict[str, Any], binary: memoryview, request: web.Request,
                         marks: Marks, targets: dict[str, shm.TensorRef]) -> web.Response:
    """An inference of a model file: named inputs in, the requested (or all) named outputs back."""
    inputs = tensors.http_inputs(info, req, binary)
    names, binary_names = tensors.http_outputs(req)
    wanted = tensors.requested_outputs(info, names)
    binary_all = bool((req.get("parameters") or {}).get("binary_data_output", False))
    timeout_us = _timeout_us(req)
    marks.lap("decode")
    answers = await core.infer_tensors(info, tensors.rows_of(info, inputs), deadline_us=timeout_us, marks=marks)
    out = tensors.gather_outputs(info, answers, wanted)
    head: dict[str, Any] = {"model_name": info.name, "model_version": info.version}
    if "id" in req:
        head["id"] = req["id"]
    raws: list[bytes] = []
    described = []
    for name in wanted:
        arr, dt = out[name], tensors.datatype_of(info, name)
        t: dict[str, Any] = {"name": name, "datatype": dt.value, "shape": list(arr.shape)}
        if name in targets:
            t["parameters"] = shm.put_output(core, targets[name], name, arr)
        elif binary_all or name in binary_names:
            raw = np.ascontiguousarray(arr).tobytes()
            t["parameters"] = {"binary_data_size": len(raw)}
            raws.append(raw)
        else:
            t["data"] = tensors.json_data(arr, dt)
        described.append(t)
    head["outputs"] = described
    resp = _respond(request, head, raws)
    marks.lap("encode")
    core.commit("http", marks)
    return resp


def max_body_bytes(core: Core) -> int:
    """aiohttp's own bound on any body read whole (the repository's load bodies; an inference reads its
    body itself, bounded by its model): the largest any model can take, at least 1 MiB."""
    return max((m.max_body_bytes(binary=False) for m in core.models.values()), default=1 << 20)


def make_app(core: Core, repository: Any = None, repository_token: str | None = None) -> web.Application:
    """The aiohttp application serving ``core``; with ``repository`` (orchestrator.node.repository.Repository)
    also the model-repository load/unload routes, behind ``repository_token`` (frontdoor/repository.py)."""
    app = web.Application(middlewares=[_errors], client_max_size=max(max_body_bytes(core), 1 << 20))
    app[CORE_KEY] = core
    r = app.router
    r.add_get("/v2/health/live", live)
    r.add_get("/v2/health/ready", ready)
    r.add_get("/v2", server_metadata)
    r.add_get("/v2/models/stats", model_stats)
    r.add_post("/v2/repository/index", repository_index)
    for base in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        r.add_get(base, model_metadata)
        r.add_get(base + "/ready", model_ready)
        r.add_get(base + "/config", model_config)
        r.add_get(base + "/stats", model_stats)
        r.add_post(base + "/infer", infer, expect_handler=infer_expect)
    shm.add_http_routes(app, core)
    if repository is not None:
        add_repository_routes(app, repository, repository_token)
    return app
