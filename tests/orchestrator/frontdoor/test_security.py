"""TLS and the inference token on the front door, driven by tritonclient's own TLS and header options,
with certificates made for the module by tests/tlscerts.py."""

from __future__ import annotations

import functools
import http.client
import logging
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from gpuprims.traffic import EchoServer
from orchestrator.config.schema import AppConfig
from orchestrator.frontdoor import start_frontdoor
from orchestrator.frontdoor.security import TlsError, TokenGuard, load_tls, plaintext_warning
from tests.tlscerts import Certs, make_certs, needs_openssl

pytestmark = needs_openssl

APP = AppConfig(name="echo", model="resnet18", input_shape=(3, 4, 4), dtype="uint8", num_classes=10, slo_ms=500,
                app_id=1)
TOKEN = "s3cret-token-of-32-characters-xx"
#: What the echo's answer to one row becomes: its 40 bytes in the request's datatype (UINT8).
ANSWER = (1, 40)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def echo() -> Iterator[EchoServer]:
    """The "node": answers every row with 40 bytes after 0.3 s."""
    with EchoServer(response_bytes=40, delay_s=0.3) as e:
        yield e


def _x() -> np.ndarray:
    return np.zeros((1, 3, 4, 4), np.uint8)


def _http_infer(client: httpclient.InferenceServerClient, **kw: Any) -> np.ndarray:
    t = httpclient.InferInput("input", [1, 3, 4, 4], "UINT8")
    t.set_data_from_numpy(_x(), binary_data=True)
    out = client.infer(APP.name, [t], **kw).as_numpy("logits")
    assert out is not None
    return out


def _grpc_infer(client: grpcclient.InferenceServerClient, **kw: Any) -> np.ndarray:
    t = grpcclient.InferInput("input", [1, 3, 4, 4], "UINT8")
    t.set_data_from_numpy(_x())
    out = client.infer(APP.name, [t], client_timeout=30, **kw).as_numpy("logits")
    assert out is not None
    return out


def _https(url: str, ca: Path, **ssl_options: str) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(url.removeprefix("https://"), ssl=True, network_timeout=30,
                                            ssl_options={"ca_certs": str(ca), **ssl_options})


def _trusted_http_infer(url: str, ca: Path) -> np.ndarray:
    with _https(url, ca) as h:  # a tritonclient HTTP client stays in the thread that made it (gevent)
        return _http_infer(h)


class _InFlight:
    """One request of a trusted client running in a thread while others fail their handshakes."""

    def __init__(self, call: Any) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self._t = threading.Thread(target=self._run, args=(call,))
        self._t.start()

    def _run(self, call: Any) -> None:
        try:
            self.result = call()
        except BaseException as e:
            self.error = e

    def join(self) -> Any:
        self._t.join(60)
        assert not self._t.is_alive(), "the trusted request was never answered"
        if self.error is not None:
            raise self.error
        return self.result


def test_load_tls_names_the_file_that_cannot_be_served(certs: Certs, tmp_path: Path) -> None:
    with pytest.raises(TlsError, match=r"node\.tls\.cert .*cannot be read"):
        load_tls(tmp_path / "missing.pem", certs.server_key)
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    with pytest.raises(TlsError, match=r"node\.tls\.key .*not a PEM file"):
        load_tls(certs.server_cert, tmp_path / "junk.pem")
    with pytest.raises(TlsError, match=r"not a certificate and its key"):
        load_tls(certs.server_cert, certs.other_key)  # another certificate's key
    with pytest.raises(TlsError, match=r"node\.tls\.ca .*not a PEM file"):
        load_tls(certs.server_cert, certs.server_key, tmp_path / "junk.pem")
    tls = load_tls(certs.server_cert, certs.server_key)
    assert not tls.mutual and tls.context.verify_mode == ssl.CERT_NONE
    assert load_tls(certs.server_cert, certs.server_key, certs.ca).context.verify_mode == ssl.CERT_REQUIRED


@pytest.mark.slow
def test_tls_serves_trusted_clients_and_failed_handshakes_leave_the_door_up(certs: Certs, echo: EchoServer) -> None:
    tls = load_tls(certs.server_cert, certs.server_key)
    before = echo.counters.requests
    with start_frontdoor([APP], echo.address, http_port=0, grpc_port=0, timeout_s=10, tls=tls) as door:
        assert door.http_url is not None and door.http_url.startswith("https://127.0.0.1:")
        assert door.grpc_target is not None
        with _https(door.http_url, certs.ca) as h, \
                grpcclient.InferenceServerClient(door.grpc_target, ssl=True,
                                                 root_certificates=str(certs.ca)) as g:
            assert h.is_server_live() and g.is_server_live()
            http_call = _InFlight(functools.partial(_trusted_http_infer, door.http_url, certs.ca))
            grpc_call = _InFlight(lambda: _grpc_infer(g))
            # While both are in flight (the node answers after 0.3 s): clients that cannot complete a handshake.
            with _https(door.http_url, certs.other_ca) as bad, pytest.raises(ssl.SSLError, match="CERTIFICATE_VERIFY"):
                bad.is_server_live()
            with httpclient.InferenceServerClient(door.http_url.removeprefix("https://"), network_timeout=10) as plain, \
                    pytest.raises((http.client.HTTPException, ConnectionError)):  # the server drops it
                plain.is_server_live()
            with pytest.raises((urllib.error.URLError, ConnectionError)):  # the standard library, plain
                urllib.request.urlopen(door.http_url.replace("https://", "http://") + "/v2/health/live", timeout=10)
            with grpcclient.InferenceServerClient(door.grpc_target, ssl=True,
                                                  root_certificates=str(certs.other_ca)) as bad_g, \
                    pytest.raises(InferenceServerException, match="UNAVAILABLE"):
                bad_g.is_server_live(client_timeout=10)
            with grpcclient.InferenceServerClient(door.grpc_target) as plain_g, \
                    pytest.raises(InferenceServerException, match="UNAVAILABLE"):
                plain_g.is_server_live(client_timeout=10)
            assert http_call.join().shape == ANSWER and grpc_call.join().shape == ANSWER
            # The door still takes new connections, and the old ones keep working.
            with _https(door.http_url, certs.ca) as h2:
                assert _http_infer(h2).shape == ANSWER
            assert _http_infer(h).shape == ANSWER and _grpc_infer(g).shape == ANSWER
        assert echo.counters.requests - before == 5  # every trusted request reached the node once


@pytest.mark.slow
def test_mutual_tls_needs_a_client_certificate_from_the_ca(certs: Certs, echo: EchoServer) -> None:
    tls = load_tls(certs.server_cert, certs.server_key, certs.ca)
    with start_frontdoor([APP], echo.address, http_port=0, grpc_port=0, timeout_s=10, tls=tls) as door:
        assert door.http_url is not None and door.grpc_target is not None
        # TLS 1.3: the server refuses the missing certificate after the client's side of the handshake ended,
        # so the client sees an alert or a closed connection, whichever comes first.
        with _https(door.http_url, certs.ca) as anon, pytest.raises((ssl.SSLError, http.client.HTTPException)):
            anon.is_server_live()
        with grpcclient.InferenceServerClient(door.grpc_target, ssl=True, root_certificates=str(certs.ca)) as anon_g, \
                pytest.raises(InferenceServerException, match="UNAVAILABLE"):
            anon_g.is_server_live(client_timeout=10)
        with _https(door.http_url, certs.ca, certfile=str(certs.client_cert), keyfile=str(certs.client_key)) as h:
            assert _http_infer(h).shape == ANSWER
        with grpcclient.InferenceServerClient(door.grpc_target, ssl=True, root_certificates=str(certs.ca),
                                              private_key=str(certs.client_key),
                                              certificate_chain=str(certs.client_cert)) as g:
            assert _grpc_infer(g).shape == ANSWER


@pytest.mark.slow
def test_the_inference_token_is_checked_and_refusals_are_counted(certs: Certs, echo: EchoServer) -> None:
    before = echo.counters.requests
    with start_frontdoor([APP], echo.address, http_port=0, grpc_port=0, timeout_s=10,
                         inference_token=TOKEN) as door:
        assert door.http_url is not None and door.grpc_target is not None and door.guard is not None
        with httpclient.InferenceServerClient(door.http_url.removeprefix("http://"), network_timeout=30) as h, \
                grpcclient.InferenceServerClient(door.grpc_target) as g:
            for value in (None, "Bearer wrong-token", TOKEN):  # none, a wrong one, the right one without "Bearer"
                with pytest.raises(InferenceServerException) as e:  # (tritonclient adds to the dict it is given)
                    _http_infer(h, headers={"Authorization": value} if value else None)
                assert e.value.status() == "401" and "Bearer" in e.value.message()
                with pytest.raises(InferenceServerException) as e:
                    _grpc_infer(g, headers={"authorization": value} if value else None)
                assert e.value.status() == "StatusCode.UNAUTHENTICATED"
            assert door.guard.refused == {"http": 3, "grpc": 3}
            # Health, metadata and statistics stay open; a refused inference never reached the node.
            assert h.is_server_live() and h.get_model_metadata(APP.name)["name"] == APP.name
            assert g.is_model_ready(APP.name)
            assert echo.counters.requests == before
            auth = {"Authorization": f"Bearer {TOKEN}"}
            assert _http_infer(h, headers=auth).shape == ANSWER
            assert _grpc_infer(g, headers={"authorization": f"Bearer {TOKEN}"}).shape == ANSWER
        assert door.guard.refused == {"http": 3, "grpc": 3} and echo.counters.requests - before == 2


@pytest.mark.slow
def test_token_over_tls(certs: Certs, echo: EchoServer) -> None:
    tls = load_tls(certs.server_cert, certs.server_key)
    with start_frontdoor([APP], echo.address, http_port=0, grpc_port=0, timeout_s=10, tls=tls,
                         inference_token=TOKEN) as door:
        assert door.http_url is not None and door.grpc_target is not None and door.guard is not None
        with _https(door.http_url, certs.ca) as h:
            with pytest.raises(InferenceServerException, match="Bearer"):
                _http_infer(h)
            assert _http_infer(h, headers={"Authorization": f"Bearer {TOKEN}"}).shape == ANSWER
        channel = grpc.secure_channel(door.grpc_target, grpc.ssl_channel_credentials(certs.ca.read_bytes()))
        with channel:  # the raw stub: what a non-tritonclient gRPC client sends
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            req = service_pb2.ModelInferRequest(model_name=APP.name)
            req.inputs.add(name="input", datatype="UINT8", shape=[1, 3, 4, 4])
            req.raw_input_contents.append(_x().tobytes())
            with pytest.raises(grpc.RpcError) as e:
                stub.ModelInfer(req, timeout=30, metadata=(("authorization", "Bearer nope"),))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            resp = stub.ModelInfer(req, timeout=30, metadata=(("authorization", f"Bearer {TOKEN}"),))
            assert tuple(resp.outputs[0].shape) == ANSWER
        assert door.guard.refused == {"http": 1, "grpc": 1}


def test_plain_text_beyond_loopback_is_warned_once(certs: Certs, echo: EchoServer,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    tls = load_tls(certs.server_cert, certs.server_key)
    assert plaintext_warning("127.0.0.1", None, None) is None and plaintext_warning("::1", None, TOKEN) is None
    assert plaintext_warning("0.0.0.0", tls, None) is None
    msg = plaintext_warning("0.0.0.0", None, None)
    assert msg is not None and "anyone who reaches it can infer" in msg and "node.tls" in msg
    msg = plaintext_warning("10.1.2.3", None, TOKEN)
    assert msg is not None and "bearer token" in msg and TOKEN not in msg
    with caplog.at_level(logging.WARNING, logger="gpuprims.frontdoor"), \
            start_frontdoor([APP], echo.address, http_port=0, grpc_port=0, timeout_s=10):
        pass  # loopback: no warning
    assert not [r for r in caplog.records if "plain text" in r.getMessage()]


def test_a_token_guard_refuses_an_empty_token() -> None:
    for bad in ("", " padded "):
        with pytest.raises(ValueError, match="non-empty"):
            TokenGuard(bad)
    g = TokenGuard(TOKEN)
    assert g.allows(f"Bearer {TOKEN}", "http") and not g.allows(f"bearer {TOKEN}", "grpc")
    assert not g.allows(None, "http") and g.refused == {"http": 1, "grpc": 1}

