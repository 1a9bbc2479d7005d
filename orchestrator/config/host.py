"""What this host offers a node's CPU overflow pools: the one part of loading a config that reads the machine.

:meth:`HostResources.probe` reads the cores this process may use and the free memory; the schema
(``orchestrator.config.schema``, which reads nothing from the machine) checks the apps' CPU overflow
pools against such a record (``overflow_problems``): ``parse_config``'s ``host``, or this machine's probe.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["HostResources", "mem_available_mb", "usable_cores"]

#: Where Linux says how much memory is available.
MEMINFO = Path("/proc/meminfo")


def mem_available_mb(meminfo: Path = MEMINFO) -> float:
    """``MemAvailable`` of ``meminfo`` in MB; infinite where the file cannot be read (nothing to hold the
    pools to), 0 when it has no such line."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return float("inf")
    return 0.0


def usable_cores() -> int:
    """The cores this process may run on: its affinity set's size where the system has one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores)


class HostResources(BaseModel):
    """What this machine offers CPU overflow pools: cores this process may use and free memory (MB)."""

    model_config = ConfigDict(frozen=True)

    cores: int = Field(ge=1)
    mem_available_mb: float = Field(ge=0)

    @classmethod
    def probe(cls) -> HostResources:
        """This machine: the affinity set's size and ``MemAvailable`` from /proc/meminfo."""
        return cls(cores=usable_cores(), mem_available_mb=mem_available_mb())
