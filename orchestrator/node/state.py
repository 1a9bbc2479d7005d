"""The node's bookkeeping: what it knows about each app and each instance process.

Plain records, shared by the node's parts (supervision, placement, routing, changes of share); none of
them owns another, and only the node's one loop writes them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from orchestrator.config.schema import AppConfig
from orchestrator.control.spec import InstanceSpec
from orchestrator.control.stats import AppStatistics
from orchestrator.node.launcher import InstanceProcess

#: An instance's role. ``active`` instances are routed to; a ``shadow`` waits (CPU side up, model not
#: loaded) for a change of share; ``finishing`` drains after a switch; ``stopping`` is on its way out.
ROLES = ("active", "shadow", "finishing", "stopping")


@dataclass
class InstanceState:
    """What the node knows about one instance process."""

    name: str
    app: str
    spec: InstanceSpec
    proc: InstanceProcess
    role: str = "active"  # one of ROLES
    ready: bool = False
    initialized: bool = False
    stats: dict[str, Any] = field(default_factory=dict)  # its last heartbeat, as its app's AppStatistics keeps it
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
