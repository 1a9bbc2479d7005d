"""The gRPC front door's message bounds: what a model cannot take is refused with RESOURCE_EXHAUSTED."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from orchestrator.frontdoor.grpc_server import max_message_bytes
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
    np.testing.assert_allclose(out, stack.expect("classify", x), rtol=1e-4, atol=1e-4)
