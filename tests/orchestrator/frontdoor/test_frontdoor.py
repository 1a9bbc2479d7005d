"""The front door driven by tritonclient (HTTP and gRPC, sync and asyncio), checked against torch."""

from __future__ import annotations

import asyncio
import gzip
import json
import queue
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpaio
from tritonclient.utils import InferenceServerException

from gpuprims.traffic import EchoServer
from orchestrator.config.schema import AppConfig
from orchestrator.frontdoor import FrontDoorError, start_frontdoor

from .conftest import APPS, Stack, inputs

pytestmark = pytest.mark.real  # real ingest, zoo models served by a thread, both servers

RTOL = ATOL = 1e-4  # a row run inside a batch differs from a direct run by float rounding (apps/zoo)


def _http(stack: Stack) -> httpclient.InferenceServerClient:
    assert stack.door.http_url is not None
    return httpclient.InferenceServerClient(stack.door.http_url.removeprefix("http://"), concurrency=8)


def _grpc(stack: Stack) -> grpcclient.InferenceServerClient:
    assert stack.door.grpc_target is not None
    return grpcclient.InferenceServerClient(stack.door.grpc_target)


def _http_input(x: np.ndarray, binary: bool) -> httpclient.InferInput:
    t = httpclient.InferInput("input", list(x.shape), "FP32" if x.dtype == np.float32 else "UINT8")
    t.set_data_from_numpy(x, binary_data=binary)
    return t


def _grpc_input(x: np.ndarray) -> grpcclient.InferInput:
    t = grpcclient.InferInput("input", list(x.shape), "FP32" if x.dtype == np.float32 else "UINT8")
    t.set_data_from_numpy(x)
    return t


@pytest.mark.parametrize("binary_in,binary_out", [(True, True), (False, False), (True, False)])
def test_http_infer_matches_torch(stack: Stack, binary_in: bool, binary_out: bool) -> None:
    x = inputs("classify", 3, seed=1)
    with _http(stack) as c:
        res = c.infer("classify", [_http_input(x, binary_in)],
                      outputs=[httpclient.InferRequestedOutput("logits", binary_data=binary_out)])
        out = res.as_numpy("logits")
    assert out.shape == (3, 10) and out.dtype == np.float32
    np.testing.assert_allclose(out, stack.expect("classify", x), rtol=RTOL, atol=ATOL)


def test_http_uint8_app_and_default_outputs(stack: Stack) -> None:
    x = inputs("detect", 2, seed=2)
    with _http(stack) as c:
        out = c.infer("detect", [_http_input(x, True)]).as_numpy("logits")  # no outputs: all, binary
        np.testing.assert_allclose(out, stack.expect("detect", x), rtol=RTOL, atol=ATOL)
        for alg in ("gzip", "deflate"):  # compressed request and answer bodies
            out = c.infer("detect", [_http_input(x, True)], request_compression_algorithm=alg,
                          response_compression_algorithm=alg).as_numpy("logits")
            np.testing.assert_allclose(out, stack.expect("detect", x), rtol=RTOL, atol=ATOL)


def test_http_many_in_flight(stack: Stack) -> None:
    xs = [inputs("classify", 1, seed=10 + i) for i in range(8)]
    with _http(stack) as c:
        pending = [c.async_infer("classify", [_http_input(x, True)]) for x in xs]
        outs = [p.get_result().as_numpy("logits") for p in pending]
    for x, out in zip(xs, outs):
        np.testing.assert_allclose(out, stack.expect("classify", x), rtol=RTOL, atol=ATOL)


def test_http_asyncio_client(stack: Stack) -> None:
    xs = [inputs("detect", 2, seed=20 + i) for i in range(6)]

    async def main() -> list[np.ndarray]:
        assert stack.door.http_url is not None
        c = httpaio.InferenceServerClient(stack.door.http_url.removeprefix("http://"))
        try:
            assert await c.is_server_live() and await c.is_model_ready("detect")
            results = await asyncio.gather(*(c.infer("detect", [_http_input(x, True)]) for x in xs))
            return [r.as_numpy("logits") for r in results]
        finally:
            await c.close()

    for x, out in zip(xs, asyncio.run(main())):
        np.testing.assert_allclose(out, stack.expect("detect", x), rtol=RTOL, atol=ATOL)


def test_grpc_infer_matches_torch(stack: Stack) -> None:
    x, u = inputs("classify", 4, seed=3), inputs("detect", 1, seed=4)
    with _grpc(stack) as c:
        out = c.infer("classify", [_grpc_input(x)], outputs=[grpcclient.InferRequestedOutput("logits")])
        np.testing.assert_allclose(out.as_numpy("logits"), stack.expect("classify", x), rtol=RTOL, atol=ATOL)
        out = c.infer("detect", [_grpc_input(u)], request_id="r-7")
        assert out.get_response().id == "r-7"
        np.testing.assert_allclose(out.as_numpy("logits"), stack.expect("detect", u), rtol=RTOL, atol=ATOL)


def test_grpc_many_in_flight_and_asyncio(stack: Stack) -> None:
    xs = [inputs("classify", 1, seed=30 + i) for i in range(6)]
    answers: queue.Queue = queue.Queue()
    with _grpc(stack) as c:
        for i, x in enumerate(xs):
            c.async_infer("classify", [_grpc_input(x)],
                          callback=lambda result, error, i=i: answers.put((i, result, error)))
        got = dict((i, (r, e)) for i, r, e in (answers.get(timeout=30) for _ in xs))
    for i, x in enumerate(xs):
        result, error = got[i]
        assert error is None, error
        np.testing.assert_allclose(result.as_numpy("logits"), stack.expect("classify", x), rtol=RTOL, atol=ATOL)

    async def main() -> list[np.ndarray]:
        assert stack.door.grpc_target is not None
        async with grpcaio.InferenceServerClient(stack.door.grpc_target) as a:
            assert await a.is_server_ready()
            rs = await asyncio.gather(*(a.infer("classify", [_grpc_input(x)]) for x in xs))
            return [r.as_numpy("logits") for r in rs]

    for x, out in zip(xs, asyncio.run(main())):
        np.testing.assert_allclose(out, stack.expect("classify", x), rtol=RTOL, atol=ATOL)


def test_metadata_config_stats_and_health(stack: Stack) -> None:
    with _http(stack) as h, _grpc(stack) as g:
        assert h.is_server_live() and h.is_server_ready() and h.is_model_ready("classify")
        assert g.is_server_live() and g.is_server_ready() and g.is_model_ready("detect")
        assert h.get_server_metadata()["name"] == "gpuprims"
        for meta in (h.get_model_metadata("detect"), g.get_model_metadata("detect", as_json=True)):
            assert meta["name"] == "detect"
            assert meta["inputs"][0]["name"] == "input" and meta["inputs"][0]["datatype"] == "UINT8"
            assert [int(d) for d in meta["inputs"][0]["shape"]] == [-1, 3, 32, 32]
            assert meta["outputs"][0]["datatype"] == "FP32"
            assert [int(d) for d in meta["outputs"][0]["shape"]] == [-1, 10]
        hc = h.get_model_config("classify")
        gc = g.get_model_config("classify", as_json=True)["config"]
        for cfg in (hc, gc):
            assert cfg["name"] == "classify" and int(cfg["max_batch_size"]) == 4
            assert cfg["input"][0]["data_type"] == "TYPE_FP32"
            assert [int(d) for d in cfg["input"][0]["dims"]] == [3, 32, 32]
            assert [int(d) for d in cfg["output"][0]["dims"]] == [10]
        assert {m["name"] for m in h.get_model_repository_index()} == {"classify", "detect"}
        assert {m.name for m in g.get_model_repository_index().models} == {"classify", "detect"}
        before = h.get_inference_statistics("classify")["model_stats"][0]
        h.infer("classify", [_http_input(inputs("classify", 2), True)])
        after = g.get_inference_statistics("classify", as_json=True)["model_stats"][0]
        assert int(after["inference_count"]) == int(before["inference_count"]) + 2
        assert int(after["execution_count"]) == int(before["execution_count"]) + 1
        assert int(after["inference_stats"]["success"]["count"]) == int(before["inference_stats"]["success"]["count"]) + 1
        assert len(h.get_inference_statistics()["model_stats"]) == 2


def _stats_version(model: str, start: list[dict], end: list[dict]) -> int:
    """perf_analyzer's choice of the version to report when run without -x (its
    InferenceProfiler::DetermineStatsModelVersion): the highest version of the model whose
    inference_stats.queue.count grew during the measurement; -1 fails the run with "failed to find
    the requested model version"."""
    def queue(stats: list[dict]) -> dict[str, int]:
        return {str(m["version"]): int(m["inference_stats"]["queue"].get("count", 0)) for m in stats
                if m["name"] == model}
    before, after = queue(start), queue(end)
    grew = [int(v) for v, n in after.items() if n > before.get(v, 0)]
    return max(grew, default=-1)


def test_statistics_let_perf_analyzer_find_the_model_version(stack: Stack) -> None:
    """What perf_analyzer reads, over both protocols: the metadata's version list, statistics entries
    with that version, a queue count that grows by one per inference, and compute counts equal to it
    (perf_analyzer refuses unequal ones). A queue count stuck at 0 made it fail without -x."""
    with _http(stack) as h, _grpc(stack) as g:
        assert h.get_model_metadata("classify")["versions"] == ["1"]
        assert list(g.get_model_metadata("classify").versions) == ["1"]
        for get in (lambda: h.get_inference_statistics("classify")["model_stats"],
                    lambda: g.get_inference_statistics("classify", as_json=True)["model_stats"],
                    lambda: h.get_inference_statistics("classify", "1")["model_stats"]):
            start = get()
            assert [m["version"] for m in start] == ["1"]
            for _ in range(2):
                h.infer("classify", [_http_input(inputs("classify", 1), True)])
            end = get()
            assert _stats_version("classify", start, end) == 1
            st = end[0]["inference_stats"]
            counts = {k: int(st[k].get("count", 0)) for k in ("success", "queue", "compute_input",
                                                               "compute_infer", "compute_output")}
            assert len(set(counts.values())) == 1, counts
            assert counts["queue"] == int(start[0]["inference_stats"]["queue"].get("count", 0)) + 2
            assert int(st["compute_infer"].get("ns", 0)) > 0
        assert _stats_version("classify", start, start) == -1  # nothing ran: what perf_analyzer refuses


def test_client_errors_map_to_protocol_errors(stack: Stack) -> None:
    x = inputs("classify", 1)
    with _http(stack) as h, _grpc(stack) as g:
        for call, code in ((lambda: h.infer("nope", [_http_input(x, True)]), "404"),
                           (lambda: g.infer("nope", [_grpc_input(x)]), "StatusCode.NOT_FOUND"),
                           (lambda: h.get_model_metadata("nope"), "404"),
                           (lambda: g.get_model_config("nope"), "StatusCode.NOT_FOUND")):
            with pytest.raises(InferenceServerException) as e:
                call()
            assert e.value.status() == code and "unknown model 'nope'" in e.value.message()
        wrong_shape = inputs("classify", 1)[:, :, :16]
        wrong_type = inputs("detect", 1)  # uint8 to the float32 app
        for bad, what in ((wrong_shape, "shape"), (wrong_type, "FP32")):
            with pytest.raises(InferenceServerException) as e:
                h.infer("classify", [_http_input(bad, True)])
            assert e.value.status() == "400" and what in e.value.message()
            with pytest.raises(InferenceServerException) as e:
                g.infer("classify", [_grpc_input(bad)])
            assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and what in e.value.message()
        assert not h.is_model_ready("nope")  # 404: tritonclient reads any non-200 as not ready
        with pytest.raises(InferenceServerException):
            g.is_model_ready("nope")


def _post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_malformed_http_requests_get_400(stack: Stack) -> None:
    url = f"{stack.door.http_url}/v2/models/classify/infer"
    cases = [
        (b"{not json", {}, "not valid JSON"),
        (b"[1, 2]", {}, "JSON object"),
        (json.dumps({"inputs": []}).encode(), {}, "exactly one input"),
        (json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3, 32, 32],
                                 "data": [1.0, 2.0]}]}).encode(), {}, "elements"),
        (json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3, 32, 32],
                                 "parameters": {"binary_data_size": 12288}}]}).encode() + b"\0" * 10,
         {"Inference-Header-Content-Length": "999999"}, "outside the body"),
        (json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3, 32, 32], "data": []}]}).encode(),
         {}, "one input named 'input'"),
    ]
    for body, headers, what in cases:
        code, answer = _post(url, body, headers)
        assert code == 400 and what in answer["error"], (what, code, answer)
    # A JSON request built by hand (nested data, as curl users send it) works.
    x = inputs("classify", 1, seed=5)
    code, answer = _post(url, json.dumps({"id": "a", "inputs": [{"name": "input", "datatype": "FP32",
                                                                  "shape": list(x.shape),
                                                                  "data": x.tolist()}]}).encode())
    assert code == 200 and answer["id"] == "a" and answer["outputs"][0]["shape"] == [1, 10]
    body = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape),
                                   "data": x.reshape(-1).tolist()}]}).encode()
    req = urllib.request.Request(url, data=body, headers={"Accept-Encoding": "gzip"}, method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["Content-Encoding"] == "gzip"
        assert json.loads(gzip.decompress(r.read()))["outputs"][0]["shape"] == [1, 10]
    np.testing.assert_allclose(np.array(answer["outputs"][0]["data"]).reshape(1, 10), stack.expect("classify", x),
                               rtol=RTOL, atol=ATOL)


def test_node_statuses_map_to_protocol_errors(stack: Stack) -> None:
    # "ghost" is configured at the front door but the node has no route for app 3 (UNKNOWN_APP ->
    # unavailable); "narrow" claims app 1 with a smaller input than the node serves (BAD_REQUEST).
    apps = [AppConfig(name="ghost", model="resnet18", input_shape=(3, 8, 8), dtype="uint8", num_classes=10,
                      slo_ms=500, app_id=3),
            AppConfig(name="narrow", model="mobilenet_v2", input_shape=(3, 16, 16), num_classes=10,
                      slo_ms=500, app_id=1)]
    with start_frontdoor(apps, stack.node.address, http_port=0, grpc_port=0, timeout_s=10,
                         ingest=stack.ingest) as door:
        assert door.http_url is not None and door.grpc_target is not None
        h = httpclient.InferenceServerClient(door.http_url.removeprefix("http://"))
        g = grpcclient.InferenceServerClient(door.grpc_target)
        try:
            ghost = np.zeros((1, 3, 8, 8), np.uint8)
            narrow = np.zeros((1, 3, 16, 16), np.float32)
            for name, x, http_code, grpc_code, what in (
                    ("ghost", ghost, "503", "StatusCode.UNAVAILABLE", "UNKNOWN_APP"),
                    ("narrow", narrow, "400", "StatusCode.INVALID_ARGUMENT", "BAD_REQUEST")):
                with pytest.raises(InferenceServerException) as e:
                    h.infer(name, [_http_input(x, True)])
                assert e.value.status() == http_code and what in e.value.message()
                with pytest.raises(InferenceServerException) as e:
                    g.infer(name, [_grpc_input(x)])
                assert e.value.status() == grpc_code and what in e.value.message()
            stats = h.get_inference_statistics("ghost")["model_stats"][0]
            assert int(stats["inference_stats"]["fail"]["count"]) == 2
        finally:
            h.close()
            g.close()


def test_lost_answers_time_out_as_deadline_exceeded() -> None:
    app = AppConfig(name="echo", model="resnet18", input_shape=(3, 4, 4), dtype="uint8", num_classes=10,
                    slo_ms=50, app_id=1)
    with EchoServer(drop_every=1) as echo, \
            start_frontdoor([app], echo.address, http_port=0, grpc_port=0, timeout_s=0.2) as door:
        assert door.http_url is not None and door.grpc_target is not None
        x = np.zeros((1, 3, 4, 4), np.uint8)
        with httpclient.InferenceServerClient(door.http_url.removeprefix("http://")) as h, pytest.raises(
                InferenceServerException) as e:
            h.infer("echo", [_http_input(x, True)])
        assert e.value.status() == "504" and "no answer" in e.value.message()
        with grpcclient.InferenceServerClient(door.grpc_target) as g, pytest.raises(InferenceServerException) as e:
            g.infer("echo", [_grpc_input(x)])
        assert e.value.status() == "StatusCode.DEADLINE_EXCEEDED"


def test_start_refuses_bad_arguments_and_busy_ports(stack: Stack) -> None:
    with pytest.raises(ValueError, match="http_port or grpc_port"):
        start_frontdoor(APPS, stack.node.address, None, None)
    with pytest.raises(ValueError, match="grpc_port"):
        start_frontdoor(APPS, stack.node.address, None, 70000)
    assert stack.door.http_url is not None
    busy = int(stack.door.http_url.rsplit(":", 1)[1])
    with pytest.raises(FrontDoorError, match=r"node\.http_port"):
        start_frontdoor(APPS, stack.node.address, busy, None)


def test_grpc_typed_contents_without_raw(stack: Stack) -> None:
    # tritonclient always sends raw_input_contents; other OIP clients send typed contents.
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    x, u = inputs("classify", 2, seed=40), inputs("detect", 1, seed=41)
    assert stack.door.grpc_target is not None
    with grpc.insecure_channel(stack.door.grpc_target) as ch:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        for name, arr, field in (("classify", x, "fp32_contents"), ("detect", u, "uint_contents")):
            req = service_pb2.ModelInferRequest(model_name=name)
            t = req.inputs.add(name="input", datatype="FP32" if arr.dtype == np.float32 else "UINT8",
                               shape=list(arr.shape))
            getattr(t.contents, field).extend(arr.reshape(-1).tolist())
            resp = stub.ModelInfer(req, timeout=30)
            assert resp.outputs[0].name == "logits" and list(resp.outputs[0].shape) == [len(arr), 10]
            out = np.frombuffer(resp.raw_output_contents[0], "<f4").reshape(len(arr), 10)
            np.testing.assert_allclose(out, stack.expect(name, arr), rtol=RTOL, atol=ATOL)
        bad = service_pb2.ModelInferRequest(model_name="classify")
        bad.inputs.add(name="input", datatype="FP32", shape=[1, 3, 32, 32]).contents.fp32_contents.extend([1.0])
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(bad, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "elements" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelStreamInfer(iter([bad]), timeout=30).next()
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_close_ends_in_flight_calls_and_the_thread() -> None:
    app = AppConfig(name="echo", model="resnet18", input_shape=(3, 4, 4), dtype="uint8", num_classes=10,
                    slo_ms=50, app_id=1)
    errors: queue.Queue = queue.Queue()
    with EchoServer(drop_every=1) as echo:  # never answers: the call waits for its 30 s timeout
        door = start_frontdoor([app], echo.address, http_port=0, grpc_port=None, timeout_s=30)
        assert door.http_url is not None and door.grpc_target is None

        def call() -> None:
            with httpclient.InferenceServerClient(door.http_url.removeprefix("http://"),  # type: ignore[union-attr]
                                                  network_timeout=60) as h:
                try:
                    h.infer("echo", [_http_input(np.zeros((1, 3, 4, 4), np.uint8), True)])
                    errors.put(None)
                except Exception as e:
                    errors.put(e)

        t = threading.Thread(target=call)
        t.start()
        deadline = time.monotonic() + 30
        while echo.counters.requests == 0 and time.monotonic() < deadline:  # the row reached the "node"
            time.sleep(0.01)
        assert echo.counters.requests == 1
        door.close()  # in-flight calls get STOP_GRACE_S, then the servers and the loop thread end
        assert not door._thread.is_alive()
        t.join(30)
        assert not t.is_alive() and errors.get_nowait() is not None
        door.close()  # idempotent
