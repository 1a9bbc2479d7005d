"""Admission at the front door: prediction, queue policy, priority levels, bad parameters, counts.

The node is a stand-in (`HeldTransport`) that holds every row until the test releases it, and the
batch-latency model is seeded, so what is admitted is decided by the queue alone, not by timing.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
import pytest
import yaml
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from gpuprims.client import Result
from gpuprims.modelrepo.config import QueuePolicy, TimeoutAction
from gpuprims.wire import DType, Status
from orchestrator.config.schema import ConfigError, load_config, parse_config
from orchestrator.control.records import AppView, InstanceStats, NodeView
from orchestrator.control.stats import AppStatistics
from orchestrator.frontdoor import oip_pb2 as pb
from orchestrator.frontdoor.admission import (
    Admission,
    ParamError,
    Refused,
    RequestParams,
    grpc_params,
    http_params,
)
from orchestrator.frontdoor.core import Core
from orchestrator.frontdoor.grpc_server import make_server
from orchestrator.frontdoor.http_server import make_app
from orchestrator.frontdoor.models import ModelInfo, model_info
from orchestrator.frontdoor.policy import AdmissionPolicy, admission_policy
from orchestrator.frontdoor.transport import Marks
from orchestrator.node.metrics import _Collector

from ...modelfiles import multi_io_onnx

SLO_MS = 100.0
#: Seeded batch latencies: a batch of 1 takes 10 ms, of 8 (max_batch) 20 ms. With SLO 100 ms a request
#: is predicted in time while at most 32 rows are ahead (4 rounds of 20 ms + its own 10 ms = 90 ms);
#: the low level of two (half the deadline, 50 ms) while at most 16 are (2 x 20 + 10).
SEED = {1: 10.0, 8: 20.0}
HIGH_ROOM, LOW_ROOM = 33, 17  # requests admitted with nothing answered, at each level
WAIT_S = 30.0


def _info(policy: AdmissionPolicy | None = None, name: str = "m") -> ModelInfo:
    return ModelInfo(name=name, app_id=1, input_shape=(2,), dtype="float32", output_dim=2, max_batch=8,
                     max_wait_ms=1.0, slo_ms=SLO_MS, instances=1, admission=policy or AdmissionPolicy())


LEVELS = AdmissionPolicy(priority_levels=2, default_priority_level=2)


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


def _core(info: ModelInfo) -> tuple[Core, HeldTransport]:
    transport = HeldTransport()
    core = Core([info], transport, shed_lag_fraction=None)
    core.admission.seed(info, SEED)
    return core, transport


async def _until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def _admission_counts(core: Core, app: str = "m") -> dict[str, Any]:
    return core.stats[app].totals().oip["admission"]


def _answered(core: Core, app: str = "m") -> int:
    adm = _admission_counts(core, app)
    return sum(adm["admitted"].values()) + sum(n for by in adm["refused"].values() for n in by.values())


# --- the prediction and the policy, without a server -------------------------------------------------


def test_prediction_counts_rounds_of_the_largest_measured_batch() -> None:
    adm = Admission()
    info = _info()
    assert adm.predict_ms(info, 5) is None  # nothing learnt: no prediction, so nothing refused on one
    adm.seed(info, SEED)
    assert adm.predict_ms(info, 0) == 10.0
    assert adm.predict_ms(info, 8) == 30.0 and adm.predict_ms(info, 9) == 50.0 and adm.predict_ms(info, 32) == 90.0
    small = Admission()
    small.seed(info, {1: 10.0})  # only batches of 1 seen: a larger one counts as one of them, not as 8 x 10 ms
    assert small.predict_ms(info, 8) == 20.0 and small.predict_ms(info, 9) == 30.0


def test_the_model_is_learnt_from_heartbeats() -> None:
    now = [0.0]
    adm = Admission(clock=lambda: now[0])
    info = _info()
    stats = AppStatistics()
    stats.beat("i0", InstanceStats(batches=10, ok=40, errors=0, busy_ms=100.0, held=0), now_s=0.0)
    adm.decide(info, RequestParams(), stats)  # first look: nothing to compare with yet
    assert adm.predict_ms(info, 0) is None
    now[0] = 1.0
    stats.beat("i0", InstanceStats(batches=20, ok=120, errors=0, busy_ms=250.0, held=24), now_s=1.0)
    adm.decide(info, RequestParams(), stats)  # 10 batches of 8 rows in 150 ms: 15 ms a batch of 8
    assert adm.predict_ms(info, 0) == 15.0
    # The instances hold 24 (the heartbeat's count) though this door has none in flight: 3 rounds ahead.
    adm.decide(info, RequestParams(), stats)
    assert adm.predict_ms(info, 24) == 60.0


def test_priority_outside_the_levels_is_a_parameter_error() -> None:
    adm = Admission()
    info = _info(LEVELS)
    assert adm.decide(info, RequestParams(priority=0)).level == 2  # the default level
    assert adm.decide(info, RequestParams(priority=1)).level == 1
    with pytest.raises(ParamError, match=r"outside this model's levels 1\.\.2"):
        adm.decide(info, RequestParams(priority=3))
    assert adm.decide(_info(), RequestParams(priority=7)).level == 1  # no levels: one level for all


@pytest.mark.parametrize(("params", "fragment"), [
    ({"timeout": "100"}, "'timeout' must be an integer"),
    ({"timeout": 1.5}, "'timeout' must be an integer"),
    ({"timeout": True}, "'timeout' must be an integer"),
    ({"timeout": -1}, "'timeout' must be microseconds"),
    ({"timeout": 2**32}, "'timeout' must be microseconds"),
    ({"priority": "high"}, "'priority' must be an integer"),
    ({"priority": -2}, "'priority' must be >= 0"),
])
def test_bad_http_parameters(params: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ParamError, match=fragment):
        http_params({"inputs": [], "parameters": params})
    with pytest.raises(ParamError, match="'parameters' must be an object"):
        http_params({"parameters": [1]})


def test_grpc_parameters() -> None:
    req = pb.ModelInferRequest(model_name="m")
    req.inputs.add(name="input", datatype="FP32", shape=[3, 2])
    req.parameters["priority"].uint64_param = 1  # tritonclient's grpc client sets priority this way
    req.parameters["timeout"].int64_param = 5000
    assert grpc_params(req) == RequestParams(priority=1, timeout_us=5000, rows=3)
    assert grpc_params(req, left_us=2000).timeout_us == 2000  # the call's own deadline bounds it
    req.parameters["timeout"].string_param = "5000"
    with pytest.raises(ParamError, match="'timeout' must be an integer"):
        grpc_params(req)


def test_deadline_follows_trions_queue_policy_rules() -> None:
    plain = AdmissionPolicy()
    assert plain.deadline_us(0, 100.0) == 100_000 and plain.deadline_us(5000, 100.0) == 5000
    fixed = AdmissionPolicy(QueuePolicy(default_timeout_us=20_000))
    assert fixed.deadline_us(5000, 100.0) == 20_000  # no override allowed: the default holds
    shorter = AdmissionPolicy(QueuePolicy(default_timeout_us=20_000, allow_timeout_override=True))
    assert shorter.deadline_us(5000, 100.0) == 5000 and shorter.deadline_us(90_000, 100.0) == 20_000
    assert Admission.node_deadline_us(_info(fixed), 5000) == 20_000
    assert Admission.node_deadline_us(_info(), 5000) == 5000


def test_queue_full_and_delay() -> None:
    async def run() -> None:
        adm = Admission()
        bounded = _info(AdmissionPolicy(QueuePolicy(max_queue_size=2), refuse_status=429))
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        held = [asyncio.ensure_future(adm.track(bounded, 1, gate)) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(Refused) as e:
            adm.decide(bounded, RequestParams())
        assert e.value.reason == "queue_full" and e.value.http_status == 429
        assert e.value.headers == {"Retry-After": "1"}
        delay = _info(AdmissionPolicy(QueuePolicy(timeout_action=TimeoutAction.DELAY)), name="d")
        adm.seed(delay, SEED)
        late = [asyncio.ensure_future(adm.track(delay, 1, gate)) for _ in range(100)]
        await asyncio.sleep(0)
        ticket = adm.decide(delay, RequestParams())  # predicted far past its deadline, admitted anyway
        assert ticket.predicted_ms is not None and ticket.predicted_ms > SLO_MS
        gate.set_result(None)
        await asyncio.gather(*held, *late)
        assert adm.outstanding(bounded) == 0 and adm.outstanding(delay) == 0

    asyncio.run(run())


# --- HTTP and gRPC, with the node held --------------------------------------------------------------


async def _serve_http(core: Core) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(make_app(core), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def _http_body(i: int, **params: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"id": str(i), "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 2],
                                                      "data": [float(i), 0.0]}]}
    if params:
        body["parameters"] = params
    return body


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], str]:
    async with session.post(f"{url}/v2/models/m/infer", json=body) as r:
        return r.status, await r.json(), r.headers.get("Retry-After", "")


def test_http_overload_admits_high_priority_and_refuses_low_every_request_answered_once() -> None:
    info = _info(LEVELS)
    core, transport = _core(info)

    async def run() -> None:
        runner, url = await _serve_http(core)
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
                low = [asyncio.ensure_future(_post(s, url, _http_body(i))) for i in range(30)]  # default: level 2
                await _until(lambda: _answered(core) == 30, "every low request admitted or refused")
                assert core.admission.outstanding(info) == LOW_ROOM
                high = [asyncio.ensure_future(_post(s, url, _http_body(100 + i, priority=1))) for i in range(10)]
                await _until(lambda: _answered(core) == 40, "every high request admitted or refused")
                transport.release()
                answers = await asyncio.gather(*low, *high)
        finally:
            await runner.cleanup()
        ids = Counter(body.get("id") or body["error"] for _, body, _ in answers)
        ok = {body["id"]: status for status, body, _ in answers if status == 200}
        refused = [(status, after) for status, body, after in answers if status != 200]
        assert len(answers) == 40 and sum(ids.values()) == 40
        assert all(str(100 + i) in ok for i in range(10))  # every high-priority request admitted and served
        assert len(ok) == LOW_ROOM + 10 and len(refused) == 30 - LOW_ROOM
        assert all(status == 503 and after.isdigit() and int(after) >= 1 for status, after in refused)
        assert len(set(ok)) == len(ok)  # each served id answered once
        for status, body, _ in answers:
            if status == 200:
                assert body["outputs"][0]["data"][0] == float(body["id"])  # its own answer
            else:
                assert "refused at admission" in body["error"] and "priority level 2" in body["error"]
        adm = _admission_counts(core)
        assert adm == {"admitted": {"1": 10, "2": LOW_ROOM}, "refused": {"2": {"predicted_late": 30 - LOW_ROOM}}}
        assert core.admission.outstanding(info) == 0

    asyncio.run(run())


@pytest.mark.slow
def test_http_flood_without_deadlines_is_refused_at_once_and_answered_once() -> None:
    info = _info()
    core, transport = _core(info)
    n = 200

    async def run() -> None:
        runner, url = await _serve_http(core)
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
                flood = [asyncio.ensure_future(_post(s, url, _http_body(i))) for i in range(n)]
                await _until(lambda: _answered(core) == n, "the flood admitted or refused")
                # The refused are answered while the admitted are still held: refusal does not wait on the node.
                await _until(lambda: sum(f.done() for f in flood) == n - HIGH_ROOM, "the refusals answered")
                await asyncio.sleep(0.05)
                assert sum(f.done() for f in flood) == n - HIGH_ROOM  # the admitted wait for the node
                transport.release()
                answers = await asyncio.gather(*flood)
        finally:
            await runner.cleanup()
        statuses = Counter(status for status, _, _ in answers)
        assert statuses == {200: HIGH_ROOM, 503: n - HIGH_ROOM}
        assert sorted(int(b["id"]) for st, b, _ in answers if st == 200) == sorted(
            {int(b["id"]) for st, b, _ in answers if st == 200})
        assert core.stats["m"].totals().oip["statuses"].get("REFUSED") == n - HIGH_ROOM

    asyncio.run(run())


def test_http_bad_parameters_are_400_and_a_client_gone_mid_request_frees_its_place() -> None:
    info = _info(LEVELS)
    core, transport = _core(info)

    async def run() -> None:
        runner, url = await _serve_http(core)
        try:
            async with aiohttp.ClientSession() as s:
                for params, fragment in (({"priority": 3}, "outside this model's levels"),
                                         ({"timeout": "soon"}, "'timeout' must be an integer")):
                    status, body, _ = await _post(s, url, _http_body(1, **params))
                    assert status == 400 and fragment in body["error"]
            gone = aiohttp.ClientSession()
            call = asyncio.ensure_future(_post(gone, url, _http_body(2)))
            await _until(lambda: core.admission.outstanding(info) == 1, "the request in flight")
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
            await gone.close()  # the client hangs up while the node holds its row
            transport.release()
            await _until(lambda: core.admission.outstanding(info) == 0, "its place freed")
            async with aiohttp.ClientSession() as s:  # the door serves on
                fut = asyncio.ensure_future(_post(s, url, _http_body(3, priority=1)))
                await _until(lambda: core.admission.outstanding(info) == 1, "the next request in flight")
                transport.release()
                status, body, _ = await fut
                assert status == 200 and body["id"] == "3"
        finally:
            await runner.cleanup()

    asyncio.run(run())


def _grpc_request(i: int, priority: int | None = None) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="m", id=str(i))
    req.inputs.add(name="input", datatype="FP32", shape=[1, 2])
    req.raw_input_contents.append(np.array([i, 0], "<f4").tobytes())
    if priority is not None:
        req.parameters["priority"].int64_param = priority
    return req


def test_grpc_overload_refuses_low_priority_unavailable_and_bad_priority_invalid() -> None:
    info = _info(LEVELS)
    core, transport = _core(info)

    async def run() -> None:
        server = make_server(core)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                infer = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                       request_serializer=pb.ModelInferRequest.SerializeToString,
                                       response_deserializer=pb.ModelInferResponse.FromString)

                async def call(req: pb.ModelInferRequest) -> tuple[str, grpc.StatusCode]:
                    try:  # no call deadline: a call's own deadline would be its timeout (30 s admits all)
                        resp = await infer(req)
                        return resp.id, grpc.StatusCode.OK
                    except grpc.aio.AioRpcError as e:
                        if e.code() == grpc.StatusCode.UNAVAILABLE:
                            assert dict(e.trailing_metadata() or ()).get("retry-after") == "1"
                        return req.id, e.code()

                assert (await call(_grpc_request(0, priority=5)))[1] == grpc.StatusCode.INVALID_ARGUMENT
                low = [asyncio.ensure_future(call(_grpc_request(i))) for i in range(1, 21)]
                await _until(lambda: _answered(core) == 20, "every low call admitted or refused")
                high = [asyncio.ensure_future(call(_grpc_request(100 + i, priority=1))) for i in range(5)]
                await _until(lambda: _answered(core) == 25, "every high call admitted or refused")
                transport.release()
                answers = await asyncio.gather(*low, *high)
        finally:
            await server.stop(grace=None)
        assert Counter(i for i, _ in answers) == Counter(str(i) for i in [*range(1, 21), *range(100, 105)])
        codes = Counter(code for _, code in answers)
        assert codes == {grpc.StatusCode.OK: LOW_ROOM + 5, grpc.StatusCode.UNAVAILABLE: 20 - LOW_ROOM}
        assert all(code == grpc.StatusCode.OK for i, code in answers if int(i) >= 100)

    asyncio.run(run())


# --- configuration and metrics ------------------------------------------------------------------------


def test_apps_yaml_admission_section(tmp_path: Path) -> None:
    p = tmp_path / "apps.yaml"
    app = {"name": "a", "model": "mobilenet_v2", "slo_ms": 50,
           "admission": {"priority_levels": 3, "default_priority_level": 2, "refuse_status": 429,
                         "default_queue_policy": {"max_queue_size": 16, "default_timeout_microseconds": 40000,
                                                  "timeout_action": "DELAY", "allow_timeout_override": True}}}
    p.write_text(yaml.safe_dump({"apps": [app]}), encoding="utf-8")
    policy = admission_policy(load_config(p).apps[0])
    assert policy == AdmissionPolicy(QueuePolicy(16, 40000, TimeoutAction.DELAY, True), 3, 2, 429)
    assert model_info(load_config(p).apps[0]).admission == policy
    for bad, fragment in (({"priority_levels": 2}, "default_priority_level"),
                          ({"refuse_status": 500}, "refuse_status"),
                          ({"default_queue_policy": {"timeout_action": "DROP"}}, "timeout_action")):
        p.write_text(yaml.safe_dump({"apps": [{**app, "admission": bad}]}), encoding="utf-8")
        with pytest.raises(ConfigError, match=fragment):
            load_config(p)


def test_a_model_files_dynamic_batching_is_its_policy_and_apps_yaml_wins(tmp_path: Path) -> None:
    multi_io_onnx(tmp_path / "multi.onnx")
    dynamic = {"priority_levels": 3, "default_priority_level": 3,
               "default_queue_policy": {"max_queue_size": 5, "default_timeout_microseconds": 7000,
                                        "timeout_action": "DELAY", "allow_timeout_override": True}}
    app = {"name": "multi", "model": "multi.onnx", "slo_ms": 50,
           "config": {"max_batch_size": 4, "dynamic_batching": dynamic}}
    cfg = parse_config({"node": {"backend": "cpu"}, "apps": [app]}, base_dir=tmp_path)
    info = model_info(cfg.app_by_name("multi"))
    assert info.admission == AdmissionPolicy(QueuePolicy(5, 7000, TimeoutAction.DELAY, True), 3, 3)
    assert info.admission.level(0) == 3 and info.admission.delay
    cfg = parse_config({"node": {"backend": "cpu"}, "apps": [{**app, "admission": {"refuse_status": 429}}]},
                       base_dir=tmp_path)
    assert model_info(cfg.app_by_name("multi")).admission == AdmissionPolicy(refuse_status=429)


def test_admission_counts_reach_prometheus() -> None:
    stats = AppStatistics()
    stats.record_admission(1, None)
    stats.record_admission(2, "predicted_late")
    stats.record_admission(2, "predicted_late")
    registry = CollectorRegistry()
    app = AppView(name="a", app_id=1, model="m", slo_ms=SLO_MS, gpu_pct=50, gpu=0, totals=stats.totals())
    registry.register(_Collector(lambda: NodeView(apps={"a": app})))
    text = generate_latest(registry).decode()
    assert 'gpuprims_frontdoor_admitted_total{app="a",level="1"} 1.0' in text
    assert 'gpuprims_frontdoor_refused_total{app="a",level="2",reason="predicted_late"} 2.0' in text
