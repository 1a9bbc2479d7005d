"""What this host offers a node's CPU overflow pools, and whether a config's pools fit it.

The schema (``orchestrator.config.schema``) validates a config on its own; this module is the part of
loading that looks at the machine: :meth:`HostResources.probe` reads the cores this process may use and
the free memory, and :func:`overflow_problems` checks the apps' CPU overflow pools against them.
``parse_config`` runs that check (against ``host``, or this machine's probe) when an app asks for
``overflow: cpu``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # the schema imports this module to run the check
    from orchestrator.config.schema import NodeConfig

__all__ = ["OVERFLOW_MEM_FRACTION", "HostResources", "overflow_problems"]

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


#: Share of the host's free memory the overflow pools may plan to take.
OVERFLOW_MEM_FRACTION = 0.8


def _zoo_model_mb(ref: str, input_shape: tuple[int, int, int], num_classes: int | None) -> float | None:
    """Parameter and buffer memory (MB) of a zoo model (meta build: nothing allocated); None for a user
    model or a name the zoo does not know (those are checked elsewhere)."""
    if ":" in ref:
        return None
    from apps.zoo.registry import build_model, model_info  # torch: imported only when overflow is asked for

    try:
        return model_info(build_model(ref, device="meta", input_shape=input_shape,
                                      num_classes=num_classes))["total_bytes"] / 2**20
    except ValueError:
        return None


def overflow_problems(cfg: NodeConfig, host: HostResources,
                      model_mb: Any = _zoo_model_mb) -> list[tuple[str, str]]:
    """Why the CPU overflow pools of ``cfg`` cannot fit ``host`` (empty when they fit).

    Cores: every app's ``overflow_cores`` together, plus ``node.overflow_reserved_cores``, must not
    exceed the host's cores. Memory: each overflow app holds one CPU copy of its model(s) plus
    ``max_batch`` requests in and out; together at most ``OVERFLOW_MEM_FRACTION`` of the free memory.
    ``model_mb(ref, input_shape, num_classes)`` sizes a model (None: unknown, not counted).
    """
    apps = [(i, a) for i, a in enumerate(cfg.apps) if a.overflow == "cpu"]
    if not apps:
        return []
    problems: list[tuple[str, str]] = []
    reserved = cfg.node.overflow_reserved_cores
    total = sum(a.cpu_overflow_cores for _, a in apps)
    if total + reserved > host.cores:
        parts = ", ".join(f"{a.name} {a.cpu_overflow_cores}" for _, a in apps)
        problems.append(("apps", f"CPU overflow pools need {total} cores ({parts}) plus "
                                 f"node.overflow_reserved_cores={reserved}, but this host has {host.cores}; "
                                 f"lower overflow_cores or turn overflow off for an app"))
    for i, a in apps:
        if a.cpu_overflow_cores + reserved > host.cores:
            problems.append((f"apps[{i}].overflow_cores",
                             f"{a.cpu_overflow_cores} cores plus node.overflow_reserved_cores={reserved} exceed "
                             f"the host's {host.cores}"))
    need = 0.0
    sized: list[str] = []
    for _, a in apps:
        refs = [a.model] if a.stages is None else [s.model for s in a.stages]
        mb = [model_mb(r, a.input_shape, a.num_classes) for r in refs if r is not None]
        known = [m for m in mb if m is not None]
        if known:
            io_mb = 2 * a.max_batch * a.input_nbytes / 2**20
            need += sum(known) + io_mb
            sized.append(f"{a.name} {sum(known) + io_mb:.0f} MB")
    budget = OVERFLOW_MEM_FRACTION * host.mem_available_mb
    if need > budget:
        problems.append(("apps", f"CPU overflow pools need {need:.0f} MB of host memory ({', '.join(sized)}), more "
                                 f"than {OVERFLOW_MEM_FRACTION:.0%} of the {host.mem_available_mb:.0f} MB available"))
    return problems
