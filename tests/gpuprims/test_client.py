from __future__ import annotations

import asyncio
import http.server
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from gpuprims import tensorwire, wire
from gpuprims.client import (
    AsyncClient,
    Client,
    FleetClient,
    MalformedAnswer,
    RequestError,
    RequestLost,
    Result,
)
from gpuprims.ingest import packet_balance
from gpuprims.tensors import DataType
from gpuprims.tensorwire import WireTensor
from gpuprims.traffic import EchoServer
from gpuprims.wire import DType, Status
from tests.loopnode import LoopApp, LoopNode

SHAPE = (3, 16, 16)  # 3072 bytes of float32 = 3 datagrams


def _double_sum(x: np.ndarray) -> np.ndarray:
    """(N, 3, 16, 16) -> (N, 2): a result that depends on every input byte, easy to check."""
    flat = x.reshape(len(x), -1).astype(np.float64)
    return np.stack([flat.sum(1), flat[:, ::7].sum(1)], axis=1).astype(np.float32)


@pytest.fixture
def node() -> Iterator[LoopNode]:
    with LoopNode({1: LoopApp(SHAPE, "float32", _double_sum), 2: LoopApp((5,), "uint8", lambda x: x * 2.0)}) as n:
        yield n


def _input(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)


def test_sync_infer_returns_typed_result(node: LoopNode) -> None:
    x = _input(0)
    with Client(node.address, timeout_s=5) as c:
        r = c.infer(1, x)
        assert isinstance(r, Result) and r.ok and r.status is Status.OK and r.attempts == 1
        assert r.output is not None and r.output.dtype == np.float32 and r.output.shape == (2,)
        np.testing.assert_allclose(r.output, _double_sum(x[None])[0], rtol=1e-5)
        assert r.latency_ms > 0 and r.raise_for_status() is r and r.outputs is None
        u = c.infer(2, np.arange(5, dtype=np.uint8))
        np.testing.assert_array_equal(u.output, np.arange(5, dtype=np.float32) * 2)
        assert c.in_flight == 0 and c.stray == 0


def test_many_requests_in_flight_each_get_their_own_answer(node: LoopNode) -> None:
    xs = [_input(i) for i in range(24)]
    with Client(node.address, timeout_s=5) as c:
        results = c.infer_many(1, xs)
        assert len({r.request_id for r in results}) == 24
        for x, r in zip(xs, results):
            np.testing.assert_allclose(r.raise_for_status().output, _double_sum(x[None])[0], rtol=1e-5)
    assert max(node.batches) > 1  # they really were in flight together (the server batched them)


def test_async_client_gathers_many(node: LoopNode) -> None:
    xs = [_input(100 + i) for i in range(16)]

    async def main() -> list[Result]:
        async with AsyncClient(node.address, timeout_s=5) as c:
            one = await c.infer(1, xs[0])
            rest = await c.infer_many(1, xs[1:])
            assert c.in_flight == 0 and c.stray == 0
            return [one, *rest]

    results = asyncio.run(main())
    for x, r in zip(xs, results):
        np.testing.assert_allclose(r.raise_for_status().output, _double_sum(x[None])[0], rtol=1e-5)


def test_wrong_size_gets_bad_request(node: LoopNode) -> None:
    with Client(node.address, timeout_s=5) as c:
        r = c.infer(1, np.zeros((3, 8, 8), np.float32))
        assert r.status is Status.BAD_REQUEST and r.output is None and not r.ok
        with pytest.raises(RequestError) as e:
            r.raise_for_status()
        assert e.value.status is Status.BAD_REQUEST


def test_unknown_app_is_answered_once_and_counted(node: LoopNode) -> None:
    with Client(node.address, timeout_s=5) as c:
        r = c.infer(99, _input(1))  # 3 datagrams, no route for app 99
        assert r.status is Status.UNKNOWN_APP
        cnt = node.wait(lambda k: k["packets_received"] == 3)
        assert cnt["drop_unknown_app"] == 3 and cnt["responses_sent"] == 1 and packet_balance(cnt) == 0
        # A second request id is a second request: one more answer, no more.
        assert c.infer(99, _input(2)).status is Status.UNKNOWN_APP
        cnt = node.wait(lambda k: k["packets_received"] == 6)
        assert cnt["responses_sent"] == 2 and packet_balance(cnt) == 0
        assert c.stray == 0


def test_unknown_app_repeated_chunks_stay_silent(node: LoopNode) -> None:
    # The same request's datagrams sent twice: still one UNKNOWN_APP answer (the key is remembered).
    import socket

    dg = wire.encode_request(99, 7, _input(3))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        s.settimeout(5)
        for d in dg + dg:
            s.sendto(d, node.address)
        cnt = node.wait(lambda k: k["packets_received"] == 6)
        assert cnt["drop_unknown_app"] == 6 and cnt["responses_sent"] == 1 and packet_balance(cnt) == 0
        h = wire.check_response(s.recv(65536))
        assert (h.status, h.request_id, h.total_len) == (Status.UNKNOWN_APP, 7, 0)


def test_lost_answer_raises_after_timeout_and_retry_recovers() -> None:
    with EchoServer(drop_every=1) as echo, Client(echo.address, timeout_s=0.2) as c:
        with pytest.raises(RequestLost) as e:
            c.infer(1, _input(0))
        assert e.value.attempts == 1 and "timeout_s" in str(e.value)
    # Every second answer is dropped: the first attempt is lost, the retry (new id) is answered.
    with EchoServer(drop_every=2) as echo, Client(echo.address, timeout_s=0.2, retries=1) as c:
        assert c.infer(1, _input(0)).ok  # request 1 answered
        r = c.infer(1, _input(0))  # request 2 dropped, its retry (3) answered
        assert r.ok and r.attempts == 2 and r.latency_ms >= 200


def test_async_timeout_and_retry() -> None:
    async def main(echo: EchoServer) -> None:
        async with AsyncClient(echo.address, timeout_s=0.2, retries=1) as c:
            assert (await c.infer(1, _input(0))).attempts == 1
            assert (await c.infer(1, _input(0))).attempts == 2
        async with AsyncClient(echo.address, timeout_s=0.1) as c:
            with pytest.raises(RequestLost):
                await c.infer(1, _input(0))  # the echo's 4th request: dropped, no retry
            assert (await c.infer(1, _input(0))).ok  # 5th answered

    with EchoServer(drop_every=2) as echo:
        asyncio.run(main(echo))


def test_bad_arguments_are_refused_early() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        Client(timeout_s=0)
    with pytest.raises(ValueError, match="retries"):
        AsyncClient(retries=-1)
    with EchoServer() as echo, Client(echo.address) as c:
        with pytest.raises(ValueError, match="wire dtype"):
            c.submit(1, np.zeros(4, np.float64))
        with pytest.raises(ValueError, match="empty"):
            c.submit(1, np.zeros(0, np.float32))
        with pytest.raises(ValueError, match="app_id"):
            c.submit(70000, np.zeros(4, np.float32))
        with pytest.raises(ValueError, match="deadline_us"):
            c.submit(1, np.zeros(4, np.float32), deadline_us=-1)
    with pytest.raises(RuntimeError, match="not open"):
        asyncio.run(AsyncClient().infer(1, np.zeros(4, np.float32)))


def test_close_fails_pending_requests() -> None:
    with EchoServer(drop_every=1) as echo:
        c = Client(echo.address, timeout_s=30)
        fut = c.submit(1, _input(0))
        c.close()
        with pytest.raises(RequestLost):
            fut.result(timeout=5)
        with pytest.raises(RuntimeError, match="closed"):
            c.submit(1, _input(0))


def test_overloaded_is_retried_only_when_asked() -> None:
    with EchoServer(status=Status.OVERLOADED) as echo:
        with Client(echo.address, timeout_s=2) as c:
            r = c.infer(1, _input(0))
            assert r.status is Status.OVERLOADED and r.attempts == 1
        with Client(echo.address, timeout_s=2, retries=2) as c:
            r = c.infer(1, _input(0))
            assert r.status is Status.OVERLOADED and r.attempts == 3
        assert echo.counters.requests == 4  # 1 + 3 attempts, each a new request id

        async def main() -> Result:
            async with AsyncClient(echo.address, timeout_s=2, retries=1) as a:
                return await a.infer(1, _input(0))

        r = asyncio.run(main())
        assert r.status is Status.OVERLOADED and r.attempts == 2


# ---- fleet mode ---------------------------------------------------------------------------------------


class _Routes:
    """The agents' GET /fleet/routes, serving whatever table the test sets."""

    def __init__(self, table: dict) -> None:
        self.table = table
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = json.dumps(outer.table).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: object) -> None:
                return

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


def _table(version: int, primary: EchoServer, standby: EchoServer | None) -> dict:
    def at(e: EchoServer, node: str) -> dict:
        return {"host": "127.0.0.1", "udp_port": e.port, "http_port": 0, "node": node, "gpu": 0}
    return {"version": version, "apps": {"cls": {"app_id": 1, "slo_ms": 100, "primary": at(primary, "n1"),
                                                 "standby": at(standby, "n2") if standby else None}}}


def _wait_for(cond: object, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_fleet_client_sends_to_the_owner() -> None:
    with EchoServer() as p, EchoServer() as s:
        routes = _Routes(_table(1, p, s))
        try:
            with FleetClient([routes.url], failover_s=0.5, timeout_s=5) as c:
                r = c.infer("cls", _input(0))
                assert r.ok and c.failovers == 0
                assert (p.counters.requests, s.counters.requests) == (1, 0)
        finally:
            routes.close()


def test_fleet_client_fails_over_to_the_standby_when_the_owner_is_silent() -> None:
    with EchoServer(drop_every=1) as p, EchoServer() as s:
        routes = _Routes(_table(1, p, s))
        try:
            with FleetClient(["http://127.0.0.1:9", routes.url], failover_s=0.2, timeout_s=5) as c:
                routes.table = _table(2, s, None)  # the controller flipped the route meanwhile
                r = c.infer("cls", _input(1))
                assert r.ok and c.failovers == 1 and s.counters.requests == 1
                assert c.seeds[0] == routes.url  # the seed that did not answer is asked last now
                # The table is refreshed beside the re-send; then the next request goes straight to the
                # new owner.
                assert _wait_for(lambda: c.table["version"] == 2, 10)
                assert c.infer("cls", _input(2)).ok and c.failovers == 1 and s.counters.requests == 2
        finally:
            routes.close()


def test_fleet_client_fails_over_without_waiting_for_a_silent_routes_server() -> None:
    # A stopped machine's routes server accepts the connection and never answers: the re-send to the
    # standby the table names must not wait for that fetch (it would add a fetch timeout per request).
    release = threading.Event()
    with EchoServer(drop_every=1) as p, EchoServer() as s:
        routes = _Routes(_table(1, p, s))
        silent = _Routes(_table(1, p, s))
        original = silent.srv.RequestHandlerClass.do_GET

        def hang(handler: http.server.BaseHTTPRequestHandler) -> None:
            release.wait(30)
            original(handler)

        silent.srv.RequestHandlerClass.do_GET = hang  # type: ignore[method-assign]
        try:
            with FleetClient([routes.url, silent.url], failover_s=0.2, timeout_s=10, fetch_timeout_s=30) as c:
                c.seeds[:] = [silent.url, routes.url]  # the silent one is asked first from now on
                # Waiting for the fetch (30 s) would leave the re-send no time of the request's 10 s.
                r = c.infer("cls", _input(6))
                assert r.ok and c.failovers == 1 and s.counters.requests == 1
                release.set()
        finally:
            release.set()
            routes.close()
            silent.close()


@pytest.mark.slow
def test_fleet_client_returns_the_first_answer_once_and_counts_the_late_one() -> None:
    with EchoServer(delay_s=1.0) as p, EchoServer() as s:
        routes = _Routes(_table(1, p, s))
        try:
            with FleetClient([routes.url], failover_s=0.2, timeout_s=5) as c:
                r = c.infer("cls", _input(3))
                assert r.ok and r.attempts == 1 and c.failovers == 1
                assert _wait_for(lambda: c.duplicates == 1, 10)  # the owner's late answer: counted, not returned
        finally:
            routes.close()


def test_fleet_client_fails_over_when_the_owner_lost_the_app() -> None:
    with EchoServer(status=Status.UNKNOWN_APP) as p, EchoServer() as s:
        routes = _Routes(_table(1, p, s))
        try:
            with FleetClient([routes.url], failover_s=1.0, timeout_s=5) as c:
                assert c.infer("cls", _input(4)).ok and c.failovers == 1
        finally:
            routes.close()


def test_fleet_client_bad_input_gets_clear_errors() -> None:
    with pytest.raises(ValueError, match="at least one seed"):
        FleetClient([])
    with pytest.raises(ValueError, match="failover_s < timeout_s"):
        FleetClient(["http://127.0.0.1:9"], failover_s=3, timeout_s=2)
    with pytest.raises(ConnectionError, match="no node served the fleet's routing table"):
        FleetClient(["http://127.0.0.1:9"], fetch_timeout_s=0.5)
    with EchoServer() as p:
        routes = _Routes(_table(1, p, None))
        try:
            with FleetClient([routes.url]) as c, pytest.raises(KeyError, match="has no app 'nope'; apps: cls"):
                c.infer("nope", _input(5))
        finally:
            routes.close()


# ---- multi-tensor requests and answers (wire dtype TENSORS) -------------------------------------------

#: (request header, request body) -> (status, answer body, answer wire dtype)
Handler = Callable[[wire.Header, bytes], tuple[Status, bytes, DType]]


class _Answerer:
    """A loopback UDP node stand-in: reassembles each request, keeps its datagrams, and answers with
    whatever ``handler`` crafts from it (answers a real node could not be made to send)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.datagrams: list[bytes] = []
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.address = self.sock.getsockname()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        parts: dict[int, dict[int, bytes]] = {}
        while not self._stop.is_set():
            try:
                data, addr = self.sock.recvfrom(65536)
            except TimeoutError:
                continue
            self.datagrams.append(data)
            h, payload = wire.decode_request(data)
            got = parts.setdefault(h.request_id, {})
            got[h.chunk_index] = bytes(payload)
            if len(got) < h.chunk_count:
                continue
            body = b"".join(got[i] for i in range(h.chunk_count))
            del parts[h.request_id]
            status, answer, dtype = self.handler(h, body)
            for d in wire.encode_response(h.app_id, h.request_id, status, answer, dtype=dtype,
                                          client_ts_ns=h.client_ts_ns):
                self.sock.sendto(d, addr)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()

    def __enter__(self) -> _Answerer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _model(h: wire.Header, body: bytes) -> tuple[Status, bytes, DType]:
    """A two-output model over named inputs: a bare tensor is refused, as a TENSORS-only app would."""
    if h.dtype != DType.TENSORS:
        return Status.BAD_REQUEST, b"", DType.BYTES
    x = tensorwire.decode_arrays(body)
    out = {"sum": np.float64([sum(float(np.sum(v, dtype=np.float64)) for v in x.values())]),
           "names": np.array([len(x)], np.int32), "echo": x["image"], "flag": np.array(True)}
    return Status.OK, tensorwire.encode_arrays(out), DType.TENSORS


def test_an_array_request_is_the_same_datagrams_as_before() -> None:
    x = _input(7)  # 3 datagrams
    with _Answerer(lambda h, b: (Status.OK, b[:8], DType.FLOAT32)) as node, Client(node.address, timeout_s=5) as c:
        r = c.infer(4, x, deadline_us=1234)
        assert r.ok and r.outputs is None and r.output is not None and r.output.dtype == np.float32
        h = wire.unpack_header(node.datagrams[0])
        assert node.datagrams == wire.encode_request(4, h.request_id, x, deadline_us=1234, client_ts_ns=h.client_ts_ns)
        assert h.dtype == DType.FLOAT32


def test_a_mapping_is_sent_as_named_tensors_and_the_answer_decoded() -> None:
    x = {"image": np.random.default_rng(1).standard_normal((3, 20, 20)).astype(np.float32),  # 4800 B, chunked
         "scale": np.float16(0.5), "ids": np.arange(6, dtype=np.int64).reshape(2, 3)}
    with _Answerer(_model) as node, Client(node.address, timeout_s=5) as c:
        r = c.infer(3, x)
        assert r.raise_for_status().outputs is not None and set(r.outputs) == {"sum", "names", "echo", "flag"}
        np.testing.assert_array_equal(r.outputs["echo"], x["image"])
        assert r.outputs["echo"].shape == (3, 20, 20) and not r.outputs["echo"].flags.writeable
        assert r.outputs["names"].tolist() == [3] and r.outputs["flag"].shape == () and bool(r.outputs["flag"])
        want = sum(float(np.sum(v, dtype=np.float64)) for v in x.values())
        assert r.outputs["sum"][0] == pytest.approx(want)
        assert r.output is not None and r.output.dtype == np.uint8  # the raw body, as for any answer
        assert len(node.datagrams) > 1 and {wire.unpack_header(d).dtype for d in node.datagrams} == {DType.TENSORS}
        # BF16 goes as WireTensors (its uint16 bits); several mappings in flight together.
        bf = [WireTensor("image", DataType.BF16, np.array([0x3F80, 0x4000], np.uint16))]
        rs = c.infer_many(3, [bf, {"image": np.zeros(2, np.uint8)}, x])
        assert [len(q.raise_for_status().outputs or {}) for q in rs] == [4, 4, 4]
        np.testing.assert_array_equal(rs[0].outputs["echo"], [0x3F80, 0x4000])  # type: ignore[index]
        assert c.infer(3, np.zeros(4, np.float32)).status is Status.BAD_REQUEST  # a bare tensor still goes bare
        assert c.malformed == 0 and c.stray == 0


def test_a_malformed_multi_tensor_answer_raises_for_its_request_only() -> None:
    def bad(h: wire.Header, body: bytes) -> tuple[Status, bytes, DType]:
        if h.app_id == 9:  # claims TENSORS, carries garbage
            return Status.OK, b"not a tensor body", DType.TENSORS
        return _model(h, body)

    with _Answerer(bad) as node, Client(node.address, timeout_s=5) as c:
        with pytest.raises(MalformedAnswer, match=r"malformed multi-tensor body.*bad magic") as e:
            c.infer(9, {"image": np.zeros(3, np.float32)})
        assert e.value.app_id == 9 and e.value.body == b"not a tensor body" and c.malformed == 1
        assert c.infer(3, {"image": np.ones(3, np.float32)}).ok  # the receive loop lives on

        async def main() -> None:
            async with AsyncClient(node.address, timeout_s=5) as a:
                with pytest.raises(MalformedAnswer, match="bad magic"):
                    await a.infer(9, {"image": np.zeros(3, np.float32)})
                r = await a.infer(3, {"image": np.arange(4, dtype=np.int8)})
                assert r.outputs is not None and r.outputs["echo"].tolist() == [0, 1, 2, 3]
                many = await a.infer_many(3, [{"image": np.full(2, i, np.uint16)} for i in range(5)])
                assert [int(q.outputs["echo"][0]) for q in many] == list(range(5))  # type: ignore[index]
                assert a.malformed == 1

        asyncio.run(main())


def test_bad_tensor_mappings_are_refused_before_anything_is_sent() -> None:
    with _Answerer(_model) as node, Client(node.address, timeout_s=5) as c:
        with pytest.raises(ValueError, match="at least one named tensor"):
            c.submit(3, {})
        with pytest.raises(ValueError, match="BYTES tensors are not supported yet"):
            c.submit(3, {"text": np.array(["a", "b"])})
        with pytest.raises(ValueError, match="duplicate"):
            c.submit(3, [WireTensor("a", DataType.INT8, np.zeros(1, np.int8))] * 2)
        with pytest.raises(ValueError, match="no tensor datatype"):
            c.submit(3, {"z": np.zeros(2, np.complex64)})
        assert node.datagrams == [] and c.in_flight == 0


def test_infer_many_sends_one_query_every_request_but_the_last_saying_more_follow() -> None:
    xs = [_input(i) for i in range(4)]  # 3 datagrams each
    with _Answerer(lambda h, b: (Status.OK, b[:8], DType.FLOAT32)) as node, Client(node.address, timeout_s=5) as c:
        assert all(r.ok for r in c.infer_many(4, xs))
        one = c.infer(4, xs[0])
        assert one.ok
    flags: dict[int, set[int]] = {}
    for d in node.datagrams:
        h = wire.unpack_header(d)
        flags.setdefault(h.request_id, set()).add(h.flags)
    rids = sorted(flags)
    assert len(rids) == 5 and len(node.datagrams) == 15
    # every datagram of a request carries its flag; the query's last request and a single one none
    assert [flags[r] for r in rids] == [{wire.FLAG_MORE}] * 3 + [{0}, {0}]


def test_async_infer_many_sends_one_query_too() -> None:
    xs = [_input(i) for i in range(3)]

    async def run(address: tuple[str, int]) -> list[Result]:
        async with AsyncClient(address, timeout_s=5) as c:
            return await c.infer_many(4, xs)

    with _Answerer(lambda h, b: (Status.OK, b[:8], DType.FLOAT32)) as node:
        assert all(r.ok for r in asyncio.run(run(node.address)))
    by_rid = {wire.unpack_header(d).request_id: wire.unpack_header(d).flags for d in node.datagrams}
    assert [by_rid[r] for r in sorted(by_rid)] == [wire.FLAG_MORE, wire.FLAG_MORE, 0]


def test_a_traced_client_gives_each_result_its_timestamps_in_order_and_an_untraced_one_none() -> None:
    x = _input(3)  # 3 datagrams
    with _Answerer(lambda h, b: (Status.OK, b[:8], DType.FLOAT32)) as node:
        with Client(node.address, timeout_s=5, trace=True) as c:
            r = c.infer(4, x)
        with Client(node.address, timeout_s=5) as plain:
            assert plain.infer(4, x).trace is None
    t = r.trace
    assert t is not None
    assert 0 < t.start_ns <= t.client_ts_ns <= t.first_sent_ns <= t.last_sent_ns <= t.answered_ns
    sent = [wire.unpack_header(d) for d in node.datagrams[:3]]
    assert {h.client_ts_ns for h in sent} == {t.client_ts_ns} and sent[0].request_id == r.request_id


def test_a_traced_answer_that_comes_back_before_the_send_call_returns_still_has_its_timestamps() -> None:
    """The receive thread resolves an answer as soon as it lands; a traced request's send timestamps are
    written after its send call returns. Here the send call returns only after the node has answered
    (on a busy machine the sender can simply be descheduled that long): the trace is still whole."""
    answered = threading.Event()

    def handler(h: wire.Header, b: bytes) -> tuple[Status, bytes, DType]:
        answered.set()
        return Status.OK, b[:8], DType.FLOAT32

    with _Answerer(handler) as node, Client(node.address, timeout_s=5, trace=True) as c:
        send = c._book.send

        def slow_return(*args: object, **kwargs: object) -> object:
            out = send(*args, **kwargs)
            assert answered.wait(5), "the node never answered"
            time.sleep(0.1)  # lets the answer land first; only makes the race likelier, never a pass
            return out

        c._book.send = slow_return  # type: ignore[method-assign]
        r = c.infer(4, _input(3))
    t = r.trace
    assert r.ok and t is not None
    assert 0 < t.start_ns <= t.client_ts_ns <= t.first_sent_ns <= t.last_sent_ns <= t.answered_ns


def test_a_client_of_a_node_named_by_host_name_sends_the_same_datagrams_a_datagram_at_a_time() -> None:
    x = _input(5)  # 3 datagrams
    with _Answerer(lambda h, b: (Status.OK, b[:8], DType.FLOAT32)) as node, \
            Client(("localhost", node.address[1]), timeout_s=5) as c:
        r = c.infer(4, x, deadline_us=77)
        assert r.ok
        h = wire.unpack_header(node.datagrams[0])
        assert node.datagrams == wire.encode_request(4, h.request_id, x, deadline_us=77, client_ts_ns=h.client_ts_ns)
        assert c.infer(4, x).ok  # and on


def test_an_async_client_sends_the_same_datagrams_in_one_call_and_by_host_name_a_datagram_at_a_time() -> None:
    x = _input(9)  # 3 datagrams

    async def run(address: tuple[str, int]) -> Result:
        async with AsyncClient(address, timeout_s=5) as c:
            return await c.infer(4, x, deadline_us=55)

    for host in ("127.0.0.1", "localhost"):
        with _Answerer(lambda h, b: (Status.OK, b[:8], DType.FLOAT32)) as node:
            assert asyncio.run(run((host, node.address[1]))).ok
        h = wire.unpack_header(node.datagrams[0])
        assert sorted(node.datagrams) == sorted(
            wire.encode_request(4, h.request_id, x, deadline_us=55, client_ts_ns=h.client_ts_ns)), host
