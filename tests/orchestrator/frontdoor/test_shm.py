"""Triton's shared-memory extensions at the front door: tritonclient's own helpers and clients over HTTP
and gRPC, answers compared with the model run directly; CUDA IPC handles on the fake runtime; every
bad-input path."""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import multiprocessing as mp
import os
import subprocess
import sys
import time
import types
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from aiohttp import web
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from gpuprims.client import Result
from gpuprims.cuda import runtime
from gpuprims.wire import DType, Status
from orchestrator.frontdoor import shm, shm_pb2
from orchestrator.frontdoor.core import Core, OipError
from orchestrator.frontdoor.http_server import make_app
from orchestrator.frontdoor.models import OUTPUT_NAME, ModelInfo
from orchestrator.frontdoor.transport import Marks
from tests.orchestrator.frontdoor.conftest import Stack, inputs
from tests.orchestrator.frontdoor.test_proto import REPO, _descriptor_bytes

IN_BYTES = 2 * 3 * 32 * 32 * 4  # two rows of the classify app's float32 input
OUT_BYTES = 2 * 10 * 4


def _client_shm() -> types.ModuleType:
    """tritonclient.utils.shared_memory, unchanged. It finds its libcshm.so with pkg_resources at import,
    which setuptools >= 81 no longer ships: stand in for that one lookup when it is missing, for the
    import only (left in sys.modules, the stand-in breaks whatever later asks pkg_resources for more,
    e.g. importlib's namespace-package fix-up in torch's imports)."""
    if "pkg_resources" in sys.modules or importlib.util.find_spec("pkg_resources") is not None:
        return importlib.import_module("tritonclient.utils.shared_memory")

    def resource_filename(package: str, name: str) -> str:
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.origin is not None
        return os.path.join(os.path.dirname(spec.origin), name)

    stand_in = types.ModuleType("pkg_resources")
    stand_in.resource_filename = resource_filename  # type: ignore[attr-defined]
    sys.modules["pkg_resources"] = stand_in
    try:
        return importlib.import_module("tritonclient.utils.shared_memory")
    finally:
        if sys.modules.get("pkg_resources") is stand_in:
            del sys.modules["pkg_resources"]


def _urls(stack: Stack) -> tuple[str, str]:
    assert stack.door.http_url is not None and stack.door.grpc_target is not None
    return stack.door.http_url.removeprefix("http://"), stack.door.grpc_target


@pytest.fixture
def regions() -> Iterator[tuple[Any, Any, str]]:
    """An input and an output region made by tritonclient's helper (destroyed after the test)."""
    cshm = _client_shm()
    tag = uuid.uuid4().hex[:12]
    hin = cshm.create_shared_memory_region(f"in-{tag}", f"/gpp-in-{tag}", IN_BYTES)
    hout = cshm.create_shared_memory_region(f"out-{tag}", f"/gpp-out-{tag}", OUT_BYTES)
    try:
        yield hin, hout, tag
    finally:
        cshm.destroy_shared_memory_region(hin)
        cshm.destroy_shared_memory_region(hout)


@pytest.mark.real  # the real ingest and both servers (the stack fixture)
def test_tritonclient_system_shared_memory_over_http_and_grpc(stack: Stack, regions: tuple[Any, Any, str]) -> None:
    cshm = _client_shm()
    hin, hout, tag = regions
    x = inputs("classify", 2, seed=5)
    cshm.set_shared_memory_region(hin, [x])
    want = stack.expect("classify", x)
    http_url, grpc_url = _urls(stack)
    hc, gc = httpclient.InferenceServerClient(http_url), grpcclient.InferenceServerClient(grpc_url)
    answers = 0
    for proto, client, mod in (("http", hc, httpclient), ("grpc", gc, grpcclient)):
        name_in, name_out = f"{proto}-in-{tag}", f"{proto}-out-{tag}"
        client.register_system_shared_memory(name_in, f"/gpp-in-{tag}", IN_BYTES)
        client.register_system_shared_memory(name_out, f"/gpp-out-{tag}", OUT_BYTES)
        try:
            status = client.get_system_shared_memory_status()
            listed = {r["name"] for r in status} if proto == "http" else set(status.regions)
            assert {name_in, name_out} <= listed
            inp = mod.InferInput("input", list(x.shape), "FP32")
            inp.set_shared_memory(name_in, IN_BYTES)
            out = mod.InferRequestedOutput(OUTPUT_NAME, **({"binary_data": True} if proto == "http" else {}))
            out.set_shared_memory(name_out, OUT_BYTES)
            cshm.set_shared_memory_region(hout, [np.zeros((2, 10), np.float32)])
            result = client.infer("classify", [inp], outputs=[out])
            answers += 1
            described = result.get_output(OUTPUT_NAME)
            params = described["parameters"] if proto == "http" else \
                {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in described.parameters.items()}
            assert params["shared_memory_region"] == name_out and params["shared_memory_byte_size"] == OUT_BYTES
            # The data is in the region, not in the answer.
            assert "data" not in described if proto == "http" else not result.get_response().raw_output_contents
            got = cshm.get_contents_as_numpy(hout, np.float32, [2, 10])
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        finally:
            client.unregister_system_shared_memory(name_in)
            client.unregister_system_shared_memory(name_out)
        status = client.get_system_shared_memory_status()
        assert not ({r["name"] for r in status} if proto == "http" else set(status.regions)) & {name_in, name_out}
    assert answers == 2
    hc.close()
    gc.close()


@pytest.mark.real  # the real ingest and both servers (the stack fixture)
def test_bad_shared_memory_requests_get_clear_errors(stack: Stack, regions: tuple[Any, Any, str]) -> None:
    cshm = _client_shm()
    hin, _, tag = regions
    x = inputs("classify", 2, seed=6)
    cshm.set_shared_memory_region(hin, [x])
    http_url, grpc_url = _urls(stack)
    hc, gc = httpclient.InferenceServerClient(http_url), grpcclient.InferenceServerClient(grpc_url)
    key = f"/gpp-in-{tag}"
    # Larger than the object: refused at register, over both protocols.
    with pytest.raises(InferenceServerException, match="past the end"):
        hc.register_system_shared_memory(f"big-{tag}", key, IN_BYTES + 1)
    with pytest.raises(InferenceServerException, match="past the end") as e:
        gc.register_system_shared_memory(f"big-{tag}", key, IN_BYTES, offset=8)
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException, match="cannot open key"):
        hc.register_system_shared_memory(f"none-{tag}", f"/gpp-none-{tag}", 16)
    hc.register_system_shared_memory(f"r-{tag}", key, IN_BYTES)
    try:
        with pytest.raises(InferenceServerException, match="already registered"):
            gc.register_system_shared_memory(f"r-{tag}", key, IN_BYTES)
        cases = [  # (region, byte_size, offset, what the error says)
            (f"unknown-{tag}", IN_BYTES, 0, "is not registered"),
            (f"r-{tag}", IN_BYTES, 4, "past the end of shared memory region"),
            (f"r-{tag}", IN_BYTES - 4, 0, "needs"),  # the wrong byte size for the tensor
        ]
        refused = 0
        for proto, client, mod in (("http", hc, httpclient), ("grpc", gc, grpcclient)):
            for region, size, offset, says in cases:
                inp = mod.InferInput("input", list(x.shape), "FP32")
                inp.set_shared_memory(region, size, offset=offset)
                with pytest.raises(InferenceServerException, match=says) as e:
                    client.infer("classify", [inp])
                assert e.value.status() in ("400", "StatusCode.INVALID_ARGUMENT"), (proto, region, e.value)
                refused += 1
            # An output region too small for the answer, and one past the region's end.
            inp = mod.InferInput("input", list(x.shape), "FP32")
            inp.set_shared_memory(f"r-{tag}", IN_BYTES)
            for size, offset, says in ((8, 0, "do not fit"), (OUT_BYTES, IN_BYTES - 8, "past the end")):
                out = mod.InferRequestedOutput(OUTPUT_NAME, **({"binary_data": True} if proto == "http" else {}))
                out.set_shared_memory(f"r-{tag}", size, offset=offset)
                with pytest.raises(InferenceServerException, match=says):
                    client.infer("classify", [inp], outputs=[out])
                refused += 1
        assert refused == 2 * (len(cases) + 2)
        # One of the two parameters alone is refused.
        body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                            "parameters": {"shared_memory_region": f"r-{tag}"}}]}
        r = requests.post(f"http://{http_url}/v2/models/classify/infer", json=body, timeout=10)
        assert r.status_code == 400 and "go together" in r.json()["error"]
        # A malformed register body.
        r = requests.post(f"http://{http_url}/v2/systemsharedmemory/region/x-{tag}/register",
                          json={"key": key, "byte_size": -1}, timeout=10)
        assert r.status_code == 400 and "byte_size" in r.json()["error"]
        r = requests.post(f"http://{http_url}/v2/systemsharedmemory/region/x-{tag}/register",
                          json={"key": "/../etc/passwd", "byte_size": 4}, timeout=10)
        assert r.status_code == 400 and "not a POSIX shared-memory name" in r.json()["error"]
        with pytest.raises(InferenceServerException, match="no system shared memory region"):
            hc.get_system_shared_memory_status(f"unknown-{tag}")
    finally:
        hc.unregister_system_shared_memory()  # all
    assert hc.get_system_shared_memory_status() == []
    hc.close()
    gc.close()


def test_unregistering_a_region_in_use_fails_that_request_cleanly(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:12]
    path = Path("/dev/shm") / f"gpp-use-{tag}"
    path.write_bytes(bytes(range(64)))
    try:
        mem = shm.SharedMemory()
        mem.register_system("r", f"/gpp-use-{tag}", 16, 32)
        ref = shm.TensorRef("r", 4, 8)
        assert mem.read(ref, "input 'x'") == bytes(range(20, 28))  # the region starts at offset 16
        mem.unregister("system", "r")  # while the request that read its input is in flight
        with pytest.raises(OipError, match="unregistered while this request used it"):
            mem.write(ref, np.zeros(2, np.float32), "output 'y'")
        with pytest.raises(OipError, match="is not registered"):
            mem.read(ref, "input 'x'")
        mem.register_system("r", f"/gpp-use-{tag}", 0, 64)  # the name is free again
        mem.write(shm.TensorRef("r", 60, 4), np.array([7], np.uint32), "output 'y'")
        assert path.read_bytes()[60:] == (7).to_bytes(4, "little")
        with pytest.raises(OipError, match="past the end"):
            mem.write(shm.TensorRef("r", 62, 4), np.array([7], np.uint32), "output 'y'")
        mem.close()
        assert mem.status("system") == []
    finally:
        path.unlink()


def test_only_local_peers_use_shared_memory() -> None:
    for peer in ("127.0.0.1", "::1", "ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:/tmp/x"):
        assert shm.local_peer(peer), peer
    for peer in ("", "10.0.0.2", "ipv4:192.168.1.4:5000", "ipv6:[2001:db8::1]:80", "garbage"):
        assert not shm.local_peer(peer), peer
    with pytest.raises(OipError, match="not loopback") as e:
        shm.http_targets(None, "10.0.0.2",  # type: ignore[arg-type]
                         {"outputs": [{"name": OUTPUT_NAME, "parameters": {"shared_memory_region": "r",
                                                                         "shared_memory_byte_size": 4}}]})
    assert e.value.kind == "unauthenticated"


def test_committed_shm_stubs_match_the_proto(tmp_path: Path) -> None:
    env = {**os.environ, "OUT_DIR": str(tmp_path), "PY": sys.executable}
    subprocess.run([str(REPO / "scripts" / "gen-oip-stubs.sh")], check=True, env=env, timeout=120)
    committed = REPO / "orchestrator" / "frontdoor"
    assert _descriptor_bytes((tmp_path / "shm_pb2.py").read_text()) == \
        _descriptor_bytes((committed / "shm_pb2.py").read_text()), "shm_pb2.py is stale: run scripts/gen-oip-stubs.sh"
    code = [[ln for ln in (d / "shm_pb2.pyi").read_text().splitlines() if not ln.startswith("#")]
            for d in (tmp_path, committed)]
    assert code[0] == code[1], "shm_pb2.pyi is stale: run scripts/gen-oip-stubs.sh"


def test_shm_messages_match_tritonclients() -> None:
    for name in ("SystemSharedMemoryStatusRequest", "SystemSharedMemoryStatusResponse",
                 "SystemSharedMemoryRegisterRequest", "SystemSharedMemoryUnregisterRequest",
                 "CudaSharedMemoryStatusRequest", "CudaSharedMemoryStatusResponse",
                 "CudaSharedMemoryRegisterRequest", "CudaSharedMemoryUnregisterRequest"):
        ours, theirs = getattr(shm_pb2, name).DESCRIPTOR, getattr(service_pb2, name).DESCRIPTOR
        assert {f.name: (f.number, f.type) for f in ours.fields} == \
            {f.name: (f.number, f.type) for f in theirs.fields}, name
        for nested in theirs.nested_types:
            mine = ours.nested_types_by_name[nested.name]
            assert {f.name: (f.number, f.type) for f in mine.fields} == \
                {f.name: (f.number, f.type) for f in nested.fields}, (name, nested.name)


# -- CUDA shared memory on the fake runtime -------------------------------------------------------------

def _cuda_client(conn: Any, x: np.ndarray, out_bytes: int) -> None:
    """The client's side, in its own process as tritonclient.utils.cuda_shared_memory would do it:
    cudaMalloc, fill the input, export with cudaIpcGetMemHandle; read the output when asked."""
    os.environ[runtime.FAKE_ENV] = "1"
    rt = runtime.cuda()
    mem_in, mem_out = runtime.DeviceMemory(x.nbytes), runtime.DeviceMemory(out_bytes)
    host = runtime.PinnedBuffer(max(x.nbytes, out_bytes))
    host.array()[:x.nbytes] = np.frombuffer(x.tobytes(), np.uint8)
    rt.cuda_memcpy_async(mem_in.ptr, host.address, x.nbytes, 0)
    rt.cuda_stream_synchronize(0)
    conn.send((bytes(rt.cuda_ipc_get_mem_handle(0, mem_in.ptr)), bytes(rt.cuda_ipc_get_mem_handle(0, mem_out.ptr))))
    if conn.poll(120) and conn.recv() == "read":
        rt.cuda_memcpy_async(host.address, mem_out.ptr, out_bytes, 0)
        rt.cuda_stream_synchronize(0)
        conn.send(host.array()[:out_bytes].tobytes())
        conn.poll(120)
    mem_in.close()
    mem_out.close()
    host.close()


@pytest.mark.real  # the real ingest and both servers (the stack fixture)
def test_cuda_shared_memory_on_the_fake_runtime(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    # tritonclient.utils.cuda_shared_memory needs cuda-python and a CUDA driver, neither of which is here: a
    # child process on the fake runtime makes the handles as it would (cudaMalloc + cudaIpcGetMemHandle).
    monkeypatch.setenv(runtime.FAKE_ENV, "1")
    x = inputs("classify", 2, seed=7)
    want = stack.expect("classify", x)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_cuda_client, args=(child, x, OUT_BYTES), daemon=True)
    proc.start()
    tag = uuid.uuid4().hex[:12]
    http_url, grpc_url = _urls(stack)
    hc, gc = httpclient.InferenceServerClient(http_url), grpcclient.InferenceServerClient(grpc_url)
    try:
        assert parent.poll(60), "the client process sent no handles"
        # What cuda_shared_memory.get_raw_handle gives: the 64-byte cudaIpcMemHandle_t in base64.
        h_in, h_out = (base64.b64encode(h) for h in parent.recv())
        hc.register_cuda_shared_memory(f"cin-{tag}", h_in.decode(), 0, IN_BYTES)
        gc.register_cuda_shared_memory(f"cout-{tag}", h_out, 0, OUT_BYTES)
        assert {r["name"] for r in hc.get_cuda_shared_memory_status()} == {f"cin-{tag}", f"cout-{tag}"}
        with pytest.raises(InferenceServerException, match="larger than"):
            gc.register_cuda_shared_memory(f"cbig-{tag}", h_in, 0, IN_BYTES + 1)
        with pytest.raises(InferenceServerException, match="64"):
            hc.register_cuda_shared_memory(f"cbad-{tag}", base64.b64encode(b"short").decode(), 0, 4)
        with pytest.raises(InferenceServerException, match="not base64"):
            hc.register_cuda_shared_memory(f"cbad-{tag}", "@@@", 0, 4)
        inp = grpcclient.InferInput("input", list(x.shape), "FP32")
        inp.set_shared_memory(f"cin-{tag}", IN_BYTES)
        out = grpcclient.InferRequestedOutput(OUTPUT_NAME)
        out.set_shared_memory(f"cout-{tag}", OUT_BYTES)
        result = gc.infer("classify", [inp], outputs=[out])
        assert not result.get_response().raw_output_contents
        parent.send("read")
        assert parent.poll(60), "the client process did not read its output"
        got = np.frombuffer(parent.recv(), np.float32).reshape(2, 10)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        hc.unregister_cuda_shared_memory()  # cudaIpcCloseMemHandle before the client frees
        assert hc.get_cuda_shared_memory_status() == []
        assert not runtime.cuda().live("ipc_open")
    finally:
        parent.send("done")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        hc.close()
        gc.close()
    assert proc.exitcode == 0


# -- a region unregistered while requests use it, on a node stand-in that holds every row -------------

class HeldTransport:
    """A node stand-in: every row waits until `release`; each answer is OK with the row's first value."""

    name = "held"

    def __init__(self) -> None:
        self.held: list[asyncio.Future[None]] = []

    async def rows(self, app_id: int, x: np.ndarray, *, deadline_us: int, timeout_s: float, marks: Marks,
                   dtype: DType | None = None) -> list[Result | BaseException]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.held.append(fut)
        await fut
        return [Result(app_id, i, Status.OK, np.array([row[0], 0.0], np.float32), 1.0) for i, row in enumerate(x)]

    def release(self) -> None:
        for f in self.held:
            if not f.done():
                f.set_result(None)

    def close(self) -> None:
        pass


async def _until(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def test_unregistering_a_region_under_requests_in_flight_fails_each_once_and_cleanly() -> None:
    info = ModelInfo(name="m", app_id=1, input_shape=(2,), dtype="float32", output_dim=2, max_batch=8,
                     max_wait_ms=1.0, slo_ms=1000.0, instances=1)
    transport = HeldTransport()
    core = Core([info], transport, shed_lag_fraction=None)
    tag = uuid.uuid4().hex[:12]
    path = Path("/dev/shm") / f"gpp-held-{tag}"
    n = 4
    x = np.arange(n * 2, dtype=np.float32).reshape(n, 2) + 1
    path.write_bytes(x.tobytes() + bytes(n * 8))  # inputs, then one 8-byte output per request

    def body(i: int, region: str) -> dict[str, Any]:
        return {"id": str(i),
                "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 2],
                            "parameters": {"shared_memory_region": region, "shared_memory_offset": 8 * i,
                                           "shared_memory_byte_size": 8}}],
                "outputs": [{"name": OUTPUT_NAME, "parameters": {
                    "shared_memory_region": region, "shared_memory_offset": 8 * n + 8 * i,
                    "shared_memory_byte_size": 8}}]}

    async def run() -> list[tuple[int, dict[str, Any]]]:
        runner = web.AppRunner(make_app(core), access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"

        async def post(s: aiohttp.ClientSession, route: str, doc: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            async with s.post(url + route, json=doc) as r:
                return r.status, await r.json()

        try:
            async with aiohttp.ClientSession() as s:
                reg = {"key": f"/gpp-held-{tag}", "offset": 0, "byte_size": n * 16}
                assert (await post(s, f"/v2/systemsharedmemory/region/r-{tag}/register", reg))[0] == 200
                calls = [asyncio.ensure_future(post(s, "/v2/models/m/infer", body(i, f"r-{tag}"))) for i in range(n)]
                await _until(lambda: len(transport.held) == n, "every request's inputs read and held by the node")
                assert (await post(s, f"/v2/systemsharedmemory/region/r-{tag}/unregister", {}))[0] == 200
                transport.release()
                answers = list(await asyncio.gather(*calls))
                # Registered again, a request is served and its output lands in the region.
                assert (await post(s, f"/v2/systemsharedmemory/region/r2-{tag}/register", reg))[0] == 200
                served = asyncio.ensure_future(post(s, "/v2/models/m/infer", body(1, f"r2-{tag}")))
                await _until(lambda: len(transport.held) == n + 1, "the last request held")
                transport.release()
                answers.append(await served)
        finally:
            await runner.cleanup()
            core.release()
        return answers

    try:
        answers = asyncio.run(run())
        failed = answers[:n]
        assert len(failed) == n and all(status == 400 for status, _ in failed)
        assert all("unregistered while this request used it" in doc["error"] for _, doc in failed)
        status, doc = answers[n]
        assert status == 200 and doc["id"] == "1"
        assert doc["outputs"][0]["parameters"] == {"shared_memory_region": f"r2-{tag}", "shared_memory_byte_size": 8,
                                                   "shared_memory_offset": 8 * n + 8}
        assert "data" not in doc["outputs"][0]
        out = np.frombuffer(path.read_bytes()[8 * n:], np.float32).reshape(n, 2)
        np.testing.assert_array_equal(out[1], [x[1, 0], 0.0])  # request 1's answer: its row's first value
        assert not out[[0, 2, 3]].any()  # the failed requests wrote nothing
        shm.of(core).close()
    finally:
        path.unlink()
