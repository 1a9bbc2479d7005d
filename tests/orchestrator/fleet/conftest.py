"""A real multi-node Ray cluster on loopback (ray.cluster_utils.Cluster) with token authentication:
a head and two gpuprims machines (the custom resource), small CPU counts for a two-core machine.
Only the tests that use it (and the modules that import ray) skip where Ray is not installed."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

#: Why the Ray tests skip where Ray is not installed (the tests of the parts that need no Ray still run).
NO_RAY = "the fleet extra is not installed (pip install -e '.[fleet]')"

#: Ray's own failure detection made quicker for the tests (defaults take tens of seconds), but slower
#: than the controller's suspicion (1 s), as on a real site.
FAST_HEALTH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 1000,
               "health_check_timeout_ms": 1000, "health_check_failure_threshold": 4}


@dataclass
class RayFleet:
    cluster: Any
    workers: list[Any]
    token: str

    def node_of(self, node_id: str) -> Any:
        return next(w for w in self.workers if w.node_id == node_id)


@pytest.fixture
def ray_fleet(monkeypatch: pytest.MonkeyPatch) -> Iterator[RayFleet]:
    ray = pytest.importorskip("ray", reason=NO_RAY)
    cluster_utils = pytest.importorskip("ray.cluster_utils", reason=NO_RAY)
    reset_auth_token_state = pytest.importorskip("ray._private.authentication_test_utils",
                                                 reason=NO_RAY).reset_auth_token_state
    token = secrets.token_hex(32)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", token)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    # Ray reads the auth mode into its config once per process: read it again now (ray 2.60's helper).
    reset_auth_token_state()
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "_system_config": FAST_HEALTH})
    try:
        workers = [cluster.add_node(num_cpus=1, resources={"gpuprims": 1}) for _ in range(2)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="gpuprims-fleet", log_to_driver=False)
        yield RayFleet(cluster, workers, token)
    finally:
        try:
            from orchestrator.fleet.controller import find_controller

            ctl = find_controller()
            ray.get(ctl.shutdown.remote(), timeout=120)
            ray.kill(ctl)
        except Exception:
            pass
        ray.shutdown()
        cluster.shutdown()
        monkeypatch.undo()
        reset_auth_token_state()
