from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from apps.zoo import build_model
from gpuprims.gather import preprocess
from gpuprims.ingest import Ingest
from orchestrator.config.schema import AppConfig
from orchestrator.frontdoor import FrontDoor, start_frontdoor
from tests.loopnode import LoopApp, LoopNode

# Two small apps like examples/apps.yaml's (float32 and uint8 frames), 10 classes to keep answers short.
APPS = [
    AppConfig(name="classify", model="mobilenet_v2", input_shape=(3, 32, 32), dtype="float32", num_classes=10,
              slo_ms=500, max_batch=4, max_wait_ms=5, app_id=1),
    AppConfig(name="detect", model="resnet18", input_shape=(3, 32, 32), dtype="uint8", num_classes=10,
              slo_ms=500, max_batch=4, max_wait_ms=5, app_id=2),
]


def torch_model(app: AppConfig) -> torch.nn.Module:
    assert app.model is not None
    return build_model(app.model, seed=app.seed, num_classes=app.num_classes, input_shape=app.input_shape)


def direct(model: torch.nn.Module, app: AppConfig, x: np.ndarray) -> np.ndarray:
    """The oracle: the same model on the same input, straight in torch (as the instance preprocesses)."""
    with torch.inference_mode():
        return model(preprocess(torch.from_numpy(np.ascontiguousarray(x)), app.dtype)).numpy()


@dataclass
class Stack:
    node: LoopNode
    door: FrontDoor
    models: dict[str, torch.nn.Module]
    via: str  # the front door's transport: "pool" (the node's: Ingest.submit) or "udp" (datagrams)

    @property
    def ingest(self) -> Ingest | None:
        """What start_frontdoor needs for this stack's transport."""
        return self.node.ingest if self.via == "pool" else None

    def expect(self, name: str, x: np.ndarray) -> np.ndarray:
        app = next(a for a in APPS if a.name == name)
        return direct(self.models[name], app, x)


def inputs(name: str, n: int, seed: int = 0) -> np.ndarray:
    app = next(a for a in APPS if a.name == name)
    rng = np.random.default_rng(seed)
    if app.dtype == "uint8":
        return rng.integers(0, 256, (n, *app.input_shape), dtype=np.uint8)
    return rng.standard_normal((n, *app.input_shape)).astype(np.float32)


@pytest.fixture(autouse=True)
def _collect_clients_here() -> Iterator[None]:
    # tritonclient's HTTP client closes its gevent pool again in __del__, which gevent refuses from
    # any thread but the one that made it: collect the test's dropped clients in this thread.
    yield
    gc.collect()


def _runner(model: torch.nn.Module, app: AppConfig) -> Callable[[np.ndarray], np.ndarray]:
    return lambda x: direct(model, app, x)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[LoopNode, dict[str, torch.nn.Module]]]:
    """Real ingest + pool + a serving thread running the zoo models."""
    models = {a.name: torch_model(a) for a in APPS}
    loop_apps = {a.app_id: LoopApp(a.input_shape, a.dtype, _runner(models[a.name], a)) for a in APPS}
    node = LoopNode(loop_apps)
    try:
        yield node, models
    finally:
        node.close()


@pytest.fixture(scope="module", params=["pool", "udp"])
def stack(request: pytest.FixtureRequest, served: tuple[LoopNode, dict[str, torch.nn.Module]]) -> Iterator[Stack]:
    """The front door before the served node, over each transport: rows placed into the node's pool
    (what the node runs) or sent to its UDP ingest as datagrams."""
    node, models = served
    ingest = node.ingest if request.param == "pool" else None
    door = start_frontdoor(APPS, node.address, http_port=0, grpc_port=0, timeout_s=10, ingest=ingest)
    try:
        yield Stack(node, door, models, request.param)
    finally:
        door.close()
