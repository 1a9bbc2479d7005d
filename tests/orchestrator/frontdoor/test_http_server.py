"""The HTTP front door's body bounds: what a model cannot take is refused (413) before it is read."""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time
from types import SimpleNamespace
from urllib.parse import urlsplit

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from orchestrator.frontdoor.http_server import HEADER_LENGTH, max_body_bytes
from orchestrator.frontdoor.models import model_info

from .conftest import APPS, Stack

#: What the tests declare: a body no app here can take (the issue's flood sent four of 200 MB).
DECLARED_BYTES = 200_000_000
#: Most bytes a flood connection sends before it gives up waiting for the refusal. The kernel's
#: socket buffers on loopback absorb a few MB that the server never reads; a server that reads the
#: whole body (the bug) never answers before this.
SEND_CAP_BYTES = 48 << 20
CHUNK = b"7" * (64 << 10)
TIMEOUT_S = 30.0


def _address(stack: Stack) -> tuple[str, int]:
    assert stack.door.http_url is not None
    u = urlsplit(stack.door.http_url)
    assert u.hostname is not None and u.port is not None
    return u.hostname, u.port


def _head(model: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST /v2/models/{model}/infer HTTP/1.1", "Host: test", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _response(sock: socket.socket) -> tuple[int, dict]:
    """Status and JSON body of the one answer on ``sock`` (read until the server closes it)."""
    data = b""
    sock.settimeout(TIMEOUT_S)
    while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + _length(data):
        more = sock.recv(65536)
        if not more:
            break
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body[:_length(data)])


def _length(data: bytes) -> int:
    head = data.partition(b"\r\n\r\n")[0].decode("latin-1").lower()
    for line in head.split("\r\n"):
        if line.startswith("content-length:"):
            return int(line.split(":", 1)[1])
    return 1 << 30


def _send_until_answered(sock: socket.socket, chunked: bool) -> int:
    """Stream body bytes until the server answers (or SEND_CAP_BYTES); returns the bytes sent."""
    sent = 0
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
    sock.setblocking(False)
    piece = (b"%x\r\n" % len(CHUNK)) + CHUNK + b"\r\n" if chunked else CHUNK
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while sent < SEND_CAP_BYTES and time.monotonic() < deadline:
            events = sel.select(timeout=1.0)
            if any(mask & selectors.EVENT_READ for _, mask in events):
                return sent  # the answer (or the close) came
            if any(mask & selectors.EVENT_WRITE for _, mask in events):
                try:
                    sent += sock.send(piece)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:  # the server closed its side: it answered and stopped reading
                    return sent
        return sent
    finally:
        sel.close()
        sock.setblocking(True)


def _flood_one(stack: Stack, chunked: bool) -> tuple[int, dict, int]:
    headers = {"Content-Type": "application/json"}
    headers.update({"Transfer-Encoding": "chunked"} if chunked else {"Content-Length": str(DECLARED_BYTES)})
    with socket.create_connection(_address(stack), timeout=TIMEOUT_S) as s:
        s.sendall(_head("classify", headers))
        sent = _send_until_answered(s, chunked)
        code, answer = _response(s)
    return code, answer, sent


def test_bounds_follow_each_model() -> None:
    """JSON bodies may be 25 bytes per element, binary ones the raw tensor; the server-wide bound
    is the largest model's."""
    infos = [model_info(a) for a in APPS]
    classify, detect = infos
    assert classify.max_body_bytes(binary=True) == 4 * 3 * 32 * 32 * 4 + (64 << 10)
    assert classify.max_body_bytes(binary=False) == 4 * 3 * 32 * 32 * 25 + (64 << 10)
    assert detect.max_body_bytes(binary=True) < classify.max_body_bytes(binary=True)
    core = SimpleNamespace(models={m.name: m for m in infos})

    assert max_body_bytes(core) == classify.max_body_bytes(binary=False)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("expect", [False, True])
def test_oversized_content_length_is_refused_before_the_body(stack: Stack, expect: bool) -> None:
    """A declared length above the model's bound is answered 413 without the body: the test sends
    none of it (with Expect: 100-continue, the client is told not to send it at all)."""
    headers = {"Content-Type": "application/octet-stream", "Content-Length": str(DECLARED_BYTES),
               HEADER_LENGTH: "100"}
    if expect:
        headers["Expect"] = "100-continue"
    with socket.create_connection(_address(stack), timeout=TIMEOUT_S) as s:
        s.sendall(_head("detect", headers))
        code, answer = _response(s)
    limit = model_info(APPS[1]).max_body_bytes(binary=True)
    assert code == 413 and "'detect'" in answer["error"] and str(limit) in answer["error"], answer


def test_chunked_oversized_body_is_refused_once_past_the_bound(stack: Stack) -> None:
    code, answer, sent = _flood_one(stack, chunked=True)
    assert code == 413 and "more than" in answer["error"], answer
    assert sent < SEND_CAP_BYTES  # refused while the client was still sending: the server stopped reading


def test_largest_valid_json_request_is_served(stack: Stack) -> None:
    """max_batch rows of the longest floats JSON text holds fit the bound, and are answered."""
    app = APPS[0]
    x = np.full((app.max_batch, *app.input_shape), -1.2345678e-30, np.float32)
    t = httpclient.InferInput("input", list(x.shape), "FP32")
    t.set_data_from_numpy(x, binary_data=False)
    body_bytes = len(json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape),
                                             "data": x.reshape(-1).tolist()}]}))
    assert body_bytes > 0.8 * model_info(app).max_body_bytes(binary=False)  # near the bound, within it
    assert stack.door.http_url is not None
    with httpclient.InferenceServerClient(stack.door.http_url.removeprefix("http://")) as c:
        out = c.infer(app.name, [t]).as_numpy("logits")
    np.testing.assert_allclose(out, stack.expect(app.name, x), rtol=1e-4, atol=1e-4)


def test_more_rows_than_max_batch_are_refused(stack: Stack) -> None:
    x = np.zeros((APPS[0].max_batch + 1, *APPS[0].input_shape), np.float32)
    t = httpclient.InferInput("input", list(x.shape), "FP32")
    t.set_data_from_numpy(x, binary_data=True)
    assert stack.door.http_url is not None
    with (httpclient.InferenceServerClient(stack.door.http_url.removeprefix("http://")) as c,
          pytest.raises(InferenceServerException, match="max_batch") as e):
        c.infer(APPS[0].name, [t])
    assert e.value.status() == "400"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_flood_of_oversized_bodies_keeps_memory_bounded(stack: Stack) -> None:
    """Eight concurrent 200 MB bodies (four declared, four chunked): each is refused while being
    sent, and the node's resident memory (this process hosts it) grows by far less than one body."""
    results: list[tuple[int, dict, int]] = []
    errors: list[BaseException] = []
    peak = [_rss_bytes()]
    start = peak[0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], _rss_bytes())

    def one(chunked: bool) -> None:
        try:
            results.append(_flood_one(stack, chunked))
        except BaseException as e:  # reported below
            errors.append(e)

    sampler = threading.Thread(target=sample)
    sampler.start()
    threads = [threading.Thread(target=one, args=(i % 2 == 1,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 2)
    done.set()
    sampler.join()
    assert not errors and not any(t.is_alive() for t in threads), errors
    assert [r[0] for r in results] == [413] * 8, results
    assert all(sent < SEND_CAP_BYTES for _, _, sent in results)
    grown_mb = (peak[0] - start) / 2**20
    assert grown_mb < 64, f"RSS grew {grown_mb:.0f} MB under the flood"
