"""The gRPC front door's message bounds (what a model cannot take is refused with RESOURCE_EXHAUSTED)
and its deadlines (the call's gRPC deadline bounds the node's)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from orchestrator.frontdoor import oip_pb2 as pb
from orchestrator.frontdoor.core import OipError
from orchestrator.frontdoor.grpc_server import (
    CHANGING_MODELS_MESSAGE_BYTES,
    Servicer,
    call_deadline_us,
    max_message_bytes,
)
from orchestrator.frontdoor.models import model_info

from .conftest import APPS, Stack


def _client(stack: Stack) -> grpcclient.InferenceServerClient:
    assert stack.door.grpc_target is not None
    return grpcclient.InferenceServerClient(stack.door.grpc_target)


def _input(x: np.ndarray) -> grpcclient.InferInput:
    t = grpcclient.InferInput("input", list(x.shape), "FP32" if x.dtype == np.float32 else "UINT8")
    t.set_data_from_numpy(x)
    return t


def test_receive_limit_is_the_largest_models_bound() -> None:
    infos = [model_info(a) for a in APPS]
    core = SimpleNamespace(models={m.name: m for m in infos})

    assert max_message_bytes(core) == max(m.max_message_bytes for m in infos)  # type: ignore[arg-type]
    classify, detect = infos
    assert classify.max_message_bytes == 4 * 3 * 32 * 32 * 4 + (64 << 10)
    assert detect.max_message_bytes == 4 * 3 * 32 * 32 * 2 + (64 << 10)  # uint8 as 2-byte varints
    # Models loaded (repository) or routed (a fleet's table) after the start may be larger: the limit
    # the server is made with does not refuse them; each ModelInfer is held to its own model's bound.
    assert max_message_bytes(core, models_change=True) == CHANGING_MODELS_MESSAGE_BYTES  # type: ignore[arg-type]
    assert max_message_bytes(SimpleNamespace(models={}), models_change=False) == 4 << 20  # type: ignore[arg-type]


@pytest.mark.slow
def test_oversized_messages_are_refused_with_resource_exhausted(stack: Stack) -> None:
    big = np.zeros((64, *APPS[0].input_shape), np.float32)  # 3 MB: above every model's bound
    detect = model_info(APPS[1])
    # Within the server's limit (classify's bound) but above detect's: refused by detect's own bound.
    padded_id = "x" * (detect.max_message_bytes + 1000)
    assert len(padded_id) < model_info(APPS[0]).max_message_bytes
    with _client(stack) as g:
        with pytest.raises(InferenceServerException) as e:
            g.infer("classify", [_input(big)])
        assert e.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        with pytest.raises(InferenceServerException) as e:
            g.infer("detect", [_input(np.zeros((1, *APPS[1].input_shape), np.uint8))], request_id=padded_id)
        assert e.value.status() == "StatusCode.RESOURCE_EXHAUSTED" and "'detect'" in e.value.message()
        # The largest valid request (max_batch rows) is still served.
        x = np.ones((APPS[0].max_batch, *APPS[0].input_shape), np.float32)
        out = g.infer("classify", [_input(x)]).as_numpy("logits")
        # With a gRPC deadline (which bounds the node's, call_deadline_us) it is served the same.
        timed = g.infer("classify", [_input(x)], client_timeout=60).as_numpy("logits")
    np.testing.assert_allclose(out, stack.expect("classify", x), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(timed, out, rtol=1e-4, atol=1e-4)


class _Ctx:
    def __init__(self, left_s: float | None) -> None:
        self.left_s = left_s

    def time_remaining(self) -> float | None:
        return self.left_s


class _Core:
    """The Core calls ModelInfer makes, recording the deadline it hands the node."""

    def __init__(self) -> None:
        self.info = model_info(APPS[0])
        self.deadlines: list[int] = []

    def model(self, name: str, version: str = "") -> Any:
        return self.info

    def admit(self, info: Any, params: Any = None) -> None:
        pass

    def check_input(self, info: Any, name: str, datatype: str, shape: list[int]) -> None:
        pass

    async def infer(self, info: Any, x: np.ndarray, *, deadline_us: int = 0, marks: Any = None) -> np.ndarray:
        self.deadlines.append(deadline_us)
        return np.zeros((x.shape[0], 10), np.float32)

    def commit(self, protocol: str, marks: Any) -> None:
        pass


def _infer_bytes(timeout_us: int | None = None) -> bytes:
    x = np.zeros((1, *APPS[0].input_shape), np.float32)
    req = pb.ModelInferRequest(model_name="classify", inputs=[pb.ModelInferRequest.InferInputTensor(
        name="input", datatype="FP32", shape=list(x.shape))], raw_input_contents=[x.tobytes()])
    if timeout_us is not None:
        req.parameters["timeout"].int64_param = timeout_us
    return req.SerializeToString()


def test_the_calls_grpc_deadline_bounds_the_nodes_and_a_passed_one_is_refused_unworked() -> None:
    assert call_deadline_us(_Ctx(None)) is None and call_deadline_us(object()) is None
    assert call_deadline_us(_Ctx(1e13)) is None  # a far-future deadline, as grpc reports none on some versions
    assert call_deadline_us(_Ctx(0.25)) == 250_000 and call_deadline_us(_Ctx(0.0)) == 0

    async def run() -> list[int]:
        core = _Core()
        s = Servicer(core)  # type: ignore[arg-type]
        await s.ModelInfer(_infer_bytes(), _Ctx(None))  # neither: no deadline
        await s.ModelInfer(_infer_bytes(), _Ctx(0.25))  # the call's deadline alone
        await s.ModelInfer(_infer_bytes(100_000), _Ctx(0.25))  # the parameter is sooner
        await s.ModelInfer(_infer_bytes(900_000), _Ctx(0.25))  # the call's is sooner
        await s.ModelInfer(_infer_bytes(900_000), _Ctx(None))
        with pytest.raises(OipError) as e:
            await s.ModelInfer(_infer_bytes(), _Ctx(0.0))
        assert e.value.kind == "deadline" and "'classify'" in str(e.value)
        return core.deadlines

    assert asyncio.run(run()) == [0, 250_000, 100_000, 250_000, 900_000]  # the refused call reached no node
