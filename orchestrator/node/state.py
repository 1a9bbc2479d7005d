"""The node's bookkeeping: what it knows about each app and each instance process.

Plain records, shared by the node's parts (supervision, placement, routing, changes of share); none of
them owns another, and only the node's one loop writes them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from orchestrator.config.schema import AppConfig
from orchestrator.control.records import InstanceStats, Role
from orchestrator.control.spec import InstanceSpec
from orchestrator.control.stats import AppStatistics
from orchestrator.node.launcher import InstanceProcess

__all__ = ["AppState", "InstanceState", "InstanceTable", "Role"]


@dataclass
class InstanceState:
    """What the node knows about one instance process."""

    name: str
    app: str
    spec: InstanceSpec
    proc: InstanceProcess
    role: Role = Role.ACTIVE
    ready: bool = False
    initialized: bool = False
    stats: InstanceStats | None = None  # its last heartbeat, as its app's AppStatistics keeps it (None before)
    last_beat: float = 0.0
    started: float = field(default_factory=time.monotonic)
    ended: bool = False
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)  # what its Ready said
    replaces: str | None = None  # the active that died and that this one was started to replace
    killed: bool = False  # SIGKILLed by the node itself (Supervisor.kill), not a crash

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        """True while the process has not exited (as last polled)."""
        return self.proc.poll() is None


@dataclass
class AppState:
    """Per-app bookkeeping: its config, shares and lifetime counters across restarts."""

    cfg: AppConfig
    gpu_pct: int
    instances: int
    restarts: int = 0
    failed_by_crash: int = 0
    requeued_by_crash: int = 0
    hangs: int = 0
    shadow_restarts: int = 0
    stats: AppStatistics = field(default_factory=AppStatistics)  # the app's one statistics record

    def retire(self, st: InstanceState) -> None:
        """Fold a departing instance's counters (and batch counts and duration histograms) into the
        app's, so the app's totals never go back."""
        self.stats.retire(st.name)


class InstanceTable(dict[str, InstanceState]):
    """The node's instances by name, which also answers by app and role in one call (as Ray Serve's
    ``ReplicaStateContainer``): ``table.of("a", Role.ACTIVE)`` are app a's active instances."""

    def of(self, app: str, *roles: Role) -> list[InstanceState]:
        """App ``app``'s instances in any of ``roles`` (every role when none is given), oldest first."""
        return [st for st in self.values() if st.app == app and (not roles or st.role in roles)]

    def count(self, app: str, *roles: Role) -> int:
        """How many instances `of` gives."""
        return sum(1 for st in self.values() if st.app == app and (not roles or st.role in roles))

    def with_role(self, *roles: Role) -> Iterator[InstanceState]:
        """Every instance in any of ``roles``, of any app."""
        return (st for st in self.values() if st.role in roles)
