"""The GPU-DMA kernel source (``native/cuda/dma.cu``) built unchanged with g++ against a host shim of
the CUDA runtime (``native/host_shim/``) and run on the CPU, case by case beside the CPU reference
(``_native.dma_gather_cpu``): same bytes, same verdicts, same count, for every shape and corruption.

No GPU is needed. :func:`build` compiles the shared library (plain, or with ASan+UBSan); :func:`cases`
makes the cases (payload sizes around chunk boundaries, chunk payloads that are not multiples of 16,
copy and uint8->float32 with 1, 3 and 4 channels, misaligned destinations, row padding, blocks per
row, every header field corrupted at several chunks, bad records); :func:`compare` runs one case on
both and reports the differences. ``tests/gpuprims/testing/test_hostsim.py`` runs a quick set in the
suite; ``bench/kernel_host.py`` the full sweep under the sanitizers.

Sanitized builds are loaded into a child Python with the sanitizer runtimes preloaded
(:func:`sanitizer_env`), since an ASan library cannot be loaded into an uninstrumented process.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpuprims import wire
from gpuprims.cuda import runtime
from gpuprims.cuda.dma import IMAGENET, UNIT, Normalize, PoolLayout
from gpuprims.testing.synthetic import STATE_FILLING, SyntheticPool

ROOT = Path(__file__).resolve().parents[2]
SOURCES = (ROOT / "native/cuda/dma.cu", ROOT / "native/host_shim/shim_entry.cpp")
HEADERS = (ROOT / "native/host_shim/cuda_runtime.h", ROOT / "native/include/gpuprims/cuda_dma.h",
           ROOT / "native/include/gpuprims/cuda_kernels.h", ROOT / "native/include/gpuprims/wire.h")
# -ffp-contract=off: the shim's __fmul_rn/__fadd_rn must stay separate roundings, as on the GPU.
BASE_FLAGS = ["-std=c++20", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fno-strict-aliasing", "-Wall",
              "-Wextra", "-Wno-unknown-pragmas", "-Wno-unused-parameter", "-Werror",
              f"-I{ROOT / 'native/host_shim'}", f"-I{ROOT / 'native/include'}"]
SANITIZE_FLAGS = ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]

MODE_COPY = 0
MODE_U8_TO_F32 = 1
FILL = 0xA5  # destination bytes before a gather: a row the checks refuse must keep them


def compiler() -> str | None:
    """g++ on PATH, or None (the host-kernel checks then skip with that reason)."""
    return shutil.which(os.environ.get("CXX", "g++"))


def build(out_dir: Path, *, sanitize: bool = False, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile the kernel source and the shim into a shared library under `out_dir` (cached by the
    sources' contents and flags; `extra_flags` come last). Raises RuntimeError with the compiler's
    output if it fails."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    flags = BASE_FLAGS + (SANITIZE_FLAGS if sanitize else ["-O2"]) + list(extra_flags)
    h = hashlib.sha256(" ".join(flags).encode())
    for f in (*SOURCES, *HEADERS):
        h.update(f.read_bytes())
    lib = Path(out_dir) / f"libgpdma_host_{'san' if sanitize else 'opt'}_{h.hexdigest()[:12]}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cxx, *flags, "-x", "c++", str(SOURCES[0]), "-x", "c++", str(SOURCES[1]), "-o", str(tmp)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"building the host kernel failed:\n{' '.join(cmd)}\n{r.stdout}{r.stderr}")
    tmp.replace(lib)
    return lib


def sanitizer_env() -> dict[str, str]:
    """Environment for a child Python that loads a sanitized build: the ASan and UBSan runtimes
    preloaded, leaks not reported (the interpreter's own allocations are not ours)."""
    libs = []
    cxx = compiler() or "g++"
    for name in ("libasan.so", "libubsan.so"):
        r = subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True, timeout=60)
        path = r.stdout.strip()
        if path and os.path.isabs(path):
            libs.append(os.path.realpath(path))
    return dict(os.environ, LD_PRELOAD=" ".join(libs), ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
                UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")


class HostKernel:
    """The built library, loaded with ctypes."""

    def __init__(self, lib: Path) -> None:
        self.lib = ctypes.CDLL(str(lib))
        f = self.lib.gp_shim_launch
        u64, u32, i32, p = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int32, ctypes.c_void_p
        f.argtypes = [p, u64, u64, u64, u32, u32, u32, u32, p, u32, p, u64, u64, i32, u32, u32, p, p, p, u32, p,
                      ctypes.c_int]
        f.restype = ctypes.c_int

    def launch(self, base: int, lay: PoolLayout, records: np.ndarray, out: int, row_stride: int, row_src_bytes: int,
               expect_dtype: int, mode: int, channels: int, a: list[float], b: list[float], d: list[float],
               blocks_per_row: int, stale_error: int = 0) -> tuple[int, np.ndarray]:
        """One launch of the real launch_gather; returns (status, result[1 + n])."""
        recs = np.ascontiguousarray(records, dtype=np.uint32)
        n = int(recs.shape[0])
        result = np.full(1 + max(n, 1), -7, dtype=np.int32)
        coef = [np.asarray(v, dtype=np.float32) for v in (a, b, d)]
        rc = self.lib.gp_shim_launch(
            base, lay.slots_offset, lay.records_offset, lay.chunkmap_offset, lay.slot_size, lay.slot_count,
            lay.record_count, lay.max_chunks, recs.ctypes.data, n, out, row_stride, row_src_bytes, expect_dtype, mode,
            channels, coef[0].ctypes.data, coef[1].ctypes.data, coef[2].ctypes.data, blocks_per_row,
            result.ctypes.data, stale_error)
        return int(rc), result[:1 + n]


@dataclass
class Case:
    """One gather to run on both sides."""

    name: str
    pool: SyntheticPool
    records: np.ndarray
    row_bytes: int            # payload bytes per request (total_len)
    mode: int = MODE_COPY
    normalize: Normalize | None = None
    expect_dtype: int = -1
    row_pad: int = 0          # extra bytes between rows of the destination
    dst_offset: int = 0       # misalignment of the destination's start, in bytes
    blocks_per_row: int = 1
    expect: list[int] = field(default_factory=list)  # expected verdict per row ([] = all OK)

    @property
    def row_stride(self) -> int:
        return self.row_bytes * (4 if self.mode == MODE_U8_TO_F32 else 1) + self.row_pad


def _coefficients(case: Case) -> tuple[list[float], list[float], list[float], int]:
    if case.normalize is None:
        return [1.0] * 4, [0.0] * 4, [1.0] * 4, 1
    a, b, d = case.normalize.coefficients
    return a, b, d, len(case.normalize.mean)


def compare(kernel: HostKernel, case: Case, *, stale_error: int = 0) -> list[str]:
    """Run `case` through the host-built kernel and the CPU reference; return what differs (empty
    when the bytes of every row, every verdict and the count agree, and the verdicts are the ones
    the case expects)."""
    native = runtime.native()
    lay = PoolLayout.of(case.pool)
    geo = lay.geometry()
    n = int(case.records.shape[0])
    stride = case.row_stride
    size = max(1, n) * stride + case.dst_offset + 64
    a, b, d, channels = _coefficients(case)
    outs = []
    for _ in range(2):
        raw = np.full(size + 16, FILL, dtype=np.uint8)
        start = (-raw.ctypes.data) % 16 + case.dst_offset
        outs.append((raw, raw.ctypes.data + start, start))
    rc, result = kernel.launch(case.pool.address, lay, case.records, outs[0][1], stride, case.row_bytes,
                               case.expect_dtype, case.mode, channels, a, b, d, case.blocks_per_row, stale_error)
    problems = []
    if rc != 0:
        problems.append(f"host kernel launch returned {rc}")
        return problems
    status = np.zeros(max(n, 1), dtype=np.int32)
    placed = native.dma_gather_cpu(case.pool.address, geo, case.records, outs[1][1], n * stride, stride,
                                   case.row_bytes, case.expect_dtype, case.mode, channels, a, b, d, status)
    if int(result[0]) != int(placed):
        problems.append(f"placed: kernel {int(result[0])}, reference {placed}")
    if not np.array_equal(result[1:1 + n], status[:n]):
        problems.append(f"verdicts: kernel {result[1:1 + n].tolist()}, reference {status[:n].tolist()}")
    expect = case.expect or [0] * n
    if status[:n].tolist() != expect:
        problems.append(f"verdicts {status[:n].tolist()}, case expects {expect}")
    k = outs[0][0][outs[0][2]:outs[0][2] + size - case.dst_offset]
    r = outs[1][0][outs[1][2]:outs[1][2] + size - case.dst_offset]
    if not np.array_equal(k, r):
        bad = np.flatnonzero(k != r)
        problems.append(f"bytes differ at {bad.size} places, first at {int(bad[0])} (row {int(bad[0]) // stride}): "
                        f"kernel {int(k[bad[0]])}, reference {int(r[bad[0]])}")
    # Padding and whatever lies past the rows must be untouched.
    for i in range(n):
        pad = r[i * stride + case.row_bytes * (4 if case.mode else 1):(i + 1) * stride]
        if pad.size and not (pad == FILL).all():
            problems.append(f"row {i}: padding written")
    if not (r[n * stride:] == FILL).all():
        problems.append("bytes written past the last row")
    return problems


def _pool(chunk: int, requests: int, row_bytes: int, seed: int) -> SyntheticPool:
    per = -(-row_bytes // chunk)
    return SyntheticPool(slot_count=requests * per + 8, max_payload=max(chunk, 16), record_count=requests + 2,
                         max_chunks=per + 1, seed=seed)


def _bodies(rng: np.random.Generator, n: int, row_bytes: int) -> list[np.ndarray]:
    return [rng.integers(0, 256, size=row_bytes, dtype=np.uint8) for _ in range(n)]


def shape_cases(quick: bool) -> Iterator[Case]:
    """Payload sizes around chunk boundaries, chunk payloads, modes, channels, alignment, padding."""
    rng = np.random.default_rng(1)
    chunks = (16, 100, 1024) if quick else (16, 48, 100, 256, 1000, 1024)
    seed = 0
    for chunk in chunks:
        sizes = {1, 17, chunk - 1, chunk + 1, 3 * chunk + 5}
        if not quick:
            sizes |= {15, 16, 31, 32, 33, chunk, 2 * chunk, 3 * chunk - 1, 3 * chunk, 7 * chunk + 13, 40 * chunk + 3}
        for size in sorted(s for s in sizes if s > 0):
            for mode, norm in ((MODE_COPY, None), (MODE_U8_TO_F32, UNIT), (MODE_U8_TO_F32, IMAGENET),
                               (MODE_U8_TO_F32, Normalize(mean=(0.1,) * 4, std=(0.3, 0.2, 0.7, 0.9)))):
                if quick and mode == MODE_U8_TO_F32 and size not in (chunk + 1, 3 * chunk + 5):
                    continue
                seed += 1
                n = 3
                sp = _pool(chunk, n, size, seed)
                recs = np.array([sp.add_request(7, 100 + i, body, chunk_payload=chunk)
                                 for i, body in enumerate(_bodies(rng, n, size))], dtype=np.uint32)
                # (row padding, destination misalignment, blocks per row); float32 rows start on 4 bytes.
                variants = [(0, 0, 1), (12, 0, 2), (0, 16, 7)]
                variants += [(5, 1, 3), (3, 7, 2)] if mode == MODE_COPY else [(4, 4, 3), (8, 12, 5)]
                if quick:  # one layout per case, taking turns: every layout still appears
                    variants = [variants[seed % len(variants)]]
                for pad, offset, bpr in variants:
                    label = "copy" if norm is None else f"u8f32x{len(norm.mean)}"
                    yield Case(f"{label} chunk={chunk} size={size} pad={pad} off={offset} bpr={bpr}", sp, recs,
                               size, mode, norm, -1 if mode == MODE_COPY else int(wire.DType.UINT8), pad, offset,
                               bpr)


_FIELD_VALUES = {"magic": 0x12345678, "version": 99, "kind": 7, "app_id": 8, "request_id": 999, "chunk_index": 5000,
                 "chunk_count": 77, "payload_len": 3, "total_len": 12345, "dtype": 1}
_FIELD_VERDICT = {"magic": 5, "version": 5, "kind": 5, "app_id": 6, "request_id": 6, "chunk_index": 6,
                  "chunk_count": 6, "payload_len": 7, "total_len": 6, "dtype": 6}


def verdict_cases(quick: bool) -> Iterator[Case]:
    """Each header field corrupted at the first, a middle and the last chunk; bad records."""
    rng = np.random.default_rng(2)
    chunk, size = 100, 1050  # 11 chunks, the last one short
    seed = 1000
    for k, (fld, value) in enumerate(_FIELD_VALUES.items()):
        for at in (((0, 10)[k % 2],) if quick else (0, 5, 10)):
            seed += 1
            sp = _pool(chunk, 3, size, seed)
            recs = np.array([sp.add_request(7, 100 + i, b, chunk_payload=chunk) for i, b in
                             enumerate(_bodies(rng, 3, size))], dtype=np.uint32)
            sp.set_header_field(int(recs[1]), at, fld, value)
            modes = ((MODE_COPY, None), (MODE_U8_TO_F32, UNIT))
            for mode, norm in ((modes[seed % 2],) if quick else modes):
                yield Case(f"corrupt {fld} at chunk {at} mode {mode}", sp, recs, size, mode, norm,
                           int(wire.DType.UINT8) if mode else -1, blocks_per_row=2,
                           expect=[0, _FIELD_VERDICT[fld], 0])
    # Bad records.
    sp = _pool(chunk, 6, size, 7)
    good = [sp.add_request(7, 100 + i, b, chunk_payload=chunk) for i, b in enumerate(_bodies(rng, 5, size))]
    sp.records[good[1]]["state"] = STATE_FILLING
    sp.records[good[2]]["total_len"] = size - 1
    sp.chunkmap[good[3], 4] = sp.layout["slot_count"] + 3
    recs = np.array([good[0], good[1], good[2], good[3], sp.layout["record_count"] + 9, good[4]], dtype=np.uint32)
    yield Case("bad records", sp, recs, size, expect=[0, 1, 2, 4, 1, 0], blocks_per_row=3)
    yield Case("wrong dtype", sp, recs[[0, 5]], size, expect_dtype=int(wire.DType.FLOAT32), expect=[3, 3])
    yield Case("empty batch", sp, recs[:0], size)


def cases(quick: bool = True) -> Iterator[Case]:
    """Every case: shapes, then verdicts."""
    yield from shape_cases(quick)
    yield from verdict_cases(quick)


def fma_flags() -> tuple[str, ...]:
    """``-mfma`` where this CPU has FMA instructions (x86), so a build can show that the sources keep
    their separate roundings on an FMA-capable target (aarch64 always is one)."""
    try:
        return ("-mfma",) if " fma " in Path("/proc/cpuinfo").read_text().replace("\n", " ") else ()
    except OSError:
        return ()


def run_all(kernel: HostKernel, quick: bool, only: str = "") -> dict[str, Any]:
    """Compare every case (whose name starts with `only`); {"cases": n, "failures": {name: problems}}."""
    failures: dict[str, list[str]] = {}
    count = 0
    for case in cases(quick):
        if not case.name.startswith(only):
            continue
        count += 1
        problems = compare(kernel, case)
        if problems:
            failures[case.name] = problems
    return {"cases": count, "failures": failures}
