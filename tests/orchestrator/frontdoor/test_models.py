from __future__ import annotations

from pathlib import Path

from google.protobuf import json_format

from orchestrator.config.schema import AppConfig, StageConfig, parse_config
from orchestrator.frontdoor import model_info, oip_pb2
from orchestrator.frontdoor.models import HEAD_BYTES

from ...modelfiles import detector_onnx, multi_io_onnx


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


def test_a_model_files_info_speaks_for_its_tensors_and_bounds_its_bodies(tmp_path: Path) -> None:
    detector_onnx(tmp_path / "det.onnx")
    multi_io_onnx(tmp_path / "multi.onnx")
    cfg = parse_config({"node": {"backend": "cpu"}, "apps": [
        {"name": "det", "model": "det.onnx", "slo_ms": 50, "config": {"max_batch_size": 0}},
        {"name": "multi", "model": "multi.onnx", "slo_ms": 50,
         "config": {"max_batch_size": 4, "input": [{"name": "image in", "data_type": "TYPE_FP32", "dims": [3, 8]},
                                                   {"name": "scale.k", "data_type": "TYPE_INT64", "dims": [1]},
                                                   {"name": "flag", "data_type": "TYPE_BOOL", "dims": [1]}]}}]},
        base_dir=tmp_path)
    det = model_info(cfg.app_by_name("det"), request_bytes_max=4096)
    assert det.metadata()["inputs"] == [{"name": "scores", "datatype": "FP32", "shape": [-1]}]
    assert det.rows_max == 1 and det.request_bytes_max == 4096  # dynamic: the pool's bound
    assert det.max_body_bytes(binary=True) == 4096 + HEAD_BYTES
    multi = model_info(cfg.app_by_name("multi"), request_bytes_max=1 << 20)
    # Every input fixed: a request is 3*8*4 + 8 + 1 bytes, and a batch is max_batch_size (4) of them.
    assert multi.request_bytes_max == 3 * 8 * 4 + 8 + 1 and multi.rows_max == 4
    assert multi.max_body_bytes(binary=True) == 4 * (3 * 8 * 4 + 8 + 1) + HEAD_BYTES
    conf = multi.config()
    assert conf["parameters"]["app_id"]["string_value"] == str(cfg.app_by_name("multi").app_id)
    pb = json_format.ParseDict(conf, oip_pb2.ModelConfig(), ignore_unknown_fields=True)
    assert [i.name for i in pb.input] == ["image in", "scale.k", "flag"] and pb.max_batch_size == 4
