"""The example Triton model repository (examples/model_repository.py) and its client (examples/
repository_client.py): the build is deterministic, the node's reader accepts every model with the engine
its file wants, each file answers as its config says, and a real node serving the repository answers
every model over HTTP, gRPC and UDP as the file run directly."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from gpuprims.engines.files import resolve_file_kind
from orchestrator.cli.main import main as cli_main
from orchestrator.config.schema import NodeConfig, load_config, parse_config
from orchestrator.node.node import Node

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
# The example scripts are scripts, not a package: their directory is how they import each other too.
sys.path.insert(0, str(EXAMPLES))

import model_repository  # noqa: E402
import repository_client  # noqa: E402

#: The engine the node runs each model with on a CPU (docs/model-repository.md, "Which engine runs a model").
ENGINES = {"mixed": "onnxruntime", "ocr": "onnxruntime", "noconfig": "onnxruntime", "detector": "onnxruntime",
           "scripted": "torchscript", "exported": "torch_export"}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_repository.build(tmp_path_factory.mktemp("example") / "repository")


def _files(root: Path) -> dict[str, bytes | dict[str, bytes]]:
    """Every file of the repository by its path: its bytes, or for a torch archive (a zip) its records but
    ``.data/serialization_id``, an id torch stamps on each save (it differs between two saves of the same
    module in some processes and not in others; torch.load reports it as metadata only)."""
    out: dict[str, bytes | dict[str, bytes]] = {}
    for p in sorted(root.rglob("*")):
        if not p.is_file():
            continue
        if zipfile.is_zipfile(p):
            with zipfile.ZipFile(p) as z:
                out[str(p.relative_to(root))] = {i: z.read(i) for i in z.namelist()
                                                 if not i.endswith(".data/serialization_id")}
        else:
            out[str(p.relative_to(root))] = p.read_bytes()
    return out


@pytest.mark.slow
def test_the_repository_holds_six_models_in_tritons_layout(repo: Path) -> None:
    assert sorted(p.name for p in repo.iterdir()) == sorted(model_repository.MODELS)
    for name, rel in model_repository.MODELS.items():
        assert (repo / rel).is_file(), rel
        assert (repo / name / "config.pbtxt").is_file() == (name != "noconfig")


@pytest.mark.slow
def test_two_builds_in_two_processes_are_identical(repo: Path, tmp_path: Path) -> None:
    """The script run as a user runs it (another process, its own seeds) writes the same bytes: the ONNX
    files and configs byte for byte, the torch archives record for record."""
    out = tmp_path / "again"
    # Another string hash seed too: nothing written may follow the order of a set.
    r = subprocess.run([sys.executable, str(EXAMPLES / "model_repository.py"), str(out)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "gpuprims-orchestrator start --model-repository" in r.stdout
    first, second = _files(repo), _files(out)
    assert sorted(first) == sorted(second)
    assert sum(isinstance(v, dict) for v in first.values()) == 2  # model.pt and model.pt2
    differ = {name: sorted(k for k in a if a[k] != b.get(k)) if isinstance(a, dict) and isinstance(b, dict) else "bytes"
              for name, a, b in ((n, first[n], second[n]) for n in first) if a != b}
    assert differ == {}


def _repository_node(repo: Path, **node: object) -> NodeConfig:
    return parse_config({"node": {"listen": {"host": "127.0.0.1", "port": 0}, "backend": "cpu",
                                  "model_repository": str(repo), **node}, "apps": []}, source="test")


@pytest.mark.slow
def test_the_node_reads_every_model_with_the_engine_its_file_wants(repo: Path) -> None:
    cfg = _repository_node(repo)
    assert not cfg.unavailable, cfg.unavailable
    apps = {a.name: a for a in cfg.apps}
    # The kind the instance runs (an app's engine: eager on a torch file is that file run by torch as it is).
    assert {n: resolve_file_kind(a.engine.kind, str(a.model)) for n, a in apps.items()} == ENGINES
    # The shares: 85% written, noconfig's auto takes what is left, so they fit one device.
    assert {n: a.gpu_pct for n, a in apps.items()} == {"mixed": 20, "ocr": 20, "scripted": 15, "exported": 15,
                                                       "detector": 15, "noconfig": "auto"}
    assert apps["detector"].max_batch == 1 and apps["mixed"].max_batch == 8
    assert apps["noconfig"].max_batch == 4  # completed from the file as Triton would: batched, 4
    # `validate`, as a user checks a repository, says ok with every model available.
    r = CliRunner().invoke(cli_main, ["validate", "--model-repository", str(repo)])
    assert r.exit_code == 0, r.output
    assert "UNAVAILABLE" not in r.output and r.output.strip().endswith(": ok"), r.output
    for name in ENGINES:
        assert f"{name}: app_id" in r.output


def _signature(repo: Path) -> dict[str, repository_client.Model]:
    """Each model as the client reads it from a node, built here from the repository's own reader."""
    from gpuprims.modelrepo import scan

    out = {}
    for i, m in enumerate(scan(repo, torch_ok=True)):
        assert m.error is None and m.config is not None, (m.name, m.error)
        cfg = m.config.to_dict()
        out[m.name] = repository_client.Model(
            name=m.name, inputs=repository_client._tensors(cfg["input"]),
            outputs=repository_client._tensors(cfg["output"]), max_batch_size=int(cfg.get("max_batch_size", 0)),
            app_id=i + 1, file=repository_client.model_file(repo, m.name))
    return out


def test_each_file_answers_as_its_config_says(repo: Path) -> None:
    """The oracle the client compares with: every model's file takes the client's requests and gives the
    config's outputs with their datatypes; the dynamic model answers several widths, the detector
    outputs of several sizes (none for a blank image)."""
    models = _signature(repo)
    assert sorted(models) == sorted(model_repository.MODELS)
    sizes: dict[str, set[tuple[int, ...]]] = {}
    for name, m in models.items():
        oracle = repository_client.Oracle(m)
        for x in repository_client.requests_for(m):
            batch = {k: v[None] for k, v in x.items()} if m.batched else x
            out = oracle(batch)
            assert list(out) == [t.name for t in m.outputs]
            for t in m.outputs:
                assert out[t.name].dtype == np.dtype(repository_client._NUMPY[t.datatype]), (name, t.name)
                lead = (1,) if m.batched else ()
                assert len(out[t.name].shape) == len(lead) + len(t.dims), (name, t.name)
                sizes.setdefault(f"{name}.{t.name}", set()).add(out[t.name].shape)
    assert len(sizes["ocr.logits"]) == 2  # one row per column: two widths, two shapes
    boxes = sizes["detector.boxes"]
    assert (0, 4) in boxes and len(boxes) >= 2, boxes
    assert {s[1:] for s in sizes["mixed.embedding"]} == {(16,)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def node(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    run = tmp_path_factory.mktemp("run")
    p = run / "apps.yaml"
    p.write_text(f"node:\n  listen: {{host: 127.0.0.1, port: 0}}\n  backend: cpu\n  run_dir: {run / 'node'}\n"
                 f"  http_port: {_free_port()}\n  grpc_port: {_free_port()}\n  autoscale: false\n"
                 f"  model_repository: {repo}\napps: []\n")
    cfg = load_config(p)
    # No shadow processes: this test checks answers, and six more instances would double its start.
    cfg = cfg.model_copy(update={"apps": tuple(a.model_copy(update={"shadow": False}) for a in cfg.apps)})
    n = Node(cfg, warmup=True, heartbeat_ms=100, ready_timeout_s=120).start()
    try:
        yield n
    finally:
        n.stop()


@pytest.mark.slow
def test_a_node_on_the_repository_answers_every_model_as_its_file(repo: Path, request: pytest.FixtureRequest) -> None:
    node: Node = request.getfixturevalue("node")
    assert node.frontdoor is not None and node.ingest is not None
    http = node.frontdoor.http_url.removeprefix("http://")  # type: ignore[union-attr]
    app_ids = {a.name: a.app_id for a in node.cfg.apps}
    rows, unavailable = repository_client.check_node(http, node.frontdoor.grpc_target,  # type: ignore[arg-type]
                                                     ("127.0.0.1", node.ingest.ports[0]), repo, app_ids)
    assert unavailable == {}
    assert sorted({r.model for r in rows}) == sorted(model_repository.MODELS)
    assert [f for f in repository_client.iter_failures(rows, unavailable)] == [], \
        repository_client.format_table(rows, unavailable)
    assert {r.path for r in rows} == {"http", "grpc", "udp"}


def test_compare_finds_a_wrong_answer() -> None:
    out = (repository_client.Tensor("a", "FP32", (2,)), repository_client.Tensor("b", "INT64", (1,)))
    want = {"a": np.array([1.0, 2.0], np.float32), "b": np.array([3], np.int64)}
    assert repository_client.compare(dict(want), want, out) == ([], 0.0)
    problems, worst = repository_client.compare({"a": np.array([1.0, 2.5], np.float32), "b": want["b"]}, want, out)
    assert problems == ["a: differs by up to 0.5"] and worst == 0.5
    problems, _ = repository_client.compare({"a": want["a"].astype(np.float64), "b": np.array([4], np.int64)}, want, out)
    assert problems == ["a: float64[2], the file gives float32[2]", "b: 1 of 1 elements differ"]
