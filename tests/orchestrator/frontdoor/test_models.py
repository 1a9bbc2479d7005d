from __future__ import annotations

from google.protobuf import json_format

from orchestrator.config import AppConfig, StageConfig
from orchestrator.frontdoor import model_info, oip_pb2


def test_output_size_comes_from_the_zoo_or_the_model() -> None:
    zoo = model_info(AppConfig(name="a", model="resnet18", slo_ms=100, app_id=1))
    assert zoo.output_dim == 1000 and zoo.datatype == "FP32" and zoo.input_shape == (3, 224, 224)
    small = model_info(AppConfig(name="b", model="mobilenet_v2", num_classes=7, dtype="uint8",
                                 input_shape=(3, 8, 8), slo_ms=100, app_id=2))
    assert small.output_dim == 7 and small.datatype == "UINT8" and small.row_bytes == 192
    # A user model is built and run once: torch.nn.Identity answers its input, 3*4*4 values.
    user = model_info(AppConfig(name="c", model="torch.nn:Identity", input_shape=(3, 4, 4), slo_ms=100, app_id=3))
    assert user.output_dim == 48
    dag = model_info(AppConfig(name="d", slo_ms=100, app_id=4, stages=(
        StageConfig(name="r", model="recog_router", routes=("f",)), StageConfig(name="f", model="vgg_face"))))
    assert dag.output_dim == -1
    assert dag.metadata()["outputs"][0]["shape"] == [-1, -1]


def test_metadata_and_config_fit_the_protocol_messages() -> None:
    info = model_info(AppConfig(name="a", model="resnet18", num_classes=10, input_shape=(3, 32, 32), slo_ms=50,
                                max_batch=4, max_wait_ms=3, app_id=9))
    meta = json_format.ParseDict(info.metadata(), oip_pb2.ModelMetadataResponse())
    assert meta.name == "a" and list(meta.inputs[0].shape) == [-1, 3, 32, 32] and meta.outputs[0].name == "logits"
    cfg = json_format.ParseDict(info.config(), oip_pb2.ModelConfig())
    assert cfg.max_batch_size == 4 and list(cfg.output[0].dims) == [10]
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 3000
    assert cfg.parameters["app_id"].string_value == "9"
