"""A node's front door behind node.tls and node.auth: read before anything starts, served by a real node."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from orchestrator.config.schema import NodeConfig, TokenSource, parse_config
from orchestrator.control.errors import StartError
from orchestrator.node.node import Node, read_bearer_token
from tests.tlscerts import make_certs, needs_openssl

TOKEN = "a-token-of-more-than-16-characters"


def _free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cfg(tmp_path: Path, **node: Any) -> NodeConfig:
    return parse_config({
        "node": {"listen": {"host": "127.0.0.1", "port": 0}, "backend": "cpu", "run_dir": str(tmp_path / "run"),
                 "autoscale": False, "http_port": _free_tcp_port(), "grpc_port": _free_tcp_port(), **node},
        "apps": [{"name": "cls", "model": "mobilenet_v2", "input_shape": [3, 32, 32], "slo_ms": 5000, "gpu_pct": 100,
                  "max_batch": 4, "app_id": 1, "num_classes": 10, "shadow": False}]}, source="test")


def test_read_bearer_token_names_the_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert read_bearer_token(TokenSource(), "node.auth") is None
    with pytest.raises(StartError, match=r"node\.auth\.token_file .*cannot be read"):
        read_bearer_token(TokenSource(token_file=str(tmp_path / "none")), "node.auth")
    (tmp_path / "short").write_text("abc\n")
    with pytest.raises(StartError, match=r"node\.auth\.token_file .*too short"):
        read_bearer_token(TokenSource(token_file=str(tmp_path / "short")), "node.auth")
    monkeypatch.setenv("GPUPRIMS_TEST_TOKEN", f"  {TOKEN}\n")
    assert read_bearer_token(TokenSource(token_env="GPUPRIMS_TEST_TOKEN"), "node.auth") == TOKEN


def test_a_bad_certificate_or_token_stops_the_start_before_any_instance(tmp_path: Path) -> None:
    node = Node(_cfg(tmp_path, tls={"cert": str(tmp_path / "no.pem"), "key": str(tmp_path / "no.key")}))
    with pytest.raises(StartError, match=r"node\.tls\.cert .*cannot be read"):
        node.start()
    assert not node.instances and node.frontdoor is None
    node = Node(_cfg(tmp_path, auth={"token_env": "GPUPRIMS_TEST_UNSET_TOKEN"}))
    with pytest.raises(StartError, match=r"node\.auth\.token_env.*GPUPRIMS_TEST_UNSET_TOKEN holds no token"):
        node.start()
    assert not node.instances and node.frontdoor is None


@needs_openssl
@pytest.mark.slow
def test_a_node_serves_tls_and_checks_the_token(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    (tmp_path / "token").write_text(TOKEN + "\n")
    cfg = _cfg(tmp_path, tls={"cert": str(certs.server_cert), "key": str(certs.server_key)},
               auth={"token_file": str(tmp_path / "token")})
    node = Node(cfg, warmup=False, heartbeat_ms=100).start()
    try:
        door = node.frontdoor
        assert door is not None and door.guard is not None and door.http_url and door.grpc_target
        assert door.http_url.startswith("https://")
        x = np.random.default_rng(0).random((2, 3, 32, 32), dtype=np.float32)
        with httpclient.InferenceServerClient(door.http_url.removeprefix("https://"), ssl=True, network_timeout=60,
                                              ssl_options={"ca_certs": str(certs.ca)}) as h:
            t = httpclient.InferInput("input", list(x.shape), "FP32")
            t.set_data_from_numpy(x, binary_data=True)
            with pytest.raises(InferenceServerException, match="Bearer"):
                h.infer("cls", [t])
            out = h.infer("cls", [t], headers={"Authorization": f"Bearer {TOKEN}"}).as_numpy("logits")
            assert out is not None and out.shape == (2, 10)
        with grpcclient.InferenceServerClient(door.grpc_target, ssl=True, root_certificates=str(certs.ca)) as g:
            t2 = grpcclient.InferInput("input", list(x.shape), "FP32")
            t2.set_data_from_numpy(x)
            out = g.infer("cls", [t2], client_timeout=60,
                          headers={"authorization": f"Bearer {TOKEN}"}).as_numpy("logits")
            assert out is not None and out.shape == (2, 10)
        assert door.guard.refused == {"http": 1, "grpc": 0}
    finally:
        node.stop()
