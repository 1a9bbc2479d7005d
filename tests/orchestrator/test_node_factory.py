"""``node_factory`` (tests/orchestrator/conftest.py): played instances by default, real ones for a test marked real."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from orchestrator.config.schema import NodeConfig, parse_config
from orchestrator.node.launcher import ForkLauncher
from tests.orchestrator.conftest import NodeFactory, PlayedLauncher, played


def _cfg(tmp_path: Path) -> NodeConfig:
    app: dict[str, Any] = {"name": "a", "model": "mobilenet_v2", "input_shape": [3, 8, 8], "slo_ms": 60_000,
                           "gpu_pct": 50, "max_batch": 4, "app_id": 1, "num_classes": 10, "shadow": True}
    return parse_config({"node": {"listen": {"host": "127.0.0.1", "port": 0}, "backend": "cpu",
                                  "run_dir": str(tmp_path / "run"),
                                  "pool": {"slot_count": 256, "max_chunks": 8, "record_count": 64}},
                         "apps": [app]})


def test_an_unmarked_test_gets_a_node_on_played_instances(tmp_path: Path, node_factory: NodeFactory) -> None:
    node = node_factory(_cfg(tmp_path))
    assert isinstance(node.launcher, PlayedLauncher) and node.control_kind == "inproc" and not node.warmup
    with node:
        launcher = played(node)
        assert sorted(i.spec.name for i in launcher.launched) == ["a-0", "a-s0"]
        assert node.instances["a-0"].ready and node.errors == {}
    assert all(i.returncode is not None for i in launcher.launched) and not node.instances


def test_a_played_node_keeps_its_launcher_and_control_plane(tmp_path: Path, node_factory: NodeFactory) -> None:
    with pytest.raises(TypeError, match=r"chooses \['control_kind', 'launcher'\].*mark the test real"):
        node_factory(_cfg(tmp_path), launcher=ForkLauncher(), control_kind="zmq")


def test_a_played_instance_that_fails_to_start_fails_the_start_naming_it(tmp_path: Path,
                                                                          node_factory: NodeFactory) -> None:
    node = node_factory(_cfg(tmp_path))
    played(node).fail_apps["a"] = ("model_load", "No module named 'x'")
    with pytest.raises(Exception, match=r"a-\w+ failed to start: model_load: No module named 'x'"):
        node.start()
    assert node.instances == {} and all(i.returncode is not None for i in played(node).launched)


def test_a_played_instance_says_the_ready_info_of_its_app(tmp_path: Path, node_factory: NodeFactory) -> None:
    node = node_factory(_cfg(tmp_path))
    played(node).ready_info["a"] = {"measured": {"main": {"1": 3.0}}}
    with node:
        # the initialised active says it; the shadow (not initialised) says only that
        assert node.instances["a-0"].info["measured"] == {"main": {"1": 3.0}}
        assert "measured" not in node.instances["a-s0"].info


@pytest.mark.real
def test_a_test_marked_real_gets_real_instance_processes(tmp_path: Path, node_factory: NodeFactory) -> None:
    node = node_factory(_cfg(tmp_path), warmup=False)  # not started: only who would start its instances
    assert isinstance(node.launcher, ForkLauncher) and node.control_kind == "zmq"
    with pytest.raises(AssertionError, match="real instance processes"):
        played(node)


@pytest.mark.parametrize("instances", ["played", pytest.param("real", marks=pytest.mark.real)])
def test_a_parameter_marked_real_gets_real_instance_processes(tmp_path: Path, node_factory: NodeFactory,
                                                              instances: str) -> None:
    node = node_factory(_cfg(tmp_path))
    assert isinstance(node.launcher, ForkLauncher if instances == "real" else PlayedLauncher)
