"""What the host offers the CPU overflow pools, read from the machine (orchestrator/config/host.py)."""

from __future__ import annotations

import os
from pathlib import Path

from orchestrator.config import schema
from orchestrator.config.host import HostResources, mem_available_mb, usable_cores


def test_host_probe_reads_this_machine() -> None:
    h = HostResources.probe()
    assert h.cores >= 1 and h.mem_available_mb > 0


def test_mem_available_is_read_from_meminfo_and_unknown_without_it(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384000 kB\nMemAvailable:    2048000 kB\n")
    assert mem_available_mb(meminfo) == 2000.0
    meminfo.write_text("MemTotal:       16384000 kB\n")
    assert mem_available_mb(meminfo) == 0.0  # a kernel without the line: nothing is known to be free
    assert mem_available_mb(tmp_path / "missing") == float("inf")  # unreadable: the pools are not held to it


def test_usable_cores_is_this_process_affinity() -> None:
    assert usable_cores() == max(1, len(os.sched_getaffinity(0)))


def test_the_schema_still_names_the_host_record_its_loader_takes() -> None:
    assert schema.HostResources is HostResources  # load_config(host=...) and the tests that import it there
