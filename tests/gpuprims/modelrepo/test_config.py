"""config.pbtxt into ModelConfig: every supported field, the ignored ones listed, every refused field
and error path as one line naming the file, the line and the field."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuprims.modelrepo import (
    Accelerator,
    InstanceKind,
    ModelConfig,
    ModelConfigError,
    TimeoutAction,
    VersionPolicy,
    config,
    parse_config,
    proto,
)
from gpuprims.modelrepo.errors import TextIndex
from gpuprims.tensors import DataType

PATH = "/repo/det/config.pbtxt"

BASE = """\
name: "det"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
  { name: "x y" data_type: TYPE_FP32 dims: [ 3, -1 ] },
  { name: "ids.0" data_type: TYPE_INT64 dims: [ 4 ] }
]
output { name: "boxes" data_type: TYPE_FP16 dims: [ -1, 4 ] }
output { name: "ok" data_type: TYPE_BOOL dims: [ 1 ] }
"""
BASE_LINES = BASE.count("\n")

FULL = BASE.replace('max_batch_size: 8', 'max_batch_size: 16') + """\
input { name: "mask" data_type: TYPE_UINT8 dims: [ 2, 6 ] reshape: { shape: [ 12 ] } optional: true }
version_policy: { specific: { versions: [ 1, 3 ] } }
dynamic_batching {
  max_queue_delay_microseconds: 500
  preferred_batch_size: [ 4, 8 ]
  priority_levels: 3
  default_priority_level: 2
  default_queue_policy { max_queue_size: 64 default_timeout_microseconds: 20000 timeout_action: DELAY
                         allow_timeout_override: true }
}
instance_group [ { count: 2 kind: KIND_GPU gpus: [ 0, 1 ] }, { kind: KIND_CPU } ]
default_model_filename: "detector.onnx"
parameters { key: "gpu_pct" value { string_value: "40" } }
parameters { key: "slo_ms" value { string_value: "12.5" } }
parameters { key: "engine" value { string_value: "onnxruntime" } }
parameters { key: "overflow" value { string_value: "cpu" } }
model_warmup [
  { name: "zeros" batch_size: 4 count: 2
    inputs { key: "x y" value: { data_type: TYPE_FP32 dims: [ 3, 7 ] zero_data: true } }
    inputs { key: "ids.0" value: { data_type: TYPE_INT64 dims: [ 4 ] random_data: true } } },
  { name: "file"
    inputs { key: "x y" value: { data_type: TYPE_FP32 dims: [ 3, 2 ] input_data_file: "x.bin" } }
    inputs { key: "ids.0" value: { data_type: TYPE_INT64 dims: [ 4 ] zero_data: true } } }
]
optimization { execution_accelerators {
  gpu_execution_accelerator: [ { name: "tensorrt" parameters { key: "precision_mode" value: "FP16" } } ]
  cpu_execution_accelerator: [ { name: "openvino" } ]
} }
model_transaction_policy { decoupled: false }
"""


def _err(text: str, path: str = PATH) -> ModelConfigError:
    with pytest.raises(ModelConfigError) as ei:
        parse_config(text, path)
    return ei.value


def test_every_supported_field() -> None:
    c = parse_config(FULL, PATH)
    assert (c.name, c.platform, c.backend, c.max_batch_size) == ("det", "onnxruntime_onnx", "onnxruntime", 16)
    sig = c.signature
    assert [(s.name, s.datatype, s.dims) for s in sig.inputs] == [
        ("x y", DataType.FP32, (3, -1)), ("ids.0", DataType.INT64, (4,)), ("mask", DataType.UINT8, (2, 6))]
    assert sig.inputs[2].reshape == (12,) and sig.inputs[2].optional and not sig.inputs[0].optional
    assert [(s.name, s.datatype, s.dims) for s in sig.outputs] == [
        ("boxes", DataType.FP16, (-1, 4)), ("ok", DataType.BOOL, (1,))]
    assert c.version_policy == VersionPolicy("specific", versions=(1, 3))
    db = c.dynamic_batching
    assert db is not None and (db.max_queue_delay_us, db.preferred_batch_sizes) == (500, (4, 8))
    assert (db.priority_levels, db.default_priority_level) == (3, 2)
    q = db.default_queue_policy
    assert (q.max_queue_size, q.default_timeout_us, q.timeout_action, q.allow_timeout_override) == (
        64, 20000, TimeoutAction.DELAY, True)
    assert [(g.count, g.kind, g.gpus) for g in c.instance_groups] == [
        (2, InstanceKind.GPU, (0, 1)), (1, InstanceKind.CPU, ())]
    assert c.default_model_filename == "detector.onnx" and c.model_filename == "detector.onnx"
    assert c.model_format == "onnx"
    p = c.parameters
    assert (p.gpu_pct, p.slo_ms, p.engine, p.overflow) == (40, 12.5, "onnxruntime", "cpu")
    w0, w1 = c.warmup
    assert (w0.name, w0.batch_size, w0.count) == ("zeros", 4, 2)
    assert [(i.name, i.datatype, i.dims, i.data) for i in w0.inputs] == [
        ("ids.0", DataType.INT64, (4,), "random"), ("x y", DataType.FP32, (3, 7), "zero")]
    assert (w1.batch_size, w1.count) == (1, 1)
    assert [(i.name, i.data, i.data_file) for i in w1.inputs] == [("ids.0", "zero", None), ("x y", "file", "x.bin")]
    assert c.accelerators == (Accelerator("tensorrt", "gpu", (("precision_mode", "FP16"),)),
                              Accelerator("openvino", "cpu"))
    assert c.ignored == () and c.source == PATH


def test_defaults_of_a_minimal_config() -> None:
    c = parse_config(BASE.replace('name: "det"\n', ""), PATH)
    assert c.name == "det"  # the directory's name
    assert c.version_policy == VersionPolicy("latest", 1) and c.dynamic_batching is None
    assert c.instance_groups == () and c.warmup == () and c.accelerators == ()
    assert c.parameters == config.GpuprimsParameters() and c.model_filename == "model.onnx"
    assert c.message.name == "det"


IGNORED_TEXT = BASE.replace('dims: [ 4 ] }\n]', 'dims: [ 4 ] format: FORMAT_NCHW }\n]') + """\
output { name: "label" data_type: TYPE_FP32 dims: [ 5 ] label_filename: "labels.txt" }
optimization {
  graph { level: 1 }
  priority: PRIORITY_MAX
  cuda { graphs: true busy_wait_events: true output_copy_stream: true graph_spec { batch_size: 4 } }
  input_pinned_memory { enable: false }
  output_pinned_memory { enable: false }
  gather_kernel_buffer_threshold: 4
  eager_batching: true
  execution_accelerators { gpu_execution_accelerator { name: "tensorrt"
    parameters { key: "precision_mode" value: "FP16" } parameters { key: "max_workspace_size_bytes" value: "1" } } }
}
dynamic_batching { preserve_ordering: true }
instance_group { name: "g" count: 1 kind: KIND_CPU rate_limiter { priority: 2 } profile: "0" host_policy: "numa0" }
metric_tags { key: "team" value: "vision" }
parameters { key: "intra_op_thread_count" value { string_value: "2" } }
response_cache { enable: true }
"""


def test_ignored_fields_are_accepted_and_listed() -> None:
    c = parse_config(IGNORED_TEXT, PATH)
    assert set(c.ignored) == {
        "input.format", "output.label_filename", "optimization.graph", "optimization.priority",
        "optimization.cuda.graphs", "optimization.cuda.busy_wait_events", "optimization.cuda.output_copy_stream",
        "optimization.cuda.graph_spec", "optimization.input_pinned_memory", "optimization.output_pinned_memory",
        "optimization.gather_kernel_buffer_threshold", "optimization.eager_batching",
        "dynamic_batching.preserve_ordering", "instance_group.name", "instance_group.rate_limiter",
        "instance_group.profile", "instance_group.host_policy", "metric_tags",
        "parameters.intra_op_thread_count", "response_cache",
        "optimization.execution_accelerators.gpu_execution_accelerator.tensorrt.max_workspace_size_bytes"}
    assert len(c.ignored) == len(set(c.ignored))
    assert c.signature.outputs[-1].name == "label"


# (snippet appended to BASE, the field the error names, the snippet's line the field is on, words)
REFUSED = [
    ('sequence_batching { max_sequence_idle_microseconds: 5 }', "sequence_batching", 1, "stateful"),
    ('ensemble_scheduling { step { model_name: "a" model_version: -1 } }', "ensemble_scheduling", 1,
     "come with pipelines"),
    ('batch_input { kind: BATCH_ELEMENT_COUNT target_name: "n" data_type: TYPE_INT32 source_input: "x y" }',
     "batch_input", 1, "batch inputs"),
    ('batch_output { target_name: "boxes" kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "x y" }',
     "batch_output", 1, "batch outputs"),
    ('model_transaction_policy {\n  decoupled: true\n}', "model_transaction_policy.decoupled", 2,
     "one answer"),
    ('instance_group [\n { count: 1 },\n { kind: KIND_MODEL }\n]', "instance_group[1].kind", 3, "KIND_MODEL"),
    ('input { name: "s" data_type: TYPE_INT32 dims: [ 1 ]\n  is_shape_tensor: true }', "input[2].is_shape_tensor",
     2, "shape tensors"),
    ('input { name: "r" data_type: TYPE_FP32 dims: [ -1 ]\n  allow_ragged_batch: true }',
     "input[2].allow_ragged_batch", 2, "ragged"),
    ('output { name: "s" data_type: TYPE_INT32 dims: [ 1 ] is_shape_tensor: true }', "output[2].is_shape_tensor",
     1, "shape tensors"),
    ('model_repository_agents { agents { name: "checksum" } }', "model_repository_agents", 1, "agents"),
    ('model_operations { op_library_filename: "libops.so" }', "model_operations", 1, "operation libraries"),
    ('cc_model_filenames { key: "7.5" value: "t4.onnx" }', "cc_model_filenames", 1, "compute-capability"),
    ('dynamic_batching {\n  priority_levels: 2 default_priority_level: 1\n  priority_queue_policy { key: 1 value: '
     '{ max_queue_size: 3 } }\n}', "dynamic_batching.priority_queue_policy", 3, "per-priority"),
    ('instance_group { count: 1\n  secondary_devices { kind: KIND_NVDLA device_id: 0 } }',
     "instance_group[0].secondary_devices", 2, "NVDLA"),
    ('instance_group { count: 1\n  passive: true }', "instance_group[0].passive", 2, "passive"),
]


@pytest.mark.parametrize(("snippet", "fld", "line", "words"), REFUSED, ids=[r[1] for r in REFUSED])
def test_refused_fields_name_file_line_and_field(snippet: str, fld: str, line: int, words: str) -> None:
    e = _err(BASE + snippet + "\n")
    assert str(e).startswith(f"{PATH}:{BASE_LINES + line}: {fld}: "), str(e)
    assert words in str(e) and "\n" not in str(e)
    assert (e.file, e.line, e.field) == (PATH, BASE_LINES + line, fld)


def test_every_refused_field_has_its_test_above() -> None:
    import re

    tested = {re.sub(r"\[\d+\]", "", fld) for _, fld, _, _ in REFUSED}
    refused = {k for k, (d, _) in config.FIELDS.items() if d == config.REFUSED}
    assert sorted(refused - tested) == []


# (text, line, field, words): every other error path of a config text.
ERRORS = [
    (BASE + "max_batch_size 8 {\n", None, None, ""),  # syntax: checked apart below
    (BASE.replace("dims: [ 4 ]", "dims: [ 0 ]"), 6, "input[1].dims", "must be >= 1 or -1"),
    (BASE.replace("dims: [ 4 ]", "dims: [ -2 ]"), 6, "input[1].dims", "got [-2]"),
    (BASE.replace("dims: [ 1 ]", "dims: [ ]"), 9, "output[1].dims", "has no dims"),
    (BASE.replace("max_batch_size: 8", "max_batch_size: -1"), 3, "max_batch_size", "must be >= 0"),
    (BASE.replace("TYPE_INT64", "TYPE_STRING"), 6, "input[1].data_type",
     "BYTES tensors are not supported yet: input 'ids.0' is TYPE_STRING"),
    (BASE.replace("TYPE_BOOL", "TYPE_STRING"), 9, "output[1].data_type", "BYTES tensors are not supported yet"),
    (BASE.replace(' data_type: TYPE_INT64', ''), 6, "input[1].data_type", "has no data_type"),
    (BASE.replace('TYPE_INT64', '99'), 6, "input[1].data_type", "99 is not a value of DataType (one of TYPE_INVALID"),
    (BASE + 'instance_group {\n kind: 7 }', 11, "instance_group[0].kind", "7 is not a value of Kind"),
    (BASE + 'dynamic_batching { default_queue_policy {\n timeout_action: 5 } }', 11,
     "dynamic_batching.default_queue_policy.timeout_action", "5 is not a value of TimeoutAction"),
    (BASE + 'model_warmup { name: "w"\n inputs { key: "x y" value: { data_type: 42 dims: [ 3, 1 ] '
     'zero_data: true } } }', 11, "model_warmup[0].inputs['x y']", "42 is not a value of DataType"),
    (BASE.replace('name: "ids.0"', 'name: "x y"'), 6, "input[1].name", "repeated"),
    (BASE.replace('{ name: "ids.0" ', '{ '), 6, "input[1].name", "has no name"),
    (BASE.replace('dims: [ 4 ] }', 'dims: [ 4 ]\n reshape: { shape: [ 2, 3 ] } }'), 7, "input[1].reshape",
     "does not hold the elements"),
    (BASE.replace('dims: [ 4 ] }', 'dims: [ 4 ] reshape: { shape: [ -1 ] } }'), 6, "input[1].reshape",
     "does not hold"),
    (BASE.replace('onnxruntime_onnx', 'caffe9'), 2, "platform", "unknown platform 'caffe9'"),
    (BASE.replace('onnxruntime_onnx', 'tensorflow_savedmodel'), 2, "platform", "TensorFlow models are not"),
    (BASE.replace('onnxruntime_onnx', 'ensemble'), 2, "platform", "come with pipelines"),
    (BASE.replace('platform: "onnxruntime_onnx"', 'backend: "python"'), 2, "backend", "Python-backend"),
    (BASE.replace('platform: "onnxruntime_onnx"', 'platform: "onnxruntime_onnx" backend: "tensorrt"'), 2,
     "backend", "does not serve platform"),
    (BASE.replace('platform: "onnxruntime_onnx"\n', ''), 1, "platform", "neither platform nor backend"),
    (BASE + 'default_model_filename: "model.plan"', 10, "default_model_filename", "does not run"),
    (BASE + 'default_model_filename: "../../other/model.onnx"', 10, "default_model_filename", "not a path"),
    (BASE + 'model_warmup { name: "w"\n inputs { key: "x y" value: { data_type: TYPE_FP32 dims: [ 3, 1 ] '
     'input_data_file: "/etc/passwd" } } }', 11, "model_warmup[0].inputs['x y']", "not a path"),
    (BASE.split("input [")[0] + 'output { name: "o" data_type: TYPE_FP32 dims: [ 1 ] }', 1, "input",
     "has no input"),
    (BASE + 'dynamic_batching { preferred_batch_size: [ 4, 16 ] }', 10, "dynamic_batching.preferred_batch_size",
     "1..max_batch_size (8)"),
    (BASE.replace("max_batch_size: 8", "max_batch_size: 0") + 'dynamic_batching { preferred_batch_size: [ 1 ] }',
     10, "dynamic_batching.preferred_batch_size", "need max_batch_size > 0"),
    (BASE + 'dynamic_batching {\n priority_levels: 2 default_priority_level: 3 }', 11,
     "dynamic_batching.default_priority_level", "1..2"),
    (BASE + 'dynamic_batching { default_priority_level: 1 }', 10, "dynamic_batching.default_priority_level",
     "needs priority_levels"),
    (BASE + 'instance_group { count: -2 }', 10, "instance_group[0].count", "must be >= 1"),
    (BASE + 'instance_group { kind: KIND_CPU gpus: [ 0 ] }', 10, "instance_group[0].gpus", "KIND_CPU"),
    (BASE + 'instance_group { kind: KIND_GPU gpus: [ -1 ] }', 10, "instance_group[0].gpus", ">= 0"),
    (BASE + 'version_policy { latest { num_versions: 0 } }', 10, "version_policy.latest", "num_versions >= 1"),
    (BASE + 'version_policy {\n specific { } }', 11, "version_policy.specific", "versions >= 1"),
    (BASE + 'version_policy { specific { versions: [ 0 ] } }', 10, "version_policy.specific", "got [0]"),
    (BASE + 'model_warmup { name: "w" batch_size: 9\n inputs { key: "x y" value: { data_type: TYPE_FP32 dims: '
     '[ 3, 1 ] zero_data: true } } }', 10, "model_warmup[0].batch_size", "more than the model takes (8)"),
    (BASE + 'model_warmup { name: "w"\n inputs { key: "nope" value: { data_type: TYPE_FP32 dims: [ 1 ] '
     'zero_data: true } } }', 11, "model_warmup[0].inputs['nope']", "unknown input 'nope'"),
    (BASE + 'model_warmup { name: "w"\n inputs { key: "x y" value: { data_type: TYPE_INT8 dims: [ 3, 1 ] '
     'zero_data: true } } }', 11, "model_warmup[0].inputs['x y']", "TYPE_INT8, the model takes TYPE_FP32"),
    (BASE + 'model_warmup { name: "w"\n inputs { key: "x y" value: { data_type: TYPE_FP32 dims: [ 4, 1 ] '
     'zero_data: true } } }', 11, "model_warmup[0].inputs['x y']", "do not fit"),
    (BASE + 'model_warmup { name: "w"\n inputs { key: "x y" value: { data_type: TYPE_FP32 dims: [ 3, 1 ] } } }',
     11, "model_warmup[0].inputs['x y']", "needs zero_data, random_data or input_data_file"),
    (BASE + 'model_warmup { name: "w"\n inputs { key: "x y" value: { data_type: TYPE_FP32 dims: [ 3, 1 ] '
     'zero_data: true } } }', 10, "model_warmup[0]", "leaves out inputs ['ids.0']"),
    (BASE + 'model_warmup { name: "w" }', 10, "model_warmup[0]", "has no inputs"),
    (BASE + 'optimization { execution_accelerators {\n gpu_execution_accelerator { name: "magic" } } }', 11,
     "optimization.execution_accelerators.gpu_execution_accelerator[0].name", "unknown gpu execution accelerator"),
    (BASE.replace("onnxruntime_onnx", "tensorrt_plan") + 'optimization { execution_accelerators {\n'
     ' gpu_execution_accelerator { name: "tensorrt" } } }', 11,
     "optimization.execution_accelerators.gpu_execution_accelerator[0].name", "applies to ONNX models"),
    (BASE + 'optimization { execution_accelerators {\n gpu_execution_accelerator { name: "tensorrt"\n'
     '  parameters { key: "precision_mode" value: "INT8" } } } }', 12,
     "optimization.execution_accelerators.gpu_execution_accelerator[0].parameters['precision_mode']",
     "'INT8' is not supported (one of FP32, FP16)"),
    (BASE + 'parameters { key: "gpu_pct" value { string_value: "0" } }', 10, "parameters['gpu_pct']", "1..100"),
    (BASE + 'parameters { key: "gpu_pct" value { string_value: "half" } }', 10, "parameters['gpu_pct']",
     "got 'half'"),
    (BASE + 'parameters { key: "slo_ms" value { string_value: "0" } }', 10, "parameters['slo_ms']", "> 0"),
    (BASE + 'parameters { key: "slo_ms" value { string_value: "nan" } }', 10, "parameters['slo_ms']", "> 0"),
    (BASE + 'parameters { key: "slo_ms" value { string_value: "soon" } }', 10, "parameters['slo_ms']",
     "must be a number, got 'soon'"),
    (BASE + 'parameters { key: "engine" value { string_value: "warp" } }', 10, "parameters['engine']",
     "must be one of"),
    (BASE + 'parameters [ { key: "gpu_pct" value { string_value: "5" } },\n { key: "engine" value { '
     'string_value: "torchscript" } } ]', 11, "parameters['engine']", "does not run a onnx model"),
    (BASE + 'parameters { key: "overflow" value { string_value: "gpu" } }', 10, "parameters['overflow']",
     "none or cpu"),
]


@pytest.mark.parametrize(("text", "line", "fld", "words"), ERRORS[1:], ids=[f"{e[2]}-{i}" for i, e in
                                                                             enumerate(ERRORS[1:])])
def test_error_paths_name_file_line_and_field(text: str, line: int, fld: str, words: str) -> None:
    e = _err(text)
    assert str(e).startswith(f"{PATH}:{line}: {fld}: "), str(e)
    assert words in str(e), str(e)
    assert "\n" not in str(e)


def test_syntax_errors_give_line_and_what() -> None:
    e = _err(BASE + "max_batch_size 8 {\n")
    assert str(e).startswith(f"{PATH}:{BASE_LINES + 1}: max_batch_size: "), str(e)
    e = _err('name: "det"\nplatform: "onnxruntime_onnx"\nbatch_size: 8\n')
    assert str(e).startswith(f"{PATH}:3: batch_size: unknown field"), str(e)
    e = _err(BASE.replace("TYPE_BOOL", "TYPE_BOOLEAN"))
    assert str(e) == f'{PATH}:9: data_type: Enum type "inference.DataType" has no value named TYPE_BOOLEAN.', str(e)
    e = _err(BASE.replace("dims: [ 4 ]", "dims: [ 4, four ]"))
    assert str(e).startswith(f"{PATH}:6: dims: Couldn't parse integer"), str(e)
    e = _err(BASE + 'max_batch_size: "many"')
    assert str(e).startswith(f"{PATH}:{BASE_LINES + 1}: max_batch_size: "), str(e)
    e = _err('name: "det"\ninput { name: "a" ')
    assert str(e).startswith(f"{PATH}:2: ") and "\n" not in str(e), str(e)


def test_the_error_pickles_and_is_a_value_error() -> None:
    e = _err(BASE.replace("TYPE_INT64", "TYPE_STRING"))
    back = pickle.loads(pickle.dumps(e))
    assert isinstance(back, ValueError) and str(back) == str(e) and back.line == e.line
    assert str(ModelConfigError("f", None, "x", "first\n  second\n")) == "f: x: first second"


def test_a_record_made_by_hand_has_no_message_to_send() -> None:
    c = parse_config(BASE, PATH)
    bare = ModelConfig(c.name, c.platform, c.backend, c.signature, c.model_format)
    assert bare == c.__class__(**{**c.__dict__, "source": "", "message": None})
    with pytest.raises(ValueError, match="made without its message"):
        bare.to_json()


def _walk_fields(desc: object, prefix: str, out: list[str]) -> None:
    for fd in desc.fields:  # type: ignore[attr-defined]
        key = f"{prefix}.{fd.name}" if prefix else fd.name
        out.append(key)
        decision = config.FIELDS.get(key, (None, ""))[0]
        if decision == config.SUPPORTED and fd.message_type is not None \
                and not fd.message_type.GetOptions().map_entry:
            _walk_fields(fd.message_type, key, out)


def test_every_field_of_the_message_is_decided() -> None:
    top = [fd.name for fd in proto.ModelConfigMessage.DESCRIPTOR.fields]
    assert sorted(set(top) - set(config.FIELDS)) == []
    # ...and every field inside a supported message, down to the leaves.
    reachable: list[str] = []
    _walk_fields(proto.ModelConfigMessage.DESCRIPTOR, "", reachable)
    assert sorted(k for k in reachable if k not in config.FIELDS) == []
    assert sorted(set(config.FIELDS) - set(reachable)) == []  # no stale entry
    assert {d for d, _ in config.FIELDS.values()} == {config.SUPPORTED, config.IGNORED, config.REFUSED}
    assert all(why for d, why in config.FIELDS.values() if d == config.REFUSED)


def test_a_field_nobody_decided_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    fields = dict(config.FIELDS)
    del fields["response_cache"]
    monkeypatch.setattr(config, "FIELDS", fields)
    e = _err(BASE + "response_cache { enable: true }")
    assert str(e).startswith(f"{PATH}:{BASE_LINES + 1}: response_cache: refused: not known to gpuprims"), str(e)


def test_json_carries_the_message_and_the_source() -> None:
    c = parse_config(FULL, PATH)
    back = ModelConfig.from_json(c.to_json())
    assert back == c and back.message == c.message and back.source == PATH
    assert c.to_dict()["input"][0]["name"] == "x y"
    ign = parse_config(IGNORED_TEXT, PATH)
    assert ModelConfig.from_json(ign.to_json()).ignored == ign.ignored
    with pytest.raises(ModelConfigError, match="not a ModelConfig JSON"):
        ModelConfig.from_json('{"source": "x", "config": {"nmae": 1}}')
    with pytest.raises(ModelConfigError, match="not a ModelConfig JSON"):
        ModelConfig.from_json("[1")


def test_json_of_a_refused_message_is_refused_in_the_instance_too() -> None:
    msg = parse_config(BASE, PATH).message
    msg.sequence_batching.SetInParent()
    text = ModelConfig(name="det", platform="", backend="onnxruntime", signature=parse_config(BASE, PATH).signature,
                       model_format="onnx", source=PATH, message=msg).to_json()
    with pytest.raises(ModelConfigError) as ei:
        ModelConfig.from_json(text)
    assert str(ei.value).startswith(f"{PATH}: sequence_batching: refused")


ENGINES = [
    # (config extra / platform swap, device, kind, options)
    ("", "cpu", "onnxruntime", {"provider": "cpu"}),
    ("", "cuda", "onnxruntime", {"provider": "cuda"}),
    ('optimization { execution_accelerators { gpu_execution_accelerator { name: "tensorrt" } } }', "cuda",
     "onnxruntime", {"provider": "tensorrt", "precision": "fp32"}),
    ('optimization { execution_accelerators { gpu_execution_accelerator { name: "tensorrt" '
     'parameters { key: "precision_mode" value: "FP16" } } } }', "cuda", "onnxruntime",
     {"provider": "tensorrt", "precision": "fp16"}),
    ('optimization { execution_accelerators { gpu_execution_accelerator { name: "tensorrt" } } }', "cpu",
     "onnxruntime", {"provider": "cpu"}),
    ('optimization { execution_accelerators { cpu_execution_accelerator { name: "openvino" } } }', "cpu",
     "openvino", {}),
    ('optimization { execution_accelerators { cpu_execution_accelerator { name: "openvino" } } }', "cuda",
     "onnxruntime", {"provider": "cuda"}),
    ('parameters { key: "engine" value { string_value: "openvino" } }', "cpu", "openvino", {}),
    ('parameters { key: "engine" value { string_value: "tensorrt" } }', "cuda", "tensorrt", {}),
    ("platform=tensorrt_plan", "cuda", "tensorrt", {}),
    ("platform=pytorch_libtorch", "cpu", "torchscript", {}),
    ('platform=pytorch_libtorch\nparameters { key: "engine" value { string_value: "compile" } }', "cpu", "compile",
     {}),
    ('backend=pytorch\ndefault_model_filename: "model.pt2"', "cpu", "torch_export", {}),
    ("backend=openvino", "cpu", "openvino", {}),
    ('backend=openvino\ndefault_model_filename: "model.onnx"', "cuda", "openvino", {}),
]


@pytest.mark.parametrize(("extra", "device", "kind", "options"), ENGINES)
def test_engine_by_format_parameters_and_accelerators(extra: str, device: str, kind: str,
                                                      options: dict[str, str]) -> None:
    text = BASE
    if extra.startswith(("platform=", "backend=")):
        head, _, extra = extra.partition("\n")
        key, _, value = head.partition("=")
        text = text.replace('platform: "onnxruntime_onnx"', f'{key}: "{value}"')
    c = parse_config(text + extra, PATH)
    choice = c.engine(device)
    assert (choice.kind, dict(choice.options)) == (kind, options)
    assert c.engine_kind(device) == kind
    with pytest.raises(ValueError, match="cpu or cuda"):
        c.engine("tpu")


def test_model_format_and_file_by_platform() -> None:
    for platform, fmt, filename in (("tensorrt_plan", "tensorrt_plan", "model.plan"),
                                    ("pytorch_libtorch", "torchscript", "model.pt")):
        c = parse_config(BASE.replace("onnxruntime_onnx", platform), PATH)
        assert (c.model_format, c.model_filename) == (fmt, filename)
    c = parse_config(BASE.replace('platform: "onnxruntime_onnx"', 'backend: "openvino"'), PATH)
    assert (c.model_format, c.model_filename, c.backend, c.platform) == ("openvino_ir", "model.xml", "openvino", "")


def test_text_index_places_repeated_fields_however_written() -> None:
    text = ('input [\n { name: "a" },\n { name: "b"\n   dims: [ 1 ] }\n]\ninput {\n name: "c" }\n'
            'parameters {\n key: "k" value { string_value: "v" } }\n# a comment: input { }\n')
    idx = TextIndex(text)
    assert idx.line([("input", 0)]) == 2
    assert idx.line([("input", 1), ("dims", None)]) == 4
    assert idx.line([("input", 2), ("name", None)]) == 7
    assert idx.line([("input", 5)]) == 1
    assert idx.line([("parameters", "k"), ("value", None)]) == 9
    assert idx.line([("parameters", "nope")]) == 1


def test_records_validate_at_construction() -> None:
    with pytest.raises(ValueError, match="num_versions"):
        VersionPolicy("latest", 0)
    with pytest.raises(ValueError, match="latest, all or specific"):
        VersionPolicy("newest")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gpu_pct"):
        config.GpuprimsParameters(gpu_pct=101)
    with pytest.raises(ValueError, match="unknown gpu execution accelerator"):
        Accelerator("warp", "gpu")
    with pytest.raises(ValueError, match="count"):
        config.InstanceGroup(count=0)
    with pytest.raises(ValueError, match="model_format"):
        ModelConfig("m", "", "onnxruntime", parse_config(BASE, PATH).signature, "safetensors")
    assert VersionPolicy("latest", 2).select([3, 1, 10, 2]) == (3, 10)
    assert VersionPolicy("all").select([2, 1]) == (1, 2)
    assert VersionPolicy("specific", versions=(3, 1)).select([1, 2]) == (1,)
    assert VersionPolicy("specific", versions=(3, 1)).missing([1, 2]) == (3,)


_PIECES = ["{", "}", "[", "]", ":", ",", '"', "-1", "0", "-7", "99", "TYPE_STRING", "KIND_MODEL", "\n", " ",
           "name", "dims", "input", "reshape", "shape", "max_batch_size", "parameters", "key", "value", "true"]


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(FULL)), st.integers(0, 6), st.sampled_from(_PIECES)),
                min_size=1, max_size=4))
def test_a_mangled_config_is_read_or_refused_in_one_line(edits: list[tuple[int, int, str]]) -> None:
    text = FULL
    for at, cut, piece in edits:
        at = min(at, len(text))
        text = text[:at] + piece + text[at + cut:]
    try:
        c = parse_config(text, PATH)
    except ModelConfigError as e:
        assert str(e).startswith(PATH + ":") and "\n" not in str(e)
        assert e.line is None or 1 <= e.line <= text.count("\n") + 1
    else:
        assert ModelConfig.from_json(c.to_json()) == c
