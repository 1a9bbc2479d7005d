"""What the node's processes cost in memory: proportional set size (PSS) and the instances' device memory.

PSS is a process's resident memory with every shared page divided among the processes that map it, so
the PSS of a node's processes adds up to what the whole tree holds (RSS would count torch's pages, which
the fork servers and their instances share, once per process). It is read from
``/proc/<pid>/smaps_rollup`` (Linux 4.14+): one file, but one kernel walk of the process's page
tables (milliseconds for a process with torch mapped), so the node reads each of its processes once
every :data:`MEMORY_INTERVAL_S`, a couple per pass of its loop (:class:`MemorySampler`), never at a
status call or a scrape. A file that is missing (the process exited, an older kernel) or that does not say ``Pss:``
reads as None and is counted in :attr:`MemorySampler.unreadable`, never an error.

Device memory is the instance's own count (its heartbeat's ``device_bytes``): what it allocated through
the CUDA layer (:func:`gpuprims.cuda.runtime.device_bytes_in_use`) plus what torch's caching allocator
holds reserved, so it is per process where ``cudaMemGetInfo`` is per device. Weights mapped from a
Param-Share holder count in no instance (the holder allocated them).

:func:`mapped_files` (``/proc/<pid>/smaps``, the full walk: for benchmarks, not the node's loop) says
which mapped files hold a process's PSS, so a footprint that misses its goal names what holds memory.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gpuprims.cuda import runtime

log = logging.getLogger("gpuprims.memory")

#: How often the node reads each of its processes' PSS (seconds): the figure moves slowly, and a read
#: costs a walk of the process's page tables.
MEMORY_INTERVAL_S = 5.0

_PSS = re.compile(r"^Pss:\s+(\d+)\s+kB\s*$", re.MULTILINE)
#: A mapping's header line in smaps: ``start-end perms offset dev inode [path]``.
_MAP_HEAD = re.compile(r"^[0-9a-f]+-[0-9a-f]+\s+\S{4}\s+[0-9a-f]+\s+\S+\s+\d+\s*(.*)$")


@dataclass(frozen=True)
class MemoryReading:
    """One process's (or a sum of processes') memory, in bytes; None where it is not known (unreadable
    ``smaps_rollup``; no device memory on the CPU backend or before the first heartbeat)."""

    pss_bytes: int | None = None
    device_bytes: int | None = None

    def __add__(self, other: MemoryReading) -> MemoryReading:
        return MemoryReading(_add(self.pss_bytes, other.pss_bytes), _add(self.device_bytes, other.device_bytes))

    def to_dict(self) -> dict[str, int | None]:
        return {"pss_bytes": self.pss_bytes, "device_bytes": self.device_bytes}


def total(readings: Iterable[MemoryReading]) -> MemoryReading:
    """The sum of the readings; a part is None only when it is None in every reading."""
    out = MemoryReading()
    for r in readings:
        out = out + r
    return out


def _add(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    return a if b is None else a + b


@dataclass(frozen=True)
class ProcessMemory:
    """A process of the node's other than its instances: the node itself, a fork server, a Param-Share
    holder (``kind``), with its PSS."""

    kind: str
    pid: int
    pss_bytes: int | None

    def to_dict(self) -> dict[str, str | int | None]:
        return {"kind": self.kind, "pid": self.pid, "pss_bytes": self.pss_bytes}


@dataclass(frozen=True)
class NodeMemory:
    """The node's whole tree: its own processes (node, fork servers, Param-Share holders), the sum of
    its instances, and the total of both; ``unreadable`` counts PSS reads that gave nothing."""

    processes: tuple[ProcessMemory, ...]
    instances: MemoryReading
    total: MemoryReading
    unreadable: int = 0

    def to_dict(self) -> dict[str, object]:
        return {"processes": [p.to_dict() for p in self.processes], "instances": self.instances.to_dict(),
                "total": self.total.to_dict(), "unreadable": self.unreadable}


def parse_pss(text: str) -> int | None:
    """The ``Pss:`` of a ``smaps_rollup`` text in bytes, or None when it has no well-formed one."""
    m = _PSS.search(text)
    return int(m.group(1)) * 1024 if m else None


def read_pss(pid: int, proc: Path = Path("/proc")) -> int | None:
    """Process ``pid``'s PSS in bytes from ``/proc/<pid>/smaps_rollup``, or None if it cannot be read
    (gone, not ours, an older kernel) or says no ``Pss:``."""
    try:
        text = (proc / str(pid) / "smaps_rollup").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    return parse_pss(text)


@dataclass(frozen=True)
class MappedFile:
    """One mapped file (or ``[heap]``, ``[anon]``...) of a process and the PSS its mappings hold."""

    path: str
    pss_bytes: int


def parse_smaps(text: str) -> dict[str, int]:
    """PSS in bytes by mapped path from a ``/proc/<pid>/smaps`` text; anonymous mappings are ``[anon]``.
    Lines it does not know are skipped."""
    out: dict[str, int] = {}
    current: str | None = None
    for line in text.splitlines():
        head = _MAP_HEAD.match(line)
        if head is not None:
            current = head.group(1).strip() or "[anon]"
            continue
        m = _PSS.match(line)
        if m is not None and current is not None:
            out[current] = out.get(current, 0) + int(m.group(1)) * 1024
    return out


def mapped_files(pid: int, top: int = 10, proc: Path = Path("/proc")) -> list[MappedFile]:
    """The ``top`` paths holding the most of process ``pid``'s PSS, largest first ([] if unreadable)."""
    try:
        text = (proc / str(pid) / "smaps").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    by_path = parse_smaps(text)
    ranked = sorted(by_path.items(), key=lambda kv: (-kv[1], kv[0]))[:max(0, top)]
    return [MappedFile(p, b) for p, b in ranked]


def instance_device_bytes(backend: str) -> int | None:
    """This process's device memory (an instance's, for its heartbeat): what it allocated through the
    CUDA layer plus what torch's caching allocator holds reserved on its current device, if torch has
    initialised CUDA here; None on the CPU backend."""
    if backend != "cuda":
        return None
    n = runtime.device_bytes_in_use()
    torch = sys.modules.get("torch")  # only if the instance imported it: an ORT instance need not
    if torch is not None and torch.cuda.is_initialized():
        n += int(torch.cuda.memory_reserved())
    return n


class MemorySampler:
    """The node's reader of its processes' PSS. :meth:`sample`, called from each pass of the node's loop,
    reads the pids whose last reading is older than ``interval_s`` (never-read ones first), at most
    ``max_reads`` of them per call: a read walks the process's page tables (2-10 ms for a 170 MB
    process with torch mapped, more on a loaded machine), so the reads are spread over the loop's passes
    instead of stalling one. Readings of pids no longer given are dropped."""

    def __init__(self, interval_s: float = MEMORY_INTERVAL_S, max_reads: int = 2, proc: Path = Path("/proc")) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s!r}")
        if max_reads < 1:
            raise ValueError(f"max_reads must be >= 1, got {max_reads!r}")
        self.interval_s = interval_s
        self.max_reads = max_reads
        self.proc = proc
        self.pss: dict[int, int | None] = {}
        #: Reads that gave no PSS (the process exited between listing and reading, an older kernel).
        self.unreadable = 0
        self._read_at: dict[int, float] = {}

    def sample(self, now: float, pids: Iterable[int]) -> int:
        """Read the PSS of up to ``max_reads`` of ``pids`` that are due; returns how many were read."""
        given = dict.fromkeys(pids)
        for gone in [p for p in self._read_at if p not in given]:
            del self._read_at[gone]
            self.pss.pop(gone, None)
        due = sorted((self._read_at.get(p, -1.0), p) for p in given
                     if p not in self._read_at or now - self._read_at[p] >= self.interval_s)
        for _, pid in due[:self.max_reads]:
            self.pss[pid] = v = read_pss(pid, self.proc)
            self._read_at[pid] = now
            if v is None:
                self.unreadable += 1
        return min(len(due), self.max_reads)

    def get(self, pid: int | None) -> int | None:
        """The last PSS read of ``pid`` (None: not read yet, or unreadable)."""
        return None if pid is None else self.pss.get(pid)
