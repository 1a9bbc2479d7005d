"""The node keeps its own threads off its instances' cores (``node.pin_node_threads``), on played instances."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from gpuprims.cpushare import available_cores
from orchestrator.config.schema import parse_config
from orchestrator.node.node import Node
from tests.orchestrator.fake_launcher import FakeLauncher

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs at least two usable cores")]


def _thread_cores() -> list[set[int]]:
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            out.append(os.sched_getaffinity(int(tid)))
        except ProcessLookupError:
            continue
    return out


def _node(tmp_path: Path, gpu_pct: int, **node: Any) -> tuple[Node, FakeLauncher]:
    app = {"name": "a", "model": "mobilenet_v2", "input_shape": [3, 8, 8], "slo_ms": 60_000, "gpu_pct": gpu_pct,
           "max_batch": 4, "app_id": 1, "num_classes": 10}
    cfg = parse_config({"node": {"listen": {"host": "127.0.0.1", "port": 0}, "backend": "cpu",
                                 "run_dir": str(tmp_path / "run"),
                                 "pool": {"slot_count": 256, "max_chunks": 8, "record_count": 64}, **node},
                        "apps": [app]})
    launcher = FakeLauncher()
    return Node(cfg, control_kind="inproc", launcher=launcher, warmup=False, share_params=False,
                ready_timeout_s=30), launcher


def test_the_nodes_threads_run_on_the_cores_no_instance_holds_and_follow_the_shares(tmp_path: Path) -> None:
    base = available_cores()
    node, launcher = _node(tmp_path, 50)
    with node:
        held = set(launcher.by_name("a-0").spec.cores or ())
        free = [c for c in base if c not in held]
        assert held and free
        assert node.own_cores == free and node.status()["node"]["own_cores"] == free
        assert all(cores == set(free) for cores in _thread_cores())
        assert available_cores() == base  # what shares are planned over is unchanged
        # The instance now holds every core (as after a change to 100%): the threads may run anywhere.
        node.instances["a-0"].spec.cores = list(base)
        node.step(10)
        assert node.own_cores is None and all(cores == set(base) for cores in _thread_cores())
        node.instances["a-0"].spec.cores = sorted(held)
        deadline = time.monotonic() + 10
        while node.own_cores != free:
            assert time.monotonic() < deadline, "the node did not move its threads back"
            node.step(10)
        assert node.errors == {}
    assert all(cores == set(base) for cores in _thread_cores())
    assert node.status()["node"]["own_cores"] is None


def test_every_core_held_or_the_setting_off_leaves_the_threads_where_they_are(tmp_path: Path) -> None:
    base = set(available_cores())
    for pct, node_keys in ((100, {}), (50, {"pin_node_threads": False})):
        node, _ = _node(tmp_path / str(pct), pct, **node_keys)
        with node:
            assert node.own_cores is None
            assert all(cores == base for cores in _thread_cores())
