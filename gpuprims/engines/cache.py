"""The engine cache: artefacts (ONNX files, optimized models, TensorRT plans, inductor caches) built once,
keyed by a fingerprint of everything that changes them, and found again by every later start.

An entry is a directory ``<root>/<key>/`` holding the artefact's files and a ``manifest.json`` that lists
each file with its size and SHA-256. It appears whole or not at all: a build writes into a private
temporary directory, the manifest last, then renames it into place. Two processes building the same key
at once serialise on a lock file (``flock``; released by the kernel if the builder dies), so the second
one waits and then finds the first one's entry. An entry whose manifest or files do not check out is
rebuilt with a WARNING, never a crash.

The key (:func:`fingerprint`) covers the model (a zoo model's name, seed, classes, input shape and the
zoo's code; a user model's weights), the max batch, the engine kind and options, library versions and
the device (CPU model and ISA flags; CUDA compute capability). A stale entry is simply never asked for
again; :meth:`EngineCache.entries` lists what is there.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from gpuprims._version import __version__
from gpuprims.engines.base import EngineError, ModelSource, Progress, Target

log = logging.getLogger("gpuprims.engines")

ENV_CACHE_DIR = "GPUPRIMS_ENGINE_CACHE"
MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
#: How often a process waiting for another's build says so.
WAIT_REPORT_S = 5.0


def _torch() -> Any:
    """torch, imported on first use rather than at this module's head: an instance serving an ONNX
    file keeps its artefacts here and maps no torch (tests/test_layers.py, TORCH_FREE)."""
    import torch

    return torch


def default_root() -> Path:
    """``$GPUPRIMS_ENGINE_CACHE``, else ``$XDG_CACHE_HOME/gpuprims/engines``, else
    ``~/.cache/gpuprims/engines``: per user, so one user's node never reads another's artefacts."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # the XDG spec: a relative path is invalid and ignored
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gpuprims" / "engines"


def fingerprint(parts: Mapping[str, Any]) -> str:
    """A stable key (32 hex digits) for ``parts``, a JSON-able mapping; key order does not matter."""
    text = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _zoo_code_digest() -> str:
    """SHA-256 of the zoo's source files: the zoo's weights and graphs are a function of its code. The
    zoo is found, not imported (importing this package loads no numpy and no model code)."""
    spec = importlib.util.find_spec("apps.zoo")
    if spec is None or spec.origin is None:
        raise EngineError("the model zoo (apps.zoo) is not installed")
    h = hashlib.sha256()
    for path in sorted(Path(spec.origin).parent.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def weights_digest(module: Any) -> str:
    """SHA-256 over a torch module's parameters and buffers (names, dtypes, shapes and bytes)."""
    torch = _torch()

    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        if t.device.type != "meta":
            h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def model_identity(source: ModelSource, module: Any = None) -> dict[str, Any]:
    """What identifies the model: a zoo model by name, seed, classes, shape and the zoo's code; a user
    model (``module:factory``) by the digest of its weights (``module``, or built here)."""
    ident: dict[str, Any] = {"model": source.model, "seed": source.seed, "num_classes": source.num_classes,
                             "input_shape": list(source.input_shape), "max_batch": source.max_batch}
    if source.is_zoo:
        ident["zoo_code"] = _zoo_code_digest()
    else:
        ident["weights"] = weights_digest(module if module is not None else source.build_module("cpu"))
    return ident


def _cpu_identity() -> dict[str, Any]:
    model, flags = "", ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key == "flags" and not flags:
                flags = value.strip()
    return {"arch": platform.machine(), "cpu": model,
            "isa": hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:12]}


def device_identity(target: Target) -> dict[str, Any]:
    """The device an artefact is built for: CPU model and ISA flags on cpu; on cuda the GPU's name and
    compute capability (from torch, or the fake runtime's device table)."""
    if target.backend == "cpu":
        return {"backend": "cpu", **_cpu_identity()}
    from gpuprims.cuda import runtime  # numpy: validating ``engine:`` imports this package, and no numpy

    if runtime.is_fake():
        rt: Any = runtime.cuda()
        major, minor = rt.cuda_device_capability(target.device_index)
        return {"backend": "cuda", "fake": True, "name": rt.cuda_device_name(target.device_index),
                "cc": f"{major}.{minor}"}
    torch = _torch()

    major, minor = torch.cuda.get_device_capability(target.device_index)
    return {"backend": "cuda", "name": torch.cuda.get_device_name(target.device_index), "cc": f"{major}.{minor}",
            "cuda": torch.version.cuda}


def library_versions(*names: str) -> dict[str, str | None]:
    """Installed versions of python packages (None when absent), plus torch's and gpuprims'."""
    out: dict[str, str | None] = {"gpuprims": __version__}
    for name in ("torch", *names):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


@dataclass
class CacheEntry:
    """One entry: its directory, whether it was found (``hit``) or built now, the build's time and the
    metadata the builder returned (kept in the manifest)."""

    key: str
    path: Path
    hit: bool
    build_ms: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    def file(self, name: str) -> Path:
        return self.path / name


class EngineCache:
    """A directory of engine artefacts keyed by fingerprint (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()

    def __repr__(self) -> str:
        return f"EngineCache({str(self.root)!r})"

    def _ensure(self) -> None:
        try:
            for sub in ("", "locks", "tmp"):
                (self.root / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise EngineError(f"engine cache directory {self.root} cannot be created: {e} "
                              f"(set node.engine_cache or {ENV_CACHE_DIR})") from e

    @contextlib.contextmanager
    def _locked(self, key: str, progress: Progress | None) -> Iterator[None]:
        fd = os.open(self.root / "locks" / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            t0 = time.monotonic()
            next_report = t0
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    now = time.monotonic()
                    if now >= next_report:  # at once, then every WAIT_REPORT_S
                        msg = f"waiting for another process building engine {key} ({now - t0:.0f} s)"
                        log.info(msg)
                        if progress is not None:
                            progress(msg, None)
                        next_report = now + WAIT_REPORT_S
                    time.sleep(0.05)
            yield
        finally:
            os.close(fd)  # releases the lock

    def check(self, key: str) -> tuple[bool, str]:
        """(True, "") when the entry exists and every file matches its manifest; else (False, why)."""
        path = self.root / key
        if not path.is_dir():
            return (False, "not a directory") if os.path.lexists(path) else (False, "absent")
        try:
            manifest = json.loads((path / MANIFEST).read_text())
            if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
                return False, "manifest is not a mapping with a 'files' mapping"
            if manifest.get("version") != MANIFEST_VERSION or manifest.get("key") != key:
                return False, "manifest of another version or key"
            for name, want in manifest["files"].items():
                f = path / name
                if not f.is_file() or f.stat().st_size != want["size"]:
                    return False, f"{name} is missing or has the wrong size"
                if _sha256(f) != want["sha256"]:
                    return False, f"{name} does not match its checksum"
        except (OSError, ValueError, KeyError, TypeError) as e:
            return False, f"unreadable manifest ({type(e).__name__}: {e})"
        return True, ""

    def lookup(self, key: str) -> CacheEntry | None:
        """The entry for ``key`` if it is there and whole, else None (builds nothing)."""
        ok, _ = self.check(key)
        if not ok:
            return None
        manifest = json.loads((self.root / key / MANIFEST).read_text())
        return CacheEntry(key, self.root / key, hit=True, build_ms=float(manifest.get("build_ms", 0.0)),
                          meta=dict(manifest.get("meta") or {}))

    def get_or_build(self, key: str, build: Callable[[Path], Mapping[str, Any] | None], *,
                     progress: Progress | None = None) -> CacheEntry:
        """The entry for ``key``: found whole (``hit``), or built now by ``build(tmpdir)``, which writes
        the artefact's files into ``tmpdir`` and returns metadata to keep. A corrupt entry is rebuilt
        with a WARNING. An exception from ``build`` leaves no entry and propagates."""
        self._ensure()
        with self._locked(key, progress):
            ok, why = self.check(key)
            if ok:
                entry = self.lookup(key)
                assert entry is not None
                return entry
            if why != "absent":
                log.warning("engine cache entry %s in %s is corrupt (%s): rebuilding it", key, self.root, why)
                self._remove(self.root / key)
            for dead in (self.root / "tmp").glob(f"{key}.*"):
                # a builder of this key that died mid-build (we hold the key's lock, so none is running)
                shutil.rmtree(dead, ignore_errors=True)
            tmp = self.root / "tmp" / f"{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
            tmp.mkdir(mode=0o700)
            try:
                t0 = time.perf_counter()
                meta = dict(build(tmp) or {})
                build_ms = (time.perf_counter() - t0) * 1e3
                files = {p.relative_to(tmp).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
                         for p in sorted(tmp.rglob("*")) if p.is_file()}
                manifest = {"version": MANIFEST_VERSION, "key": key, "files": files, "meta": meta,
                            "build_ms": round(build_ms, 1), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                     time.gmtime())}
                _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1, default=str))
                os.replace(tmp, self.root / key)
            except BaseException:
                self._remove(tmp)
                raise
            return CacheEntry(key, self.root / key, hit=False, build_ms=build_ms, meta=meta)

    def entries(self) -> list[str]:
        """The keys of the entries present (whole or not)."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and p.name not in ("locks", "tmp"))

    def _remove(self, path: Path) -> None:
        """Remove a directory: renamed aside first, so a half-removed entry is never taken for one."""
        if not os.path.lexists(path):
            return
        if not path.is_dir() or path.is_symlink():
            path.unlink()
            return
        aside = self.root / "tmp" / f"dead.{path.name}.{uuid.uuid4().hex[:8]}"
        try:
            os.replace(path, aside)
        except OSError:
            aside = path
        shutil.rmtree(aside, ignore_errors=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def engine_key(engine: Any, module: Any = None, *, libraries: tuple[str, ...] = (),
               extra: Mapping[str, Any] | None = None) -> str:
    """The cache key of an engine's artefact: its kind and options, the model (``module`` for a user
    model's weights), the device, and the versions of ``libraries``. The threads a share gives are not
    in it (they change no artefact), so a change of share finds the same entry."""
    parts = {"kind": engine.kind, "options": dict(engine.options), "model": model_identity(engine.source, module),
             "device": device_identity(engine.target), "libraries": library_versions(*libraries),
             "extra": dict(extra or {})}
    return fingerprint(parts)
