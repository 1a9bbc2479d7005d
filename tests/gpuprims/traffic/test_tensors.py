"""Multi-tensor apps in the traffic tool: ``--app ID:tensors:NAME=SHAPE:DTYPE;...`` sends TENSORS bodies
(gpuprims.tensorwire, wire dtype 5) and the report counts their answers.

The stand-in node here reassembles each request, decodes its tensors and answers with a TENSORS body
computed from them, so a test sees that what was sent is what the spec says and that an answer's body
reaches the report. tests/orchestrator/frontdoor/test_perf_analyzer_repository.py replays the same syntax into a
real node serving a model of three named inputs.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import click
import numpy as np
import pytest
from click.testing import CliRunner

from gpuprims import tensorwire, wire
from gpuprims.traffic import AppStream, Stream, run
from gpuprims.traffic.cli import main, parse_app
from gpuprims.traffic.stream import tensor_values

from .conftest import ANSWER_TIMEOUT_S

SPEC = "image in=3x5:float32;scale.k=1:int64;flag=1:bool"
TENSORS = (("image in", (3, 5), "float32"), ("scale.k", (1,), "int64"), ("flag", (1,), "bool"))


def _answer(x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What the stand-in answers: the image's row sums, and the names it was given."""
    return {"sum": x["image in"].sum(axis=1), "k twice": 2 * x["scale.k"]}


class TensorNode:
    """A UDP server on loopback that reassembles requests, decodes their TENSORS bodies and answers each
    with the TENSORS body of :func:`_answer` (a request whose body is not TENSORS is answered BAD_REQUEST)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.address = self.sock.getsockname()
        self.seen: list[dict[str, np.ndarray]] = []
        self.dtypes: set[int] = set()
        self._parts: dict[tuple[int, int], dict[int, bytes]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                buf, peer = self.sock.recvfrom(65535)
            except TimeoutError:
                continue
            h, payload = wire.decode_request(buf)
            parts = self._parts.setdefault((h.app_id, h.request_id), {})
            parts[h.chunk_index] = bytes(payload)
            if len(parts) < h.chunk_count:
                continue
            del self._parts[(h.app_id, h.request_id)]
            body = b"".join(parts[i] for i in range(h.chunk_count))
            self.dtypes.add(h.dtype)
            if h.dtype != wire.DType.TENSORS:
                dgs = wire.encode_response(h.app_id, h.request_id, wire.Status.BAD_REQUEST, client_ts_ns=h.client_ts_ns)
            else:
                x = tensorwire.decode_arrays(body)
                self.seen.append(x)
                dgs = wire.encode_response(h.app_id, h.request_id, wire.Status.OK,
                                           tensorwire.encode_arrays(_answer(x)), dtype=wire.DType.TENSORS,
                                           client_ts_ns=h.client_ts_ns)
            for dg in dgs:
                self.sock.sendto(dg, peer)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@pytest.fixture
def node() -> Iterator[TensorNode]:
    n = TensorNode()
    try:
        yield n
    finally:
        n.close()


def test_the_tensors_spec_is_parsed_with_the_app_keys_after_it() -> None:
    app = parse_app(f"3:tensors:{SPEC},rate=20,count=4,variants=2", {})
    assert app.app_id == 3 and app.tensors == TENSORS
    assert (app.rate, app.count, app.variants) == (20.0, 4, 2)
    assert app.wire_dtype == wire.DType.TENSORS
    # A scalar (empty SHAPE) and a name with '=' and ':' in it: the last '=' ends the name.
    odd = parse_app("4:tensors:a=b:c=:float64;x=2x2:uint16,rate=1,count=1", {})
    assert odd.tensors == (("a=b:c", (), "float64"), ("x", (2, 2), "uint16"))


@pytest.mark.parametrize(("spec", "words"), [
    ("3:tensors:image in=3x5", "is not NAME=SHAPE:DTYPE"),
    ("3:tensors:image=3xw:float32", "SHAPE '3xw'"),
    ("3:tensors:image=3:nosuch", "'nosuch' is not a dtype"),
    ("3:tensors:a=1:float32;a=2:int64", "'a' given twice"),
    ("3:tensors:s=1:str", "'s': BYTES tensors are not supported"),
])
def test_a_bad_tensors_spec_names_the_tensor(spec: str, words: str) -> None:
    with pytest.raises(click.BadParameter, match=words):
        parse_app(spec + ",rate=1,count=1", {})


def test_each_request_is_a_tensors_body_of_the_spec() -> None:
    app = AppStream(3, tensors=TENSORS, rate=100, count=4, variants=2, chunk_payload=64)
    plan = Stream([app]).plan()
    assert app.packets_per_request == wire.chunk_count_for(app.body_bytes, 64) > 1  # the body spans datagrams
    bodies = app.bodies()
    assert len(bodies) == 2 and len(bodies[0]) == app.body_bytes
    for v, body in enumerate(bodies):
        got = tensorwire.decode_arrays(body)
        want = tensor_values(TENSORS, seed=v)
        assert list(got) == [n for n, _, _ in TENSORS]
        for name, shape, dtype in TENSORS:
            assert got[name].shape == shape and got[name].dtype == np.dtype(dtype)
            np.testing.assert_array_equal(got[name], want[name])
    assert not np.array_equal(tensorwire.decode_arrays(bodies[0])["image in"],
                              tensorwire.decode_arrays(bodies[1])["image in"])
    # Every datagram of the plan says TENSORS in its header.
    first = plan.pool[int(plan.pkt_off[0]):int(plan.pkt_off[0]) + int(plan.pkt_len[0])].tobytes()
    assert wire.unpack_header(first).dtype == wire.DType.TENSORS
    assert plan.description["apps"][0]["dtype"] == "tensors"
    assert [t["name"] for t in plan.description["apps"][0]["tensors"]] == ["image in", "scale.k", "flag"]


def test_a_replay_of_tensors_bodies_is_answered_and_counted(node: TensorNode) -> None:
    app = AppStream(3, tensors=TENSORS, rate=200, count=30, variants=3, to=node.address)
    r = run(app, timeout_s=ANSWER_TIMEOUT_S, keep_payloads=True)
    s = r.summary
    assert (s["sent"], s["answered"], s["lost"], s["duplicates"]) == (30, 30, 0, 0)
    assert s["status"] == {"OK": 30}
    assert node.dtypes == {wire.DType.TENSORS} and len(node.seen) == 30
    # The answers' bodies are the stand-in's TENSORS answers to what was sent.
    order = np.argsort(r.samples["request_id"])
    for k, event in enumerate(order):
        body = r.body(int(event))
        assert body is not None
        want = _answer(tensor_values(TENSORS, seed=k % 3))
        got = tensorwire.decode_arrays(body)
        np.testing.assert_allclose(got["sum"], want["sum"], rtol=1e-6)
        np.testing.assert_array_equal(got["k twice"], want["k twice"])


def test_gen_and_replay_commands_take_the_tensors_syntax(node: TensorNode, tmp_path) -> None:
    r = CliRunner().invoke(main, ["gen", "--app", f"3:tensors:{SPEC}", "-o", str(tmp_path / "r.npz")])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)["apps"][0]
    assert doc["dtype"] == "tensors" and [t["shape"] for t in doc["tensors"]] == [[3, 5], [1], [1]]
    body = np.load(tmp_path / "r.npz")["app3_v0"]
    assert list(tensorwire.decode_arrays(body)) == ["image in", "scale.k", "flag"]
    host, port = node.address
    r = CliRunner().invoke(main, ["replay", "--app", f"3:tensors:{SPEC},rate=100,to={host}:{port}", "--count", "20",
                                  "--ports", "0", "--timeout", str(ANSWER_TIMEOUT_S), "--no-progress"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["sent"] == 20 and doc["answered"] == 20 and doc["lost"] == 0 and doc["status"] == {"OK": 20}
