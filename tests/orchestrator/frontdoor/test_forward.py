"""A front door forwards requests for apps its node does not host to their owner, by a fleet's routing
table (orchestrator/frontdoor/forward.py): the owner's answer comes back, a silent owner is failed over
to the standby, and what the table does not route is refused as before."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from apps.zoo import build_model
from gpuprims.client import Result
from gpuprims.wire import Status
from orchestrator.config.schema import ConfigError, load_config, parse_config
from orchestrator.fleet.plan import Assignment, Slot, route_table
from orchestrator.fleet.routes import RoutesServer
from orchestrator.frontdoor import start_frontdoor
from orchestrator.frontdoor.core import Core, OipError
from orchestrator.frontdoor.forward import Forwarder, model_info_from_route, route_model
from orchestrator.frontdoor.models import model_info
from orchestrator.frontdoor.transport import Marks
from orchestrator.node.node import Node
from tests.loopnode import LoopNode
from tests.modelfiles import multi_inputs, multi_io_onnx, run_onnx
from tests.orchestrator.frontdoor.conftest import APPS, direct, inputs

CLASSIFY = APPS[0]
ENTRY = {"name": CLASSIFY.name, "model": CLASSIFY.model, "input_shape": list(CLASSIFY.input_shape),
         "dtype": CLASSIFY.dtype, "num_classes": CLASSIFY.num_classes, "slo_ms": CLASSIFY.slo_ms,
         "max_batch": CLASSIFY.max_batch, "max_wait_ms": CLASSIFY.max_wait_ms}


class Routes:
    """A fleet agent's routes server (the agents' own class) serving ``table``, which a test may change."""

    def __init__(self) -> None:
        self.table: dict[str, Any] = {"version": 0, "apps": {}}
        self.server = RoutesServer(lambda: self.table)
        self.url = self.server.url

    def route(self, version: int, primary: tuple[str, int], standby: tuple[str, int] | None) -> None:
        def target(a: tuple[str, int] | None) -> dict[str, Any] | None:
            return None if a is None else {"host": a[0], "udp_port": a[1], "http_port": 0, "node": f"n{a[1]}",
                                           "gpu": 0}

        self.table = {"version": version, "apps": {CLASSIFY.name: {
            "app_id": CLASSIFY.app_id, "slo_ms": CLASSIFY.slo_ms, "primary": target(primary),
            "standby": target(standby), "model": route_model(ENTRY)}}}

    def close(self) -> None:
        self.server.close()


@pytest.fixture(scope="module")
def owner() -> Iterator[tuple[LoopNode, torch.nn.Module]]:
    """The node that hosts `classify` (a real ingest and pool and a thread running the zoo model)."""
    from tests.loopnode import LoopApp

    assert CLASSIFY.model is not None
    model = build_model(CLASSIFY.model, seed=CLASSIFY.seed, num_classes=CLASSIFY.num_classes,
                        input_shape=CLASSIFY.input_shape)
    node = LoopNode({CLASSIFY.app_id: LoopApp(CLASSIFY.input_shape, CLASSIFY.dtype,
                                              lambda x: direct(model, CLASSIFY, x))})
    try:
        yield node, model
    finally:
        node.close()


@pytest.fixture
def routes() -> Iterator[Routes]:
    r = Routes()
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def silent() -> Iterator[tuple[str, int]]:
    """A UDP port that takes datagrams and never answers: an owner that went silent."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    try:
        yield s.getsockname()
    finally:
        s.close()


def _door(routes: Routes) -> Any:
    # No app of its own: everything it serves is forwarded. Its own UDP target is never used.
    return start_frontdoor([], ("127.0.0.1", 9), http_port=0, grpc_port=0, timeout_s=10, fleet_routes=[routes.url])


def _until(cond: Any, what: str, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(0.02)


@pytest.mark.slow
def test_a_request_for_an_app_elsewhere_is_answered_by_its_owner_over_http_and_grpc(
        owner: tuple[LoopNode, torch.nn.Module], routes: Routes) -> None:
    node, model = owner
    routes.route(1, node.address, None)
    door = _door(routes)
    try:
        host = door.http_url.removeprefix("http://")
        with httpclient.InferenceServerClient(host) as c:
            assert c.is_model_ready(CLASSIFY.name)
            meta = c.get_model_metadata(CLASSIFY.name)
            assert meta["inputs"][0]["shape"] == [-1, *CLASSIFY.input_shape]
            assert meta["outputs"][0]["shape"] == [-1, CLASSIFY.num_classes]
            x = inputs(CLASSIFY.name, 3, seed=1)
            i = httpclient.InferInput("input", list(x.shape), "FP32")
            i.set_data_from_numpy(x, binary_data=True)
            out = c.infer(CLASSIFY.name, [i]).as_numpy("logits")
            np.testing.assert_allclose(out, direct(model, CLASSIFY, x), rtol=1e-5, atol=1e-5)
            stats = c.get_inference_statistics(CLASSIFY.name)["model_stats"][0]
            assert int(stats["inference_count"]) == 3
            # the node serves no model of its own: its index is empty, the forwarded app is not listed
            assert c.get_model_repository_index() == []
        with grpcclient.InferenceServerClient(door.grpc_target) as g:
            x = inputs(CLASSIFY.name, 2, seed=2)
            gi = grpcclient.InferInput("input", list(x.shape), "FP32")
            gi.set_data_from_numpy(x)
            out = g.infer(CLASSIFY.name, [gi]).as_numpy("logits")
            np.testing.assert_allclose(out, direct(model, CLASSIFY, x), rtol=1e-5, atol=1e-5)
        fwd = door.core.forwarder
        assert fwd is not None and fwd.forwarded == 5 and fwd.failovers == 0
    finally:
        door.close()


@pytest.mark.slow
def test_a_silent_owner_is_failed_over_to_the_standby_and_each_request_answered_once(
        owner: tuple[LoopNode, torch.nn.Module], routes: Routes, silent: tuple[str, int]) -> None:
    node, model = owner
    routes.route(1, silent, node.address)
    door = _door(routes)
    try:
        host = door.http_url.removeprefix("http://")
        x = inputs(CLASSIFY.name, 4, seed=3)
        with httpclient.InferenceServerClient(host, network_timeout=30) as c:
            outs = []
            for k in range(4):
                i = httpclient.InferInput("input", [1, *CLASSIFY.input_shape], "FP32")
                i.set_data_from_numpy(x[k:k + 1], binary_data=True)
                outs.append(c.infer(CLASSIFY.name, [i]).as_numpy("logits"))
        np.testing.assert_allclose(np.concatenate(outs), direct(model, CLASSIFY, x), rtol=1e-5, atol=1e-5)
        fwd = door.core.forwarder
        assert fwd is not None and fwd.forwarded == 4 and fwd.failovers == 4
    finally:
        door.close()


@pytest.mark.slow
def test_the_table_is_followed_when_the_app_moves(owner: tuple[LoopNode, torch.nn.Module], routes: Routes,
                                                  silent: tuple[str, int]) -> None:
    node, model = owner
    routes.route(1, silent, None)  # routed to a dead owner with no standby
    door = _door(routes)
    try:
        host = door.http_url.removeprefix("http://")
        x = inputs(CLASSIFY.name, 1, seed=4)
        i = httpclient.InferInput("input", list(x.shape), "FP32")
        i.set_data_from_numpy(x, binary_data=True)
        routes.route(2, node.address, None)  # the controller moved it; the refresher picks it up
        fwd = door.core.forwarder
        assert fwd is not None
        _until(lambda: int(fwd.table.get("version", 0)) == 2, "the new table")
        with httpclient.InferenceServerClient(host) as c:
            out = c.infer(CLASSIFY.name, [i]).as_numpy("logits")
        np.testing.assert_allclose(out, direct(model, CLASSIFY, x), rtol=1e-5, atol=1e-5)
    finally:
        door.close()


def test_what_the_table_does_not_route_and_bad_input_are_refused_before_anything_is_sent(routes: Routes,
                                                                                        silent: tuple[str, int]) -> None:
    routes.route(1, silent, None)
    door = _door(routes)
    try:
        host = door.http_url.removeprefix("http://")
        with httpclient.InferenceServerClient(host) as c:
            x = np.zeros((1, *CLASSIFY.input_shape), np.float32)
            i = httpclient.InferInput("input", list(x.shape), "FP32")
            i.set_data_from_numpy(x, binary_data=True)
            with pytest.raises(InferenceServerException, match="nor in the fleet's routing table") as e:
                c.infer("elsewhere", [i])
            assert e.value.status() == "404"
            bad = httpclient.InferInput("input", [1, 3, 8, 8], "FP32")
            bad.set_data_from_numpy(np.zeros((1, 3, 8, 8), np.float32), binary_data=True)
            with pytest.raises(InferenceServerException, match="shape") as e:
                c.infer(CLASSIFY.name, [bad])
            assert e.value.status() == "400"
        fwd = door.core.forwarder
        assert fwd is not None and fwd.forwarded == 0
    finally:
        door.close()


def test_a_routed_model_larger_than_any_at_the_start_passes_grpcs_limit(owner: tuple[LoopNode, torch.nn.Module],
                                                                       routes: Routes) -> None:
    """gRPC fixes its receive limit at start, when the door has no model: a routed model's full batch
    (8 x 3x224x224 float32, 4.8 MB, above gRPC's 4 MiB default) still reaches its own checks and the owner."""
    node, _ = owner
    big = {**ENTRY, "name": "big", "input_shape": [3, 224, 224], "max_batch": 8}
    target = {"host": node.address[0], "udp_port": node.address[1], "http_port": 0, "node": "o", "gpu": 0}
    # routed as app 1, whose rows at the owner are 3x32x32: the owner refuses these rows as BAD_REQUEST
    routes.table = {"version": 1, "apps": {"big": {"app_id": CLASSIFY.app_id, "slo_ms": 500, "primary": target,
                                                   "standby": None, "model": route_model(big)}}}
    door = _door(routes)
    try:
        x = np.zeros((8, 3, 224, 224), np.float32)
        with grpcclient.InferenceServerClient(door.grpc_target) as g:
            gi = grpcclient.InferInput("input", list(x.shape), "FP32")
            gi.set_data_from_numpy(x)
            with pytest.raises(InferenceServerException) as e:
                g.infer("big", [gi], client_timeout=30)
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and "BAD_REQUEST" in e.value.message()
        fwd = door.core.forwarder
        assert fwd is not None and fwd.forwarded == 8
    finally:
        door.close()


def test_a_front_door_whose_seeds_do_not_answer_starts_and_refuses_unknown_models() -> None:
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{dead.getsockname()[1]}"  # bound, not listening: connection refused
    try:
        door = start_frontdoor([], ("127.0.0.1", 9), http_port=0, grpc_port=None, fleet_routes=[url])
        try:
            with httpclient.InferenceServerClient(door.http_url.removeprefix("http://")) as c:
                assert c.is_server_live()
                with pytest.raises(InferenceServerException, match="nor in the fleet's routing table"):
                    c.get_model_metadata(CLASSIFY.name)
            fwd = door.core.forwarder
            assert fwd is not None and fwd.fetch_errors >= 1 and fwd.table["version"] == -1
        finally:
            door.close()
    finally:
        dead.close()


class _Local:
    """A transport stand-in that answers every row OK with a marker, to see which way a row went."""

    name = "local"

    def __init__(self) -> None:
        self.rows_seen = 0

    async def rows(self, app_id: int, x: np.ndarray, *, deadline_us: int, timeout_s: float,
                   marks: Marks) -> list[Result]:
        self.rows_seen += len(x)
        return [Result(app_id, 1, Status.OK, np.full(2, 7.0, np.float32), 0.1, 1) for _ in x]

    def close(self) -> None:
        pass


def test_a_model_the_node_hosts_is_never_forwarded_whatever_the_table_says() -> None:
    local = _Local()
    fwd = Forwarder(["http://127.0.0.1:9"])
    info = model_info(CLASSIFY)
    route = {"app_id": 9, "primary": {"host": "127.0.0.1", "udp_port": 9}, "standby": None,
             "model": route_model(ENTRY)}
    fwd.table = {"version": 1, "apps": {CLASSIFY.name: route, "other": {**route, "app_id": 10}}}
    fwd.infos = {n: i for n, r in fwd.table["apps"].items() if (i := model_info_from_route(n, r)) is not None}
    core = Core([info], local, forwarder=fwd, shed_lag_fraction=None)
    assert core.model(CLASSIFY.name) is info and not core.forwarded(info)
    out = asyncio.run(core.infer(info, np.zeros((2, *CLASSIFY.input_shape), np.float32)))
    assert local.rows_seen == 2 and out.shape == (2, 2) and fwd.forwarded == 0
    other = core.model("other")
    assert other.app_id == 10 and core.forwarded(other) and core.model_ready("other")
    with pytest.raises(OipError, match="no version"):
        core.model("other", "2")
    # The table stops routing it between the lookup and the send: unavailable (503), not a timeout.
    del fwd.table["apps"]["other"]
    with pytest.raises(OipError, match="UNKNOWN_APP") as e:
        asyncio.run(core.infer(other, np.zeros((1, *CLASSIFY.input_shape), np.float32)))
    assert e.value.kind == "unavailable" and fwd.forwarded == 0


def test_the_routing_table_carries_what_a_front_door_needs_to_take_the_app() -> None:
    slot = Slot(node="n1", gpu=0, gpu_pct=50)
    table = route_table(3, {"a": Assignment(app="a", primary=slot, standby=None)}, {}, {"a": 4},
                        {"n1": {"host": "10.0.0.1", "udp_port": 9100, "http_port": 8000}},
                        models={"a": route_model(ENTRY)})
    info = model_info_from_route("a", table["apps"]["a"])
    assert info is not None and info.app_id == 4 and info.input_shape == CLASSIFY.input_shape
    assert info.output_dim == CLASSIFY.num_classes and info.max_batch == CLASSIFY.max_batch
    assert info.slo_ms == CLASSIFY.slo_ms and info.dtype == "float32"
    # defaults as the node applies them; a user model's output size is not known without building it
    m = route_model({"name": "u", "model": "apps.zoo:tiny_cnn", "slo_ms": 50})
    assert m["input_shape"] == [3, 224, 224] and m["max_batch"] == 8 and m["output_dim"] == -1
    assert model_info_from_route("a", {"app_id": 4}) is None  # an older controller's table: not forwarded


def test_a_model_file_route_carries_its_config_and_a_bad_one_is_not_forwarded(tmp_path: Any) -> None:
    model = multi_io_onnx(tmp_path / "m.onnx")
    m = route_model({"name": "m", "model": str(model), "slo_ms": 50})
    assert m["file"]["version"] == 1 and m["output_dim"] == -1
    info = model_info_from_route("m", {"app_id": 7, "model": m})
    assert info is not None and info.app_id == 7 and info.signature is not None and info.slo_ms == 50
    assert [t.name for t in info.signature.inputs] == ["image in", "scale.k", "flag"]
    assert info.config()["parameters"]["app_id"]["string_value"] == "7"
    bad = {**m, "file": {"config_json": "not a config", "version": 1}}
    assert model_info_from_route("m", {"app_id": 7, "model": bad}) is None


def test_config_wants_routes_urls_and_a_front_door_to_forward_through() -> None:
    app = {"name": "a", "model": "mobilenet_v2", "slo_ms": 50}
    ok = parse_config({"node": {"http_port": 8000, "fleet_routes": ["http://10.0.0.2:8200"]}, "apps": [app]},
                      source="test")
    assert ok.node.fleet_routes == ("http://10.0.0.2:8200",)
    with pytest.raises(ConfigError, match="fleet_routes"):
        parse_config({"node": {"fleet_routes": ["http://10.0.0.2:8200"]}, "apps": [app]}, source="test")
    with pytest.raises(ConfigError, match="routes URL"):
        parse_config({"node": {"http_port": 8000, "fleet_routes": ["10.0.0.2:8200"]}, "apps": [app]}, source="test")


FILE_NODE = """
node:
  listen: {{host: 127.0.0.1, port: 0}}
  backend: cpu
  run_dir: {run_dir}
  autoscale: false
apps:
  - {{name: multi, model: {model}, slo_ms: 5000}}
"""


@pytest.mark.slow
def test_a_model_file_elsewhere_is_answered_by_its_owner_with_every_tensor(routes: Routes, tmp_path: Any) -> None:
    """A multi-tensor model file hosted by a real node (the owner) is served through a front door that hosts
    nothing: its route carries the file's config, a request of three named inputs goes over the wire as
    multi-tensor bodies, and the four named outputs come back as the file computes them (HTTP and gRPC)."""
    model = multi_io_onnx(tmp_path / "multi.onnx")
    p = tmp_path / "apps.yaml"
    p.write_text(FILE_NODE.format(run_dir=tmp_path / "run", model=model))
    node = Node(load_config(p), warmup=False, heartbeat_ms=100).start()
    loop = threading.Thread(target=node.serve, name="owner", daemon=True)
    loop.start()
    door = None
    try:
        app = node.cfg.app_by_name("multi")
        assert node.ingest is not None and app.file is not None
        target = {"host": "127.0.0.1", "udp_port": node.ingest.ports[0], "http_port": 0, "node": "owner", "gpu": 0}
        routes.table = {"version": 1, "apps": {"multi": {
            "app_id": app.app_id, "slo_ms": app.slo_ms, "primary": target, "standby": None,
            "model": route_model({"name": "multi", "model": str(model), "slo_ms": 5000})}}}
        door = _door(routes)
        host = door.http_url.removeprefix("http://")
        x = multi_inputs(3, 5, seed=4)
        want = run_onnx(model, x)
        with httpclient.InferenceServerClient(host) as c:
            _until(lambda: c.is_model_ready("multi"), "the route")
            meta = c.get_model_metadata("multi")
            assert [t["name"] for t in meta["inputs"]] == ["image in", "scale.k", "flag"]
            ins = []
            for name, arr in x.items():
                t = httpclient.InferInput(name, list(arr.shape), {"float32": "FP32", "int64": "INT64",
                                                                 "bool": "BOOL"}[arr.dtype.name])
                t.set_data_from_numpy(arr, binary_data=True)
                ins.append(t)
            r = c.infer("multi", ins)
            for k, v in want.items():
                np.testing.assert_allclose(r.as_numpy(k), v, rtol=1e-3, atol=1e-3)
        with grpcclient.InferenceServerClient(door.grpc_target) as g:
            gins = []
            for name, arr in x.items():
                t = grpcclient.InferInput(name, list(arr.shape), {"float32": "FP32", "int64": "INT64",
                                                                 "bool": "BOOL"}[arr.dtype.name])
                t.set_data_from_numpy(arr)
                gins.append(t)
            gr = g.infer("multi", gins)
            for k, v in want.items():
                np.testing.assert_allclose(gr.as_numpy(k), v, rtol=1e-3, atol=1e-3)
        fwd = door.core.forwarder
        assert fwd is not None and fwd.forwarded == 6 and fwd.failovers == 0
    finally:
        if door is not None:
            door.close()
        node.request_stop()
        loop.join(timeout=60)
        node.stop()
