from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from apps.zoo.names import known_names
from gpuprims.engines.kinds import ENGINE_KINDS, EngineKind
from orchestrator.config.schema import (
    AppConfig,
    ConfigError,
    NodeConfig,
    engine_problems,
    load_config,
    parse_config,
)

REPO = Path(__file__).resolve().parents[3]


def _app(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"name": "a", "model": "mobilenet_v2", "slo_ms": 50}
    base.update(kw)
    return base


def _write(tmp_path: Path, data: Any, name: str = "apps.yaml") -> Path:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data), encoding="utf-8")
    return p


def _refused(tmp_path: Path, data: Any, *fragments: str, **kw: Any) -> ConfigError:
    p = _write(tmp_path, data)
    with pytest.raises(ConfigError) as ei:
        load_config(p, **kw)
    msg = str(ei.value)
    assert str(p) in msg
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    return ei.value


@pytest.mark.parametrize("name", ["apps.yaml", "apps-paper.yaml"])
def test_examples_load(name: str) -> None:
    cfg = load_config(REPO / "examples" / name, known_models=known_names())
    assert cfg.apps
    assert len({a.app_id for a in cfg.apps}) == len(cfg.apps)


def test_cpu_example_fits_a_small_machine() -> None:
    cfg = load_config(REPO / "examples" / "apps.yaml")
    assert sum(a.fixed_pct_per_instance() for a in cfg.apps) <= 100
    assert all(max(a.input_shape[1:]) <= 64 for a in cfg.apps)
    # The front door is on, on loopback, on Triton's ports.
    assert (cfg.node.http_port, cfg.node.grpc_port) == (8000, 8001) and cfg.node.frontdoor_enabled
    assert cfg.node.listen.host == "127.0.0.1"


@pytest.mark.parametrize(("given", "mode"), [(True, "warm"), (False, "cold"), ("warm", "warm"), ("cold", "cold")])
def test_shadow_modes_and_their_yaml_booleans(tmp_path: Path, given: Any, mode: str) -> None:
    app = load_config(_write(tmp_path, {"apps": [_app(shadow=given)]})).apps[0]
    assert app.shadow == mode and app.warm_shadow == (mode == "warm")


def test_defaults(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, {"apps": [_app()]}))
    n = cfg.node
    assert n.listen.host == "127.0.0.1" and n.listen.ports == (9000,)
    assert n.backend == "auto" and n.metrics_port == 0 and not n.metrics_enabled
    assert n.http_port == 0 and n.grpc_port == 0 and not n.frontdoor_enabled
    assert n.run_dir is None and n.log_level == "INFO" and n.log_format == "text"
    assert n.pool.max_payload == 1024 and n.gpus == "all" and n.default_gpu == 0
    assert n.allow_oversubscribe is False and n.mps == "best_effort"
    assert n.scheduler == "spatial" and n.round_ms == 30
    a = cfg.apps[0]
    assert a.app_id == 1 and a.seed == 0 and a.input_shape == (3, 224, 224) and a.dtype == "float32"
    assert a.gpu_pct == "auto" and a.instances == 1 and a.max_batch == 8 and a.max_wait_ms == 2
    assert a.port is None and a.stages is None and a.shadow == "warm" and a.warm_shadow and a.num_classes is None


def test_helpers(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, {
        "node": {"pool": {"max_payload": 1000}},
        "apps": [_app(input_shape=[3, 224, 224]), _app(name="b", dtype="uint8", input_shape=[1, 10, 10])]}))
    a, b = cfg.apps
    assert a.input_nbytes == 602112 and a.chunk_count() == 588 and cfg.chunks_for(a) == 603
    assert b.input_nbytes == 100 and b.chunk_count(64) == 2
    assert cfg.app_by_id(2) is b and cfg.app_by_name("a") is a
    with pytest.raises(KeyError, match="known"):
        cfg.app_by_id(9)
    with pytest.raises(KeyError, match="known"):
        cfg.app_by_name("zz")
    with pytest.raises(ValueError, match="max_payload"):
        a.chunk_count(0)


def test_app_ids_assigned_in_order_skipping_explicit(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, {"apps": [_app(name="x"), _app(name="y", app_id=1), _app(name="z")]}))
    assert [a.app_id for a in cfg.apps] == [2, 1, 3]


def test_list_of_ports_and_log_level_case(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, {"node": {"listen": {"port": [9000, 9001]}, "log_level": "debug",
                                                 "metrics_port": None}, "apps": [_app()]}))
    assert cfg.node.listen.ports == (9000, 9001) and cfg.node.log_level == "DEBUG"
    assert cfg.node.metrics_port == 0


def test_dag_app(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, {"apps": [_app(model=None, stages=[
        {"name": "r", "model": "recog_router", "routes": ["f", "c"], "gpu_pct": 20},
        {"name": "f", "model": "vgg_face", "gpu_pct": 30},
        {"name": "c", "model": "mymod.sub:make"}])]}))
    a = cfg.apps[0]
    assert a.is_dag and a.entry_stages() == ("r",) and a.fixed_pct_per_instance() == 50


def test_config_is_frozen(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, {"apps": [_app()]}))
    with pytest.raises(ValueError):
        cfg.apps[0].slo_ms = 3  # type: ignore[misc]


def test_oversubscribe_allowed_when_asked(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, {"node": {"allow_oversubscribe": True},
                                        "apps": [_app(gpu_pct=80), _app(name="b", gpu_pct=80)]}))
    assert len(cfg.apps) == 2


def test_oversubscribe_counted_per_gpu(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, {"node": {"gpus": [0, 1]},
                                        "apps": [_app(gpu_pct=80), _app(name="b", gpu_pct=80, gpu=1)]}))
    assert cfg.gpu_of(cfg.apps[1]) == 1


# ---- refusals: each names the file, the key and what is wrong


BAD: list[tuple[str, Any, tuple[str, ...]]] = [
    ("unknown top key", {"apps": [_app()], "nodes": {}}, ("nodes", "unknown key", "did you mean 'node'")),
    ("unknown node key", {"node": {"metrics_prt": 1}, "apps": [_app()]}, ("node.metrics_prt", "metrics_port")),
    ("unknown app key", {"apps": [_app(slo=3)]}, ("apps[0].slo", "unknown key")),
    ("unknown pool key", {"node": {"pool": {"slots": 3}}, "apps": [_app()]}, ("node.pool.slots",)),
    ("unknown stage key", {"apps": [_app(model=None, stages=[{"name": "s", "model": "m", "x": 1}])]},
     ("apps[0].stages[0].x", "unknown key")),
    ("missing apps", {"node": {}}, ("apps", "required")),
    ("empty apps", {"apps": []}, ("apps", "at least one app")),
    ("apps not a list", {"apps": {"a": 1}}, ("apps",)),
    ("missing slo", {"apps": [{"name": "a", "model": "m"}]}, ("apps[0].slo_ms", "required")),
    ("missing model", {"apps": [{"name": "a", "slo_ms": 5}]}, ("apps[0].model", "required")),
    ("string slo", {"apps": [_app(slo_ms="5")]}, ("apps[0].slo_ms", "number")),
    ("bool slo", {"apps": [_app(slo_ms=True)]}, ("apps[0].slo_ms",)),
    ("zero slo", {"apps": [_app(slo_ms=0)]}, ("apps[0].slo_ms", "greater than 0")),
    ("negative slo", {"apps": [_app(slo_ms=-1.5)]}, ("apps[0].slo_ms",)),
    ("gpu_pct 0", {"apps": [_app(gpu_pct=0)]}, ("apps[0].gpu_pct", "1..100")),
    ("gpu_pct 101", {"apps": [_app(gpu_pct=101)]}, ("apps[0].gpu_pct", "1..100")),
    ("gpu_pct word", {"apps": [_app(gpu_pct="half")]}, ("apps[0].gpu_pct", "'auto'")),
    ("gpu_pct float", {"apps": [_app(gpu_pct=50.5)]}, ("apps[0].gpu_pct",)),
    ("instances 0", {"apps": [_app(instances=0)]}, ("apps[0].instances", ">= 1")),
    ("instances str", {"apps": [_app(instances="two")]}, ("apps[0].instances",)),
    ("max_batch 0", {"apps": [_app(max_batch=0)]}, ("apps[0].max_batch",)),
    ("max_wait negative", {"apps": [_app(max_wait_ms=-1)]}, ("apps[0].max_wait_ms",)),
    ("max_wait over slo", {"apps": [_app(slo_ms=5, max_wait_ms=5)]}, ("apps[0].max_wait_ms", "less than slo_ms")),
    ("app_id 0", {"apps": [_app(app_id=0)]}, ("apps[0].app_id",)),
    ("app_id too big", {"apps": [_app(app_id=70000)]}, ("apps[0].app_id", "65535")),
    ("seed negative", {"apps": [_app(seed=-1)]}, ("apps[0].seed",)),
    ("num_classes 0", {"apps": [_app(num_classes=0)]}, ("apps[0].num_classes",)),
    ("bad name", {"apps": [_app(name="My App")]}, ("apps[0].name", "[a-z0-9_-]")),
    ("bad model", {"apps": [_app(model="not a model")]}, ("apps[0].model", "module:factory")),
    ("bad dtype", {"apps": [_app(dtype="float64")]}, ("apps[0].dtype", "float32")),
    ("shape len", {"apps": [_app(input_shape=[224, 224])]}, ("apps[0].input_shape", "[C, H, W]")),
    ("shape zero", {"apps": [_app(input_shape=[3, 0, 4])]}, ("apps[0].input_shape", "positive")),
    ("shape str", {"apps": [_app(input_shape="3x224x224")]}, ("apps[0].input_shape",)),
    ("app port 0", {"apps": [_app(port=0)]}, ("apps[0].port",)),
    ("shadow str", {"apps": [_app(shadow="yes")]}, ("apps[0].shadow",)),
    ("shadow int", {"apps": [_app(shadow=1)]}, ("apps[0].shadow", "warm, cold")),
    ("backend", {"node": {"backend": "rocm"}, "apps": [_app()]}, ("node.backend", "'cpu'")),
    ("metrics port", {"node": {"metrics_port": 70000}, "apps": [_app()]}, ("node.metrics_port", "disable")),
    ("http port", {"node": {"http_port": 70000}, "apps": [_app()]}, ("node.http_port", "turn it off")),
    ("grpc port str", {"node": {"grpc_port": "8001"}, "apps": [_app()]}, ("node.grpc_port", "TCP port")),
    ("http is grpc port", {"node": {"http_port": 8000, "grpc_port": 8000}, "apps": [_app()]},
     ("node.grpc_port", "node.http_port")),
    ("grpc is metrics port", {"node": {"metrics_port": 9100, "grpc_port": 9100}, "apps": [_app()]},
     ("node.grpc_port", "node.metrics_port")),
    ("listen port", {"node": {"listen": {"port": 65536}}, "apps": [_app()]}, ("node.listen.port", "0..65535")),
    ("listen ports dup", {"node": {"listen": {"port": [1, 1]}}, "apps": [_app()]}, ("node.listen.port", "twice")),
    ("listen ports empty", {"node": {"listen": {"port": []}}, "apps": [_app()]}, ("node.listen.port",)),
    ("listen host", {"node": {"listen": {"host": ""}}, "apps": [_app()]}, ("node.listen.host",)),
    ("log level", {"node": {"log_level": "loud"}, "apps": [_app()]}, ("node.log_level", "INFO")),
    ("log format", {"node": {"log_format": "xml"}, "apps": [_app()]}, ("node.log_format",)),
    ("run_dir blank", {"node": {"run_dir": " "}, "apps": [_app()]}, ("node.run_dir",)),
    ("gpus word", {"node": {"gpus": "some"}, "apps": [_app()]}, ("node.gpus", "'all'")),
    ("gpus negative", {"node": {"gpus": [-1]}, "apps": [_app()]}, ("node.gpus", ">= 0")),
    ("gpus dup", {"node": {"gpus": [0, 0]}, "apps": [_app()]}, ("node.gpus", "twice")),
    ("mps", {"node": {"mps": "yes"}, "apps": [_app()]}, ("node.mps",)),
    ("scheduler", {"node": {"scheduler": "fifo"}, "apps": [_app()]}, ("node.scheduler",)),
    ("round_ms", {"node": {"round_ms": 0}, "apps": [_app()]}, ("node.round_ms",)),
    ("reassembly", {"node": {"reassembly_timeout_ms": -1}, "apps": [_app()]}, ("node.reassembly_timeout_ms",)),
    ("oversubscribe bool", {"node": {"allow_oversubscribe": "no"}, "apps": [_app()]},
     ("node.allow_oversubscribe",)),
    ("pool payload", {"node": {"pool": {"max_payload": 70000}}, "apps": [_app()]}, ("node.pool.max_payload",)),
    ("pool chunks over slots", {"node": {"pool": {"slot_count": 10, "max_chunks": 20}}, "apps": [_app()]},
     ("node.pool.max_chunks", "slot_count=10")),
    ("duplicate names", {"apps": [_app(), _app()]}, ("apps[1].name", "duplicate", "apps[0]")),
    ("duplicate app_ids", {"apps": [_app(app_id=3), _app(name="b", app_id=3)]}, ("apps[1].app_id", "duplicate")),
    ("duplicate ports", {"apps": [_app(port=9100), _app(name="b", port=9100)]}, ("apps[1].port", "duplicate")),
    ("app port is listen port", {"apps": [_app(port=9000)]}, ("apps[0].port", "node.listen")),
    ("gpu not listed", {"node": {"gpus": [0]}, "apps": [_app(gpu=1)]}, ("apps[0].gpu", "node.gpus")),
    ("oversubscribed", {"apps": [_app(gpu_pct=60), _app(name="b", gpu_pct=30, instances=2)]},
     ("apps", "120%", "a 60%", "b 60%", "allow_oversubscribe")),
    ("too big for pool", {"node": {"pool": {"max_chunks": 10, "max_payload": 1000}},
                          "apps": [_app(input_shape=[3, 64, 64])]},
     ("apps[0].input_shape", "49152", "10 * 1000 = 10000")),
    ("stages and model", {"apps": [_app(stages=[{"name": "s", "model": "m"}])]}, ("apps[0].model", "not both")),
    ("stages empty", {"apps": [_app(model=None, stages=[])]}, ("apps[0].stages", "at least one")),
    ("dag app gpu_pct", {"apps": [_app(model=None, gpu_pct=20, stages=[{"name": "s", "model": "m"}])]},
     ("apps[0].gpu_pct", "each stage")),
    ("stage dup", {"apps": [_app(model=None, stages=[{"name": "s", "model": "m"}, {"name": "s", "model": "m"}])]},
     ("apps[0].stages[1].name", "duplicate")),
    ("stage route unknown", {"apps": [_app(model=None, stages=[{"name": "s", "model": "m", "routes": ["t"]}])]},
     ("apps[0].stages[0].routes", "unknown stage 't'")),
    ("stage cycle", {"apps": [_app(model=None, stages=[
        {"name": "s", "model": "m", "routes": ["t"]}, {"name": "t", "model": "m", "routes": ["u"]},
        {"name": "u", "model": "m", "routes": ["s"]}])]}, ("apps[0].stages[2].routes", "cycle", "s -> t -> u -> s")),
    ("stage self loop", {"apps": [_app(model=None, stages=[{"name": "s", "model": "m", "routes": ["s"]}])]},
     ("cycle",)),
    ("stage pct", {"apps": [_app(model=None, stages=[{"name": "s", "model": "m", "gpu_pct": 0}])]},
     ("apps[0].stages[0].gpu_pct",)),
    ("stage oversubscribed", {"apps": [_app(model=None, stages=[{"name": "s", "model": "m", "gpu_pct": 70},
                                                               {"name": "t", "model": "m", "gpu_pct": 40}])]},
     ("110%",)),
]


@pytest.mark.parametrize(("case", "data", "fragments"), BAD, ids=[b[0] for b in BAD])
def test_refused(tmp_path: Path, case: str, data: Any, fragments: tuple[str, ...]) -> None:
    _refused(tmp_path, data, *fragments)


def test_every_problem_is_reported(tmp_path: Path) -> None:
    err = _refused(tmp_path, {"apps": [_app(slo_ms=0), _app(name="b", gpu_pct=0)]})
    keys = [k for k, _ in err.problems]
    assert keys == ["apps[0].slo_ms", "apps[1].gpu_pct"]
    assert "2 problems" in str(err)


def test_yaml_syntax_error_has_line_and_column(tmp_path: Path) -> None:
    _refused(tmp_path, "apps:\n  - name: x\n   model: [\n", "YAML syntax error", "line 3", "column")


def test_duplicate_yaml_key(tmp_path: Path) -> None:
    _refused(tmp_path, "apps:\n  - name: a\n    name: b\n    model: m\n    slo_ms: 5\n",
             "duplicate key 'name'", "line 3")


@pytest.mark.parametrize(("text", "fragment"), [("", "empty"), ("- 1\n- 2\n", "mapping"), ("3\n", "mapping")])
def test_wrong_top_level(tmp_path: Path, text: str, fragment: str) -> None:
    _refused(tmp_path, text, fragment)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.yaml")


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="directory"):
        load_config(tmp_path)


def test_not_utf8(tmp_path: Path) -> None:
    p = tmp_path / "x.yaml"
    p.write_bytes(b"apps: \xff\xfe\n")
    with pytest.raises(ConfigError, match="UTF-8"):
        load_config(p)


def test_unsafe_yaml_tag_refused(tmp_path: Path) -> None:
    _refused(tmp_path, "apps: !!python/object/apply:os.system ['true']\n", "YAML syntax error")


def test_known_models(tmp_path: Path) -> None:
    p = _write(tmp_path, {"apps": [_app(model="mobilenet_v3"), _app(name="b", model="pkg.mod:factory")]})
    with pytest.raises(ConfigError, match=r"apps\[0\]\.model.*unknown zoo model 'mobilenet_v3'.*mobilenet_v2"):
        load_config(p, known_models={"mobilenet_v2", "resnet50"})
    assert load_config(p).apps[0].model == "mobilenet_v3"


def test_known_models_in_stages(tmp_path: Path) -> None:
    p = _write(tmp_path, {"apps": [_app(model=None, stages=[{"name": "s", "model": "nope"}])]})
    with pytest.raises(ConfigError, match=r"apps\[0\]\.stages\[0\]\.model"):
        load_config(p, known_models={"mobilenet_v2"})


def test_parse_config_source_and_pickle() -> None:
    with pytest.raises(ConfigError) as ei:
        parse_config({"apps": [_app(slo_ms=-1)]}, source="inline")
    assert str(ei.value).startswith("inline: apps[0].slo_ms")
    again = pickle.loads(pickle.dumps(ei.value))
    assert str(again) == str(ei.value) and again.problems == ei.value.problems


def test_models_built_in_code() -> None:
    cfg = NodeConfig(apps=[AppConfig(name="x", model="resnet50", slo_ms=10)])  # type: ignore[call-arg]
    assert cfg.apps[0].app_id == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 100), st.integers(1, 3)), min_size=1, max_size=5))
def test_gpu_budget_property(claims: list[tuple[int, int]]) -> None:
    apps = [_app(name=f"a{i}", gpu_pct=p, instances=n) for i, (p, n) in enumerate(claims)]
    total = sum(p * n for p, n in claims)
    if total <= 100:
        assert len(parse_config({"apps": apps}).apps) == len(claims)
    else:
        with pytest.raises(ConfigError, match=f"{total}%"):
            parse_config({"apps": apps})


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("name", ["apps.yaml", "apps-paper.yaml"])
def test_round_trips_for_child_processes(name: str) -> None:
    import json
    import pickle

    cfg = load_config(REPO / "examples" / name)
    assert NodeConfig.model_validate(cfg.model_dump()) == cfg
    assert NodeConfig.model_validate_json(cfg.model_dump_json()) == cfg
    assert parse_config(json.loads(cfg.model_dump_json())) == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg


def test_mps_off_in_yaml_is_off(tmp_path: Path) -> None:
    # YAML 1.1 reads a bare `off` as false.
    p = tmp_path / "apps.yaml"
    p.write_text("node: {mps: off}\napps:\n  - {name: a, model: resnet18, slo_ms: 50}\n")
    assert load_config(p).node.mps == "off"


# --- CPU overflow (issue #18) ----------------------------------------------------------------------------

from orchestrator.config.schema import HostResources, overflow_problems  # noqa: E402

BIG = HostResources(cores=8, mem_available_mb=16000)


def test_overflow_cpu_fits_and_defaults_to_one_core(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, {"apps": [_app(overflow="cpu"), _app(name="b", overflow="cpu",
                                                                              overflow_cores=3)]}), host=BIG)
    assert [a.cpu_overflow_cores for a in cfg.apps] == [1, 3]
    assert cfg.apps[0].overflow_alpha_ms == 0.1 and cfg.node.overflow_reserved_cores == 1


def test_overflow_pools_that_exceed_the_cores_are_refused_with_the_reason(tmp_path: Path) -> None:
    data = {"apps": [_app(overflow="cpu", overflow_cores=4), _app(name="b", overflow="cpu", overflow_cores=4)]}
    err = _refused(tmp_path, data, "apps: CPU overflow pools need 8 cores (a 4, b 4)",
                   "node.overflow_reserved_cores=1", "this host has 8", host=BIG)
    assert err.problems[0][0] == "apps"
    _refused(tmp_path, {"apps": [_app(overflow="cpu", overflow_cores=2)]}, "apps[0].overflow_cores: 2 cores",
             "exceed the host's 2", host=HostResources(cores=2, mem_available_mb=16000))


def test_overflow_pools_that_exceed_the_memory_are_refused_with_the_reason(tmp_path: Path) -> None:
    # VGG-19 holds 548 MB of weights; 500 MB free allows 400.
    # 548 MB of weights plus 8 requests in and out (9 MB) for app a.
    _refused(tmp_path, {"apps": [_app(model="vgg19", overflow="cpu")]}, "CPU overflow pools need 557 MB",
             "(a 557 MB)", "80% of the 500 MB available", host=HostResources(cores=8, mem_available_mb=500))


def test_overflow_memory_counts_every_stage_and_skips_user_models() -> None:
    cfg = NodeConfig.model_validate({"apps": [
        {"name": "d", "slo_ms": 50, "overflow": "cpu", "stages": [
            {"name": "r", "model": "mobilenet_v2", "routes": ["f"]}, {"name": "f", "model": "pkg.m:make"}]}]})
    seen: list[str] = []

    def mb(ref: str, shape: tuple[int, int, int], classes: int | None) -> float | None:
        seen.append(ref)
        return None if ":" in ref else 1000.0

    assert overflow_problems(cfg, HostResources(cores=4, mem_available_mb=2000), mb) == []
    assert seen == ["mobilenet_v2", "pkg.m:make"]
    probs = overflow_problems(cfg, HostResources(cores=4, mem_available_mb=1000), mb)
    assert probs == [("apps", "CPU overflow pools need 1009 MB of host memory (d 1009 MB), more than 80% of "
                              "the 1000 MB available")]


def test_overflow_cores_without_overflow_is_refused(tmp_path: Path) -> None:
    _refused(tmp_path, {"apps": [_app(overflow_cores=2)]}, "apps[0].overflow_cores: applies only with overflow: cpu")
    _refused(tmp_path, {"apps": [_app(overflow="gpu")]}, "apps[0].overflow")
    _refused(tmp_path, {"apps": [_app(overflow="cpu", overflow_cores=0)]}, "apps[0].overflow_cores")


# -- engine: (gpuprims.engines) -------------------------------------------------------------------------------

#: A kind that runs only on cuda, with one option (registered for these tests only). Its module does not
#: exist: validating an app that names it imports no engine module.
GPUONLY = EngineKind("gpuonly", "tests.no_such_engine_module:GpuOnlyEngine", needs_torch=False, backends=("cuda",),
                     options={"precision": "fp32"})


@pytest.fixture
def gpuonly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(ENGINE_KINDS, "gpuonly", GPUONLY)


def test_engine_by_name_or_mapping(tmp_path: Path, gpuonly: None) -> None:
    cfg = load_config(_write(tmp_path, {"node": {"backend": "cuda"}, "apps": [
        _app(), _app(name="b", engine="gpuonly"), _app(name="c", engine={"kind": "gpuonly", "precision": "fp16"})]}))
    assert [(a.engine.kind, a.engine.options) for a in cfg.apps] == [
        ("eager", {}), ("gpuonly", {}), ("gpuonly", {"precision": "fp16"})]
    assert cfg.apps[2].model_dump()["engine"] == {"kind": "gpuonly", "precision": "fp16"}
    assert NodeConfig.model_validate_json(cfg.model_dump_json()) == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg


def test_a_gpu_only_engine_on_the_cpu_backend_is_refused_naming_the_app_and_key(tmp_path: Path,
                                                                                gpuonly: None) -> None:
    e = _refused(tmp_path, {"node": {"backend": "cpu"}, "apps": [_app(), _app(name="fast", engine="gpuonly")]},
                 "apps[1].engine: app 'fast': engine 'gpuonly' needs the cuda backend; this node runs on cpu")
    assert len(e.problems) == 1 and "\n" not in str(e)
    # with backend: auto the file loads; validate and start check it once the backend is known
    cfg = load_config(_write(tmp_path, {"apps": [_app(name="fast", engine="gpuonly")]}))
    assert engine_problems(cfg, "cpu") == [("apps[0].engine", "app 'fast': engine 'gpuonly' needs the cuda "
                                                              "backend; this node runs on cpu")]
    assert engine_problems(cfg, "cuda") == []


@pytest.mark.parametrize(("engine", "fragments"), [
    ("tensorrt-x", ("apps[0].engine", "unknown engine 'tensorrt-x'", "known engines: eager")),
    ({"kind": "eager", "threads": 2}, ("apps[0].engine", "engine 'eager' has no option(s) ['threads']")),
    ({"provider": "cpu"}, ("apps[0].engine", "needs 'kind'")),
    (3, ("apps[0].engine", "must be an engine name")),
])
def test_bad_engines_are_refused_by_name(tmp_path: Path, engine: Any, fragments: tuple[str, ...]) -> None:
    _refused(tmp_path, {"apps": [_app(engine=engine)]}, *fragments)


def test_dag_stage_engines(tmp_path: Path, gpuonly: None) -> None:
    stages = [{"name": "r", "model": "recog_router", "routes": ["f"]},
              {"name": "f", "model": "vgg_face", "engine": "gpuonly"}]
    cfg = load_config(_write(tmp_path, {"node": {"backend": "cuda"}, "apps": [
        {"name": "d", "slo_ms": 100, "stages": stages}]}))
    assert [e.kind for _, e in cfg.apps[0].engines()] == ["eager", "gpuonly"]
    _refused(tmp_path, {"node": {"backend": "cpu"}, "apps": [{"name": "d", "slo_ms": 100, "stages": stages}]},
             "apps[0].stages[1].engine: app 'd': engine 'gpuonly' needs the cuda backend")


def test_overflow_engine(tmp_path: Path, gpuonly: None) -> None:
    cfg = load_config(_write(tmp_path, {"node": {"backend": "cuda"}, "apps": [
        _app(engine="gpuonly", overflow="cpu"), _app(name="b", overflow="cpu", overflow_engine="eager")]}),
        host=HostResources(cores=64, mem_available_mb=1e6))
    assert cfg.apps[0].cpu_overflow_engine.kind == "eager"  # the app's engine does not run on the cpu
    assert cfg.apps[1].cpu_overflow_engine.kind == "eager"
    _refused(tmp_path, {"apps": [_app(overflow="cpu", overflow_engine="gpuonly")]},
             "apps[0].overflow_engine: app 'a': engine 'gpuonly' needs the cuda backend",
             host=HostResources(cores=64, mem_available_mb=1e6))
    _refused(tmp_path, {"apps": [_app(overflow_engine="eager")]}, "apps[0].overflow_engine: applies only with "
                                                                  "overflow: cpu")


def test_engine_cache_setting(tmp_path: Path) -> None:
    assert load_config(_write(tmp_path, {"apps": [_app()]})).node.engine_cache is None
    cfg = load_config(_write(tmp_path, {"node": {"engine_cache": str(tmp_path / "c")}, "apps": [_app()]}))
    assert cfg.node.engine_cache == str(tmp_path / "c")
    _refused(tmp_path, {"node": {"engine_cache": " "}, "apps": [_app()]}, "node.engine_cache: must be a directory")


def test_node_tls_and_auth_are_checked(tmp_path: Path) -> None:
    front = {"http_port": 8000, "grpc_port": 8001}
    cfg = load_config(_write(tmp_path, {"node": {**front, "tls": {"cert": "s.pem", "key": "s.key", "ca": "ca.pem"},
                                                 "auth": {"token_env": "GPUPRIMS_TOKEN"}}, "apps": [_app()]}))
    assert cfg.node.tls is not None and (cfg.node.tls.cert, cfg.node.tls.key, cfg.node.tls.ca) == ("s.pem", "s.key", "ca.pem")
    assert cfg.node.auth.has_token and not load_config(_write(tmp_path, {"apps": [_app()]})).node.auth.has_token
    _refused(tmp_path, {"node": {**front, "tls": {"cert": "s.pem"}}, "apps": [_app()]}, "node.tls.key")
    _refused(tmp_path, {"node": {**front, "tls": {"cert": " ", "key": "k"}}, "apps": [_app()]}, "node.tls.cert",
             "PEM file path")
    _refused(tmp_path, {"node": {**front, "tls": {"cert": "c", "key": "k", "certs": "x"}}, "apps": [_app()]},
             "node.tls.certs")
    _refused(tmp_path, {"node": {**front, "auth": {"token_file": "t", "token_env": "T"}}, "apps": [_app()]},
             "node.auth.token_env", "not both")
    _refused(tmp_path, {"node": {"tls": {"cert": "c", "key": "k"}}, "apps": [_app()]}, "node.tls",
             "set node.http_port or grpc_port")
    _refused(tmp_path, {"node": {"auth": {"token_env": "T"}}, "apps": [_app()]}, "node.auth", "front door")
