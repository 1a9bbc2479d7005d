"""Static GPU checks of the CUDA kernels, no GPU needed: nvcc builds native/cuda/*.cu for every target
architecture with warnings as errors and register spills / local memory as ptxas errors, and the
resources ptxas reports (registers, stack, spills, shared memory, per kernel and architecture) are
compared with the committed snapshot native/cuda/resource-usage.json.

    python scripts/check_cuda_archs.py            # check against the snapshot (exit 1 on a difference)
    python scripts/check_cuda_archs.py --update   # rewrite the snapshot

Where nvcc is absent it says so and exits 0 (tests/gpuprims/cuda/test_archs.py skips with the reason).
The snapshot is exact for the nvcc version it was taken with; another version may allocate registers
differently, so then only the invariants are enforced (no spills, no stack, registers within the
launch bounds) and the differences are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = ROOT / "native/cuda/resource-usage.json"
#: The architectures of CMakeLists.txt's GPUPRIMS_CUDA_ARCHS: every edge GPU's SASS, plus compute_75 PTX.
ARCHS = ("75", "80", "86", "87", "89", "90")
PTX_ARCH = "75"
#: Newer architectures the PTX is JIT-compiled for (Blackwell): not in the build (older toolkits do not
#: know them), but checked for spills here when this nvcc can target them.
CHECK_ONLY = ("100", "120")
#: Registers a kernel may use at its __launch_bounds__ (65536 per SM / threads per block, capped at 255).
MAX_REGS = {"gather_kernel": 255, "finalize_kernel": 128}

_ENTRY = re.compile(r"Compiling entry function '(\S+)' for 'sm_(\d+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?")
_KERNEL = re.compile(r"(gather_kernel|finalize_kernel)")


def nvcc() -> str | None:
    return os.environ.get("NVCC") or shutil.which("nvcc")


def nvcc_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60).stdout
    m = re.search(r"release ([\d.]+), V([\d.]+)", out)
    return m.group(2) if m else out.strip().splitlines()[-1]


def compile_all(binary: str) -> tuple[str, dict[str, dict[str, dict[str, int]]]]:
    """Build every .cu for every arch; returns (ptxas output, {kernel: {sm: resources}}). Raises
    RuntimeError with the compiler's output on any warning, spill or error."""
    known = subprocess.run([binary, "--list-gpu-code"], capture_output=True, text=True, timeout=60).stdout.split()
    extra = [a for a in CHECK_ONLY if f"sm_{a}" in known]
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in (*ARCHS, *extra)]
    gencode.append(f"-gencode=arch=compute_{PTX_ARCH},code=compute_{PTX_ARCH}")
    log = []
    usage: dict[str, dict[str, dict[str, int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for src in sorted((ROOT / "native/cuda").glob("*.cu")):
            cmd = [binary, "-c", str(src), "-o", str(Path(tmp) / (src.stem + ".o")), "-std=c++17",
                   f"-I{ROOT / 'native/include'}", "--Werror", "all-warnings",
                   "-Xptxas=--warn-on-spills,--warn-on-local-memory-usage,--warning-as-error",
                   "--resource-usage", "-Xcompiler=-Wall,-Wextra", *gencode]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            out = r.stdout + r.stderr
            log.append(out)
            if r.returncode != 0:
                raise RuntimeError(f"nvcc failed for {src.name}:\n{' '.join(cmd)}\n{out}")
            usage.update(parse(out))
    return "\n".join(log), usage


def parse(out: str) -> dict[str, dict[str, dict[str, int]]]:
    usage: dict[str, dict[str, dict[str, int]]] = {}
    current: tuple[str, str] | None = None
    for line in out.splitlines():
        m = _ENTRY.search(line)
        if m:
            k = _KERNEL.search(m.group(1))
            current = (k.group(1) if k else m.group(1), f"sm_{m.group(2)}")
            usage.setdefault(current[0], {})[current[1]] = {}
            continue
        if current is None:
            continue
        entry = usage[current[0]][current[1]]
        m = _PROPS.search(line)
        if m:
            entry.update(stack_bytes=int(m.group(1)), spill_store_bytes=int(m.group(2)),
                         spill_load_bytes=int(m.group(3)))
        m = _USED.search(line)
        if m:
            entry.update(registers=int(m.group(1)), smem_bytes=int(m.group(2) or 0))
    return usage


def cuobjdump() -> str | None:
    """cuobjdump on PATH, or the one the PyPI package nvidia-cuda-cuobjdump installs (the dev extra)."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia

        for base in nvidia.__path__:
            for cand in sorted(Path(base).glob("*/bin/cuobjdump")):
                return str(cand)
    except ImportError:
        pass
    return None


def built_images(library: Path, binary: str) -> tuple[set[str], set[str]]:
    """(SASS architectures, PTX architectures) inside a built extension, e.g. ({"sm_75", ...}, {"sm_75"})."""
    r = subprocess.run([binary, "--list-elf", "--list-ptx", str(library)], capture_output=True, text=True,
                       timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"cuobjdump failed on {library}: {r.stderr.strip()}")
    elf = set(re.findall(r"ELF file\s+\d+: \S+?\.(sm_\d+)\.cubin", r.stdout))
    ptx = set(re.findall(r"PTX file\s+\d+: \S+?\.(sm_\d+)\.ptx", r.stdout))
    return elf, ptx


def check_built(library: Path, binary: str) -> list[str]:
    """What the built extension lacks: machine code for every target architecture and the PTX."""
    elf, ptx = built_images(library, binary)
    bad = [f"no machine code for sm_{a} in {library.name}" for a in ARCHS if f"sm_{a}" not in elf]
    if f"sm_{PTX_ARCH}" not in ptx:
        bad.append(f"no compute_{PTX_ARCH} PTX in {library.name} (found {sorted(ptx)})")
    return bad


def invariants(usage: dict[str, dict[str, dict[str, int]]]) -> list[str]:
    bad = []
    for kernel, per_arch in usage.items():
        missing = {f"sm_{a}" for a in ARCHS} - set(per_arch)
        if missing:
            bad.append(f"{kernel}: no machine code for {sorted(missing)}")
        for sm, r in per_arch.items():
            if r.get("spill_store_bytes") or r.get("spill_load_bytes") or r.get("stack_bytes"):
                bad.append(f"{kernel} {sm}: spills or stack {r}")
            if r.get("registers", 0) > MAX_REGS.get(kernel, 255):
                bad.append(f"{kernel} {sm}: {r['registers']} registers > {MAX_REGS.get(kernel)}")
    for kernel in MAX_REGS:
        if kernel not in usage:
            bad.append(f"{kernel}: not found in the ptxas output")
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--update", action="store_true", help="rewrite the snapshot with this nvcc's figures")
    args = ap.parse_args(argv)
    binary = nvcc()
    if binary is None:
        print("check_cuda_archs: SKIPPED: nvcc not found (set NVCC or put nvcc on PATH)")
        return 0
    version = nvcc_version(binary)
    try:
        _, usage = compile_all(binary)
    except RuntimeError as e:
        print(f"check_cuda_archs: FAILED: {e}")
        return 1
    problems = invariants(usage)
    snap = {"nvcc": version, "archs": [f"sm_{a}" for a in ARCHS], "ptx": f"compute_{PTX_ARCH}", "kernels": usage}
    if args.update:
        SNAPSHOT.write_text(json.dumps(snap, indent=1, sort_keys=True) + "\n")
        print(f"check_cuda_archs: wrote {SNAPSHOT.relative_to(ROOT)} (nvcc {version})")
        return 1 if problems else 0
    committed: dict[str, Any] = json.loads(SNAPSHOT.read_text()) if SNAPSHOT.exists() else {}
    if committed.get("kernels") != usage:
        diff = f"resources differ from {SNAPSHOT.relative_to(ROOT)} (taken with nvcc {committed.get('nvcc')}):\n" \
               f"  now:       {json.dumps(usage, sort_keys=True)}\n  snapshot:  {json.dumps(committed.get('kernels'), sort_keys=True)}"
        if committed.get("nvcc") == version:
            problems.append(diff + "\n  (rerun with --update if the change is intended)")
        else:
            print("check_cuda_archs: note (other nvcc, invariants only): " + diff)
    if problems:
        print("check_cuda_archs: FAILED:\n  " + "\n  ".join(problems))
        return 1
    print(f"check_cuda_archs: ok: {', '.join(f'sm_{a}' for a in ARCHS)} + compute_{PTX_ARCH} PTX, no warnings, "
          f"no spills (nvcc {version})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
