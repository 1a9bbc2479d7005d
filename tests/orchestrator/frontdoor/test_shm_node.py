"""Shared memory against a real node (CPU backend, instance processes) serving a model file of several
named inputs and outputs: tritonclient's own helpers put some inputs in a region and take some outputs
from another, the rest travel as binary data; answers compared with the file run directly."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from orchestrator.config.schema import load_config
from orchestrator.node.node import Node
from tests.modelfiles import multi_inputs, multi_io_onnx, run_onnx
from tests.orchestrator.frontdoor.test_shm import _client_shm

pytestmark = [pytest.mark.slow, pytest.mark.real]

CONFIG = """
node:
  listen: {host: 127.0.0.1, port: 0}
  backend: cpu
  run_dir: RUN_DIR
  http_port: HTTP
  grpc_port: GRPC
  pool: {slot_count: 2048, max_chunks: 128, record_count: 256}
  autoscale: false
apps:
  - name: multi
    model: files/multi.onnx
    slo_ms: 5000
    shadow: false
    config: {max_batch_size: 4, dynamic_batching: {max_queue_delay_microseconds: 1000}}
"""
_DT = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64", np.dtype(bool): "BOOL"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp = tmp_path_factory.mktemp("shmnode")
    multi_io_onnx(tmp / "files" / "multi.onnx")
    p = tmp / "apps.yaml"
    p.write_text(CONFIG.replace("RUN_DIR", str(tmp / "run")).replace("HTTP", str(_free_port()))
                 .replace("GRPC", str(_free_port())))
    n = Node(load_config(p), warmup=True, heartbeat_ms=100).start()
    n.files = tmp  # type: ignore[attr-defined]
    try:
        yield n
    finally:
        n.stop()


def test_some_inputs_and_outputs_in_shared_memory_answer_as_the_file(node: Node) -> None:
    cshm = _client_shm()
    assert node.frontdoor is not None and node.frontdoor.http_url is not None
    path = Path(node.files) / "files" / "multi.onnx"  # type: ignore[attr-defined]
    x = multi_inputs(3, 5, seed=11)
    want = run_onnx(path, x)
    image, scale = x["image in"], x["scale.k"]
    in_bytes = 256 + image.nbytes
    mean_bytes, ktw_bytes = want["mean out"].nbytes, want["k twice"].nbytes
    tag = uuid.uuid4().hex[:12]
    hin = cshm.create_shared_memory_region(f"in-{tag}", f"/gpp-nin-{tag}", in_bytes)
    hout = cshm.create_shared_memory_region(f"out-{tag}", f"/gpp-nout-{tag}", 256 + ktw_bytes)
    answers = 0
    try:
        cshm.set_shared_memory_region(hin, [scale])  # "scale.k" at offset 0
        cshm.set_shared_memory_region(hin, [image], offset=256)  # "image in" at 256
        clients = ((httpclient, httpclient.InferenceServerClient(node.frontdoor.http_url.removeprefix("http://"))),
                   (grpcclient, grpcclient.InferenceServerClient(str(node.frontdoor.grpc_target))))
        for mod, client in clients:
            proto = "http" if mod is httpclient else "grpc"
            client.register_system_shared_memory(f"{proto}-in-{tag}", f"/gpp-nin-{tag}", in_bytes)
            client.register_system_shared_memory(f"{proto}-out-{tag}", f"/gpp-nout-{tag}", 256 + ktw_bytes)
            try:
                ins = []
                for name, arr in x.items():
                    t = mod.InferInput(name, list(arr.shape), _DT[arr.dtype])
                    if name == "scale.k":
                        t.set_shared_memory(f"{proto}-in-{tag}", scale.nbytes)
                    elif name == "image in":
                        t.set_shared_memory(f"{proto}-in-{tag}", image.nbytes, offset=256)
                    else:
                        t.set_data_from_numpy(arr)
                    ins.append(t)
                kw = {"binary_data": True} if mod is httpclient else {}
                outs = [mod.InferRequestedOutput("mean out", **kw), mod.InferRequestedOutput("k twice", **kw),
                        mod.InferRequestedOutput("half", **kw)]
                outs[0].set_shared_memory(f"{proto}-out-{tag}", mean_bytes)
                outs[1].set_shared_memory(f"{proto}-out-{tag}", ktw_bytes, offset=256)
                cshm.set_shared_memory_region(hout, [np.zeros(256 + ktw_bytes, np.uint8)])
                res = client.infer("multi", ins, outputs=outs)
                answers += 1
                np.testing.assert_allclose(res.as_numpy("half"), want["half"], rtol=1e-4, atol=1e-5)
                got_mean = cshm.get_contents_as_numpy(hout, want["mean out"].dtype, list(want["mean out"].shape))
                got_ktw = cshm.get_contents_as_numpy(hout, want["k twice"].dtype, list(want["k twice"].shape),
                                                     offset=256)
                np.testing.assert_allclose(got_mean, want["mean out"], rtol=1e-4, atol=1e-5)
                np.testing.assert_array_equal(got_ktw, want["k twice"])
            finally:
                client.unregister_system_shared_memory()
            client.close()
    finally:
        cshm.destroy_shared_memory_region(hin)
        cshm.destroy_shared_memory_region(hout)
    assert answers == 2
