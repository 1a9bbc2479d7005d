"""The front door's way into the node: rows placed into the packet pool, answers back in-process.

Faults: an instance killed while it holds the front door's rows (each answered once, with an error
status), an answer that comes after its row was given up (dropped, never a second answer). Stages:
every protocol's inferences are split into the stages of ``transport.STAGES``.
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing as mp
import os
import threading
import time
import weakref
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from gpuprims.ingest import Ingest
from gpuprims.pool import PacketPool
from gpuprims.wire import Status
from orchestrator.config.schema import AppConfig
from orchestrator.frontdoor import start_frontdoor
from orchestrator.frontdoor.transport import STAGES

from .conftest import Stack, inputs

APP = AppConfig(name="tiny", model="resnet18", input_shape=(3, 8, 8), dtype="float32", num_classes=10, slo_ms=500,
                app_id=5)
#: How long a test waits for something that happens at once on an idle machine.
REACT_S = 30.0


class Pool:
    """A pool and a started ingest routing APP to consumer 0, nobody consuming."""

    def __init__(self) -> None:
        self.pool = PacketPool.create(slot_count=512, record_count=32, max_chunks=16, consumer_count=2)
        self.ingest = Ingest(self.pool, [("127.0.0.1", 0)], timeout_ms=REACT_S * 1000).start()
        self.ingest.set_route(APP.app_id, [0])
        self.address = ("127.0.0.1", self.ingest.ports[0])

    def held(self, n: int, consumer: int = 0) -> None:
        """Wait until ``consumer``'s queue has n requests."""
        deadline = time.monotonic() + REACT_S
        while self.pool.consumer(consumer).depth() < n and time.monotonic() < deadline:
            time.sleep(0.005)
        assert self.pool.consumer(consumer).depth() == n

    def close(self) -> None:
        self.ingest.stop()
        self.pool.close()


@pytest.fixture
def pool() -> Iterator[Pool]:
    p = Pool()
    yield p
    p.close()


def _hold_then_die(pool_name: str, n: int) -> None:
    """An instance that takes n requests and is killed before it answers (os._exit: no clean-up)."""
    pool = PacketPool.attach(pool_name)
    got: list[int] = []
    deadline = time.monotonic() + REACT_S
    while len(got) < n and time.monotonic() < deadline:
        got += pool.consumer(0).poll(16, 100).tolist()
    os._exit(0 if len(got) == n else 1)


def _call_http(door_url: str, x: np.ndarray, out: list[BaseException | None]) -> None:
    with httpclient.InferenceServerClient(door_url.removeprefix("http://"), network_timeout=REACT_S * 2) as h:
        t = httpclient.InferInput("input", list(x.shape), "FP32")
        t.set_data_from_numpy(x, binary_data=True)
        try:
            h.infer(APP.name, [t])
            out.append(None)
        except BaseException as e:
            out.append(e)


@pytest.mark.slow  # a spawned instance process: seconds of imports on a busy machine
def test_an_instance_killed_holding_front_door_rows_answers_each_once_with_an_error(pool: Pool) -> None:
    """The instance process dies holding both rows of an HTTP inference; the supervisor's reclaim
    (no other instance to requeue to) answers each INSTANCE_FAILED once, and the client gets one 503."""
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=_hold_then_die, args=(pool.pool.name, 2))
    child.start()
    try:
        with start_frontdoor([APP], pool.address, http_port=0, grpc_port=None, timeout_s=REACT_S * 2,
                             ingest=pool.ingest) as door:
            assert door.http_url is not None
            got: list[BaseException | None] = []
            t = threading.Thread(target=_call_http, args=(door.http_url, np.ones((2, 3, 8, 8), np.float32), got))
            t.start()
            child.join(REACT_S + 60)
            assert child.exitcode == 0  # it took both rows, then died
            assert pool.ingest.reclaim(0, requeue=False) == (2, 0)
            t.join(REACT_S * 3)
            assert len(got) == 1 and isinstance(got[0], InferenceServerException)
            assert got[0].status() == "503" and "INSTANCE_FAILED" in got[0].message()
            assert door.core is not None
            oip = door.core.stats[APP.name].totals().oip  # the front door's counts in the app's record
            assert oip["statuses"] == {"INSTANCE_FAILED": 2}
            assert oip["fail"]["count"] == 1 and oip["success"]["count"] == 0
            c = pool.ingest.counters()
            assert c["local_submitted"] == c["local_answered"] == 2 and c["responses_sent"] == 0
            assert door.core.transport.stray == 0  # type: ignore[attr-defined]
    finally:
        if child.is_alive():
            child.kill()
        child.join()


def test_an_answer_after_its_row_was_given_up_is_dropped_not_sent_twice(pool: Pool) -> None:
    with start_frontdoor([APP], pool.address, http_port=None, grpc_port=0, timeout_s=0.3,
                         ingest=pool.ingest) as door:
        assert door.grpc_target is not None and door.core is not None
        x = np.ones((1, 3, 8, 8), np.float32)
        t = grpcclient.InferInput("input", list(x.shape), "FP32")
        t.set_data_from_numpy(x)
        with grpcclient.InferenceServerClient(door.grpc_target) as g, pytest.raises(InferenceServerException) as e:
            g.infer(APP.name, [t])
        assert e.value.status() == "StatusCode.DEADLINE_EXCEEDED" and "no answer" in e.value.message()
        pool.held(1)
        cons = pool.pool.consumer(0)
        recs = cons.poll(1, 0)
        cons.answer(recs, pool.pool.requests(recs), Status.OK, np.zeros((1, 10), np.float32))
        deadline = time.monotonic() + REACT_S
        while door.core.transport.stray == 0 and time.monotonic() < deadline:  # type: ignore[attr-defined]
            time.sleep(0.005)
        assert door.core.transport.stray == 1  # type: ignore[attr-defined]
        assert door.core.stats[APP.name].totals().oip["statuses"] == {"LOST": 1}


def test_rows_the_node_cannot_take_are_answered_with_the_reason(pool: Pool) -> None:
    """No route (UNKNOWN_APP: 503) and a row too large for the pool (BAD_REQUEST: 400), through the pool."""
    big = AppConfig(name="big", model="resnet18", input_shape=(3, 64, 64), dtype="float32", num_classes=10,
                    slo_ms=500, app_id=5)  # 48 KiB a row: more chunks than this pool's records map
    ghost = AppConfig(name="ghost", model="resnet18", input_shape=(3, 8, 8), dtype="float32", num_classes=10,
                      slo_ms=500, app_id=6)
    with start_frontdoor([big, ghost], pool.address, http_port=0, grpc_port=None, timeout_s=REACT_S,
                         ingest=pool.ingest) as door:
        assert door.http_url is not None
        with httpclient.InferenceServerClient(door.http_url.removeprefix("http://")) as h:
            for name, shape, code, what in (("ghost", (1, 3, 8, 8), "503", "UNKNOWN_APP"),
                                            ("big", (1, 3, 64, 64), "400", "BAD_REQUEST")):
                t = httpclient.InferInput("input", list(shape), "FP32")
                t.set_data_from_numpy(np.zeros(shape, np.float32), binary_data=True)
                with pytest.raises(InferenceServerException) as e:
                    h.infer(name, [t])
                assert e.value.status() == code and what in e.value.message()


def test_each_protocol_reports_its_stage_times(stack: Stack) -> None:
    x = inputs("classify", 2, seed=3)
    assert stack.door.http_url is not None and stack.door.grpc_target is not None
    with httpclient.InferenceServerClient(stack.door.http_url.removeprefix("http://")) as h:
        t = httpclient.InferInput("input", list(x.shape), "FP32")
        t.set_data_from_numpy(x, binary_data=True)
        h.infer("classify", [t])
    with grpcclient.InferenceServerClient(stack.door.grpc_target) as g:
        t = grpcclient.InferInput("input", list(x.shape), "FP32")
        t.set_data_from_numpy(x)
        g.infer("classify", [t])
    stages = stack.door.stages()
    for protocol in ("http", "grpc"):
        s = stages[protocol]
        assert s["transport"] == stack.via and s["inferences"] >= 1
        assert set(STAGES) <= set(s)
        assert s["node"]["p50_ms"] > 0 and s["parse"]["p50_ms"] > 0 and s["encode"]["p50_ms"] > 0
        assert all(s[k]["p50_ms"] >= 0 for k in STAGES)
        if stack.via == "pool":
            assert s["back"]["p50_ms"] > 0


def test_grpc_infer_bytes_that_do_not_parse_are_invalid_argument(stack: Stack) -> None:
    """ModelInfer parses its own request bytes (so the parse is timed): garbage is the client's error."""
    import grpc

    assert stack.door.grpc_target is not None
    with grpc.insecure_channel(stack.door.grpc_target) as ch:
        call = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer")  # bytes in, bytes out
        with pytest.raises(grpc.RpcError) as e:
            call(b"\xff\xff\xff\xff", timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not parse" in e.value.details()


class _Node:
    """Stands for the node a front door is given: its readiness is a bound method of it."""

    def ready(self, name: str) -> bool:
        return True


def test_a_closed_front_door_holds_nothing_of_the_node(pool: Pool) -> None:
    """grpc keeps its handlers (and so the front door's core) past the server's stop: after close, none
    of them may keep the node, its ingest or its pool alive, and every model reads as not ready."""
    node = _Node()
    door = start_frontdoor([APP], pool.address, http_port=0, grpc_port=0, ready=node.ready, ingest=pool.ingest)
    core = door.core
    assert core is not None and core.model_ready(APP.name)
    with grpcclient.InferenceServerClient(door.grpc_target) as g:  # type: ignore[arg-type]
        assert g.is_model_ready(APP.name)
    door.close()
    assert not core.model_ready(APP.name) and not core.server_ready()
    assert door.ingest is None and "pool" in repr(door)
    gone = weakref.ref(node)
    del node
    gc.collect()
    assert gone() is None, [type(r).__name__ for r in gc.get_referrers(gone())]


@pytest.mark.slow
def test_inferences_are_shed_while_the_loop_runs_behind_and_admitted_once_it_catches_up(pool: Pool) -> None:
    """A front door whose loop runs further behind than the model's SLO refuses inferences at once
    (503 / UNAVAILABLE, counted as SHED), before decoding them; once it catches up it places them again.
    The lag is made by a task on the door's loop that blocks it for 0.8 s at every turn (APP's SLO is
    500 ms), whatever the machine's speed."""
    door = start_frontdoor([APP], pool.address, http_port=0, grpc_port=0, ingest=pool.ingest, timeout_s=REACT_S)
    core = door.core
    assert core is not None and door.http_url is not None
    core.lag_idle_after_s = 3600.0  # keeps watching from the start, however slowly the test reaches its calls
    stop, blocking = threading.Event(), threading.Event()

    async def block() -> None:
        while not stop.is_set():
            blocking.set()
            time.sleep(0.8)  # the loop's turn takes 0.8 s: everything waiting on it waits as long
            await asyncio.sleep(0)

    x = np.ones((1, 3, 8, 8), np.float32)
    try:
        asyncio.run_coroutine_threadsafe(block(), door._loop)
        assert blocking.wait(REACT_S)

        async def lag() -> float:
            return core.lag_s()

        deadline = time.monotonic() + REACT_S
        while asyncio.run_coroutine_threadsafe(lag(), door._loop).result(REACT_S) <= 0.5:  # three late ticks
            assert time.monotonic() < deadline, "the front door's loop never fell behind"
        with httpclient.InferenceServerClient(door.http_url.removeprefix("http://"), network_timeout=REACT_S) as h:
            t = httpclient.InferInput("input", list(x.shape), "FP32")
            t.set_data_from_numpy(x, binary_data=True)
            with pytest.raises(InferenceServerException) as e:
                h.infer(APP.name, [t])
            assert e.value.status() == "503" and "front door overloaded" in str(e.value)
        with grpcclient.InferenceServerClient(door.grpc_target) as g:  # type: ignore[arg-type]
            t = grpcclient.InferInput("input", list(x.shape), "FP32")
            t.set_data_from_numpy(x)
            with pytest.raises(InferenceServerException) as e:
                g.infer(APP.name, [t], client_timeout=REACT_S)
            assert e.value.status() == "StatusCode.UNAVAILABLE" and "front door overloaded" in str(e.value)
        assert core.shed == {APP.name: 2}
        assert pool.pool.consumer(0).depth() == 0  # nothing shed reached the node
        assert core.stats[APP.name].totals().oip["statuses"] == {"SHED": 2}
        stop.set()
        deadline = time.monotonic() + REACT_S
        while asyncio.run_coroutine_threadsafe(lag(), door._loop).result(REACT_S) >= 0.5:
            assert time.monotonic() < deadline, "the front door's loop never caught up"
            time.sleep(0.01)
        # Caught up: the next inference is placed (nobody consumes, so it waits in the queue).
        out: list[BaseException | None] = []
        caller = threading.Thread(target=_call_http, args=(door.http_url, x, out))
        caller.start()
        pool.held(1)
        assert core.shed == {APP.name: 2}
    finally:
        stop.set()
        door.close()
    caller.join(REACT_S)
    assert not caller.is_alive() and out and out[0] is not None  # closed with its row in flight: an error
