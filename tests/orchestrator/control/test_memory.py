"""orchestrator.control.memory: PSS from smaps_rollup (a bad file reads as None, counted), the sampler's pace, the
mapped-file ranking from smaps, and the CUDA layer's per-process count of device memory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuprims.cuda import runtime
from orchestrator.control.memory import (
    MemoryReading,
    MemorySampler,
    instance_device_bytes,
    mapped_files,
    parse_pss,
    parse_smaps,
    read_pss,
    total,
)

ROLLUP = """55d4c2a7e000-7ffd4a1f5000 ---p 00000000 00:00 0                          [rollup]
Rss:              204800 kB
Pss:              161234 kB
Pss_Dirty:         40000 kB
Pss_Anon:          39000 kB
Shared_Clean:     150000 kB
"""

SMAPS = """7f0000000000-7f0000100000 r-xp 00000000 08:01 1234                       /usr/lib/libtorch_cpu.so
Size:               1024 kB
Rss:                1024 kB
Pss:                 512 kB
7f0000100000-7f0000200000 r--p 00100000 08:01 1234                       /usr/lib/libtorch_cpu.so
Pss:                 256 kB
7f0000200000-7f0000300000 rw-p 00000000 00:00 0
Pss:                 300 kB
7f0000300000-7f0000400000 r-xp 00000000 08:01 99                         /usr/lib/libonnxruntime.so.1
Pss:                 100 kB
VmFlags: rd ex mr mw me sd
"""


def _proc(tmp_path: Path, pid: int, name: str, text: str | bytes) -> Path:
    d = tmp_path / str(pid)
    d.mkdir(exist_ok=True)
    (d / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    return tmp_path


def test_parse_pss_reads_kib_as_bytes() -> None:
    assert parse_pss(ROLLUP) == 161234 * 1024


@pytest.mark.parametrize("text", ["", "Rss: 100 kB\n", "Pss: lots kB\n", "Pss: 12 MB\n", "Pss_Dirty: 5 kB\n",
                                  "\x00\xff garbage"])
def test_a_garbled_rollup_reads_as_none(text: str) -> None:
    assert parse_pss(text) is None


def test_read_pss_of_a_missing_or_garbled_file_is_none(tmp_path: Path) -> None:
    assert read_pss(4242, tmp_path) is None  # no such process
    proc = _proc(tmp_path, 7, "smaps_rollup", b"Pss:\xff\xfe 12 kB\n")
    assert read_pss(7, proc) is None
    _proc(tmp_path, 8, "smaps_rollup", ROLLUP)
    assert read_pss(8, proc) == 161234 * 1024


def test_read_pss_of_this_process() -> None:
    pss = read_pss(os.getpid())
    assert pss is not None and pss > 1 << 20  # an interpreter with numpy holds more than a MiB


def test_the_sampler_spreads_its_reads_keeps_its_pace_and_counts_what_it_cannot_read(tmp_path: Path) -> None:
    _proc(tmp_path, 8, "smaps_rollup", ROLLUP)
    _proc(tmp_path, 9, "smaps_rollup", "garbage\n")
    s = MemorySampler(interval_s=5.0, max_reads=2, proc=tmp_path)
    assert s.sample(100.0, [8, 9, 10, 8]) == 2  # two reads per call, never-read pids first
    assert s.pss == {8: 161234 * 1024, 9: None} and s.unreadable == 1
    assert s.sample(100.1, [8, 9, 10]) == 1  # 10 now; 8 and 9 are not due for 5 s
    assert s.pss == {8: 161234 * 1024, 9: None, 10: None} and s.unreadable == 2
    assert s.get(8) == 161234 * 1024 and s.get(None) is None and s.get(11) is None
    _proc(tmp_path, 9, "smaps_rollup", ROLLUP)
    assert s.sample(104.0, [8, 9, 10]) == 0  # too soon: the last readings stay
    assert s.get(9) is None
    assert s.sample(105.0, [9]) == 1  # pids no longer given are dropped
    assert s.pss == {9: 161234 * 1024} and s.unreadable == 2
    with pytest.raises(ValueError, match="interval_s"):
        MemorySampler(interval_s=-1)
    with pytest.raises(ValueError, match="max_reads"):
        MemorySampler(max_reads=0)


def test_readings_add_with_unknown_parts() -> None:
    a, b = MemoryReading(100, None), MemoryReading(None, 7)
    assert a + b == MemoryReading(100, 7)
    assert total([a, b, MemoryReading(1, 3)]) == MemoryReading(101, 10)
    assert total([]) == MemoryReading(None, None)
    assert MemoryReading(5).to_dict() == {"pss_bytes": 5, "device_bytes": None}


def test_mapped_files_rank_paths_by_pss(tmp_path: Path) -> None:
    assert parse_smaps(SMAPS) == {"/usr/lib/libtorch_cpu.so": 768 * 1024, "[anon]": 300 * 1024,
                                  "/usr/lib/libonnxruntime.so.1": 100 * 1024}
    proc = _proc(tmp_path, 5, "smaps", SMAPS)
    top = mapped_files(5, top=2, proc=proc)
    assert [(m.path, m.pss_bytes) for m in top] == [("/usr/lib/libtorch_cpu.so", 768 * 1024),
                                                    ("[anon]", 300 * 1024)]
    assert mapped_files(6, proc=proc) == []  # unreadable: nothing, no error


def test_device_memory_is_counted_per_process_on_the_fake_runtime(fake_cuda: object) -> None:
    before = runtime.device_bytes_in_use()
    assert instance_device_bytes("cpu") is None
    mem = runtime.DeviceMemory(1 << 16, 0)
    try:
        assert runtime.device_bytes_in_use() == before + (1 << 16)
        assert runtime.device_bytes_in_use(0) >= 1 << 16 and runtime.device_bytes_in_use(5) == 0
        assert instance_device_bytes("cuda") == before + (1 << 16)  # torch has not initialised CUDA here
    finally:
        mem.close()
    assert runtime.device_bytes_in_use() == before
    mem.close()  # closing twice frees once
    assert runtime.device_bytes_in_use() == before
