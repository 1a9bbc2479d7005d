"""``node_factory``: the nodes of the orchestrator's tests, on played instances unless a test is marked ``real``.

A node's rules (supervision, changes, dispatch, the repository) run in the test's own process: the node
is handed the launcher double of tests/orchestrator/fake_launcher.py over the in-process control plane, in
front of its real packet pool, ingest, control server and front door, and the test plays each instance's
Ready, heartbeats, errors and exits (``played(node)``). A test marked ``real`` (``@pytest.mark.real``, on
the function, its class, its module or one of its parameters) gets the same node with real instance
processes from the fork server; only such a test can check what a model answers, or what a crash, a
signal or a socket does to a process. Every node the factory made is stopped, and each played instance
ended, when the test ends, even a node whose test failed midway.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

from orchestrator.config.schema import NodeConfig
from orchestrator.control.spec import InstanceSpec
from orchestrator.node.node import Node
from tests.orchestrator.fake_launcher import FakeInstance, FakeLauncher

#: Node arguments a played node gets unless the test names them: no warm-up and no Param-Share holder
#: (both would run models), a short wait for Ready (a played instance says it at once).
PLAYED_DEFAULTS: dict[str, Any] = {"warmup": False, "share_params": False, "ready_timeout_s": 30.0}

NodeFactory = Callable[..., Node]


class PlayedLauncher(FakeLauncher):
    """The launcher double with two plays per app: an instance of an app in ``fail_apps`` reports that
    ``(kind, message)`` Error instead of Ready and exits 1, as one whose model cannot be imported does; an
    initialised instance of an app in ``ready_info`` says that besides "initialized" in its Ready (a
    dispatched instance's warm-up ``measured`` latencies, for one)."""

    def __init__(self, *, auto_ready: bool = True) -> None:
        super().__init__(auto_ready=auto_ready)
        self.fail_apps: dict[str, tuple[str, str]] = {}
        self.ready_info: dict[str, dict[str, Any]] = {}

    def launch(self, spec: InstanceSpec, env: Mapping[str, str]) -> FakeInstance:
        failure, info = self.fail_apps.get(spec.app), self.ready_info.get(spec.app)
        if failure is None and info is None:
            return super().launch(spec, env)
        auto, self.auto_ready = self.auto_ready, False
        try:
            inst = super().launch(spec, env)
        finally:
            self.auto_ready = auto
        if failure is not None:
            inst.error(*failure)
            inst.die(1)
        elif auto:
            inst.ready(initialized=not spec.defer_init, **({} if spec.defer_init else info or {}))
        return inst


def is_real(item: pytest.Item) -> bool:
    """True when ``item`` (a test) asked for real instance processes with the ``real`` marker."""
    return item.get_closest_marker("real") is not None


def played(node: Node) -> PlayedLauncher:
    """The launcher double of a node made on played instances (fails the test for a node with real ones)."""
    assert isinstance(node.launcher, PlayedLauncher), "this node runs real instance processes (marked real)"
    return node.launcher


class _Factory:
    def __init__(self, real: bool) -> None:
        self.real = real
        self.nodes: list[Node] = []

    def __call__(self, cfg: NodeConfig, **kwargs: Any) -> Node:
        """A node (not started) for ``cfg``; ``kwargs`` go to `Node` (a played node's launcher and control
        plane are the factory's, and may not be given)."""
        if self.real:
            node = Node(cfg, **kwargs)
        else:
            clash = {"launcher", "control_kind"} & set(kwargs)
            if clash:
                raise TypeError(f"node_factory chooses {sorted(clash)} for a played node; mark the test real "
                                "to run real instance processes")
            node = Node(cfg, control_kind="inproc", launcher=PlayedLauncher(), **{**PLAYED_DEFAULTS, **kwargs})
        self.nodes.append(node)
        return node

    def close(self) -> None:
        for node in self.nodes:
            node.stop(drain=False)
            if isinstance(node.launcher, FakeLauncher):
                node.launcher.close()


@pytest.fixture
def node_factory(request: pytest.FixtureRequest) -> Iterator[NodeFactory]:
    """Makes nodes on played instances, or on real processes for a test marked ``real`` (module docstring)."""
    factory = _Factory(real=is_real(request.node))
    try:
        yield factory
    finally:
        factory.close()
