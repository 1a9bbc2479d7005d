"""A Triton model repository on disk: its models, their versions and the files each version serves.

::

    <repository>/
      <model>/                 # one model per subdirectory, named by it
        config.pbtxt           # optional: completed from the model file when absent or partial
        1/model.onnx           # numbered version directories (no leading zero) with the model file
        2/model.onnx

:func:`scan` reads every model; one that fails (a bad config, no version, a missing file) carries its
error and leaves the others alone, as Triton marks it UNAVAILABLE with the reason. The config's
``version_policy`` (default: the latest one) picks the versions served; each has a content
fingerprint (the engine cache's key, and how ``poll`` mode sees a file change).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gpuprims.modelrepo import formats
from gpuprims.modelrepo.complete import check_model_file
from gpuprims.modelrepo.config import ModelConfig, load_config
from gpuprims.modelrepo.errors import ModelConfigError

#: Bytes read at a time when fingerprinting (model files may be gigabytes).
CHUNK_BYTES = 1 << 20


class RepositoryError(ValueError):
    """The repository itself cannot be read (not a directory), or a model name is not one."""


@dataclass(frozen=True)
class VersionFiles:
    """One served version: its directory, its model file and the fingerprint of the directory's
    content (sha256 hex over every file's relative name, size and bytes). ``stat_key`` hashes the
    files' names, sizes and modification times: a rescan whose stat key is unchanged keeps the
    fingerprint instead of reading every byte again (:func:`read_model`'s ``previous``)."""

    version: int
    directory: str
    model_path: str
    fingerprint: str
    stat_key: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 1:
            raise ValueError(f"a version is an integer >= 1, got {self.version!r}")


@dataclass(frozen=True)
class RepositoryModel:
    """One model of a repository. ``error`` is None when it loads: then ``config`` is its completed
    configuration and ``versions`` the versions its policy serves (at least one). When it fails,
    ``error`` is one line ``FILE[:LINE]: FIELD: what is wrong`` and ``versions`` is empty.
    ``config_digest`` is the sha256 of ``config.pbtxt`` (None without one)."""

    name: str
    directory: str
    config: ModelConfig | None
    versions: Mapping[int, VersionFiles] = field(default_factory=dict, hash=False)
    error: str | None = None
    config_digest: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "versions", dict(sorted(self.versions.items())))
        if self.error is None and (self.config is None or not self.versions):
            raise ValueError(f"model {self.name!r}: a model without an error needs a config and a version")
        if self.error is not None and self.versions:
            raise ValueError(f"model {self.name!r}: a failed model serves no version")

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def latest(self) -> VersionFiles | None:
        """The highest served version (an unversioned request's), or None for a failed model."""
        return self.versions[max(self.versions)] if self.versions else None

    @property
    def digest(self) -> str:
        """A fingerprint of everything served: the config's bytes and every served version's content.
        ``poll`` mode reloads a model whose digest changed."""
        h = hashlib.sha256()
        h.update((self.config_digest or "-").encode())
        for v, files in self.versions.items():
            h.update(f"\0{v}:{files.fingerprint}".encode())
        h.update(f"\0error:{self.error}".encode())
        return h.hexdigest()


def fingerprint(directory: str | Path) -> str:
    """sha256 hex over every file under ``directory`` (recursively, in name order): its relative POSIX
    name, its size and its bytes, read in :data:`CHUNK_BYTES` pieces. Raises OSError when a file
    cannot be read."""
    root = Path(directory)
    h = hashlib.sha256()
    for p in _files(root):
        rel = p.relative_to(root).as_posix().encode()
        size = p.stat().st_size
        h.update(len(rel).to_bytes(4, "little") + rel + size.to_bytes(8, "little"))
        with p.open("rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                h.update(chunk)
    return h.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted((q for q in root.rglob("*") if q.is_file()), key=lambda q: q.relative_to(root).as_posix())


def stat_key(directory: str | Path) -> str:
    """sha256 hex over every file's relative name, size and modification time (ns) under ``directory``:
    cheap to take, and it changes whenever a file is added, removed, renamed, resized or rewritten
    (unless rewritten to the same size within the filesystem's time resolution). Raises OSError."""
    root = Path(directory)
    h = hashlib.sha256()
    for p in _files(root):
        st = p.stat()
        h.update(f"{p.relative_to(root).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _config_digest(model_dir: Path) -> str | None:
    cfg = model_dir / "config.pbtxt"
    try:
        return hashlib.sha256(cfg.read_bytes()).hexdigest() if cfg.is_file() else None
    except OSError:
        return None


def _failed(name: str, d: Path, error: str, digest: str | None) -> RepositoryModel:
    return RepositoryModel(name, str(d), None, {}, error, digest)


def read_model(model_dir: str | Path, previous: RepositoryModel | None = None,
               torch_ok: bool = True, check_files: bool = True) -> RepositoryModel:
    """The model of one directory (named by it), loaded or carrying its error. ``previous`` (this
    model's last reading, in ``poll`` mode) lends its fingerprints to versions whose files have the
    same :func:`stat_key`, so an unchanged gigabyte file is not read again. ``torch_ok`` False keeps
    torch out of the calling process (:func:`gpuprims.modelrepo.config.load_config`). ``check_files``:
    each served version's file is checked against the config as Triton checks it at load
    (:func:`gpuprims.modelrepo.complete.check_model_file`: a file it cannot parse, a tensor it does not
    have, another datatype or shape), unless ``previous`` checked the same file under the same config."""
    d = Path(model_dir)
    digest = _config_digest(d)
    try:
        return _read_model(d, previous, torch_ok, check_files, digest)
    except OSError as e:  # a directory that cannot be listed, a file that vanished while read
        return _failed(d.name, d, str(ModelConfigError(str(d), None, "model", f"cannot be read: {e}")), digest)


def _read_model(d: Path, previous: RepositoryModel | None, torch_ok: bool, check_files: bool,
                digest: str | None) -> RepositoryModel:
    name = d.name
    try:
        config = load_config(d, torch_ok)
    except ModelConfigError as e:
        return _failed(name, d, str(e), digest)
    available = formats.version_dirs(d)
    if not available:
        return _failed(name, d, str(ModelConfigError(str(d), None, "version", "no version directory (a numbered "
                                                     "subdirectory such as 1/ holding the model file)")), digest)
    policy = config.version_policy
    missing = policy.missing(available)
    if missing:
        return _failed(name, d, str(ModelConfigError(
            config.source, None, "version_policy",
            f"{policy.describe()}: versions {list(missing)} have no directory (present: {list(available)})")), digest)
    versions: dict[int, VersionFiles] = {}
    for v in policy.select(available):
        vdir = available[v]
        path = formats.model_file(vdir, config.model_filename)
        if path is None:
            return _failed(name, d, str(ModelConfigError(
                str(vdir), None, "default_model_filename",
                f"version {v} has no model file {config.model_filename!r} ({config.model_format})")), digest)
        try:
            key = stat_key(vdir)
            before = previous.versions.get(v) if previous is not None else None
            unchanged = before is not None and before.stat_key == key and before.directory == str(vdir)
            fp = before.fingerprint if before is not None and unchanged else fingerprint(vdir)
        except OSError as e:
            return _failed(name, d, str(ModelConfigError(str(vdir), None, "version", f"cannot be read: {e}")),
                           digest)
        checked = unchanged and previous is not None and previous.config == config
        if check_files and not checked:
            try:
                check_model_file(config, path, torch_ok)
            except ModelConfigError as e:
                return _failed(name, d, str(e), digest)
        versions[v] = VersionFiles(v, str(vdir), str(path), fp, key)
    for w in config.warmup:
        for inp in w.inputs:
            if inp.data_file is not None and not (d / "warmup" / inp.data_file).is_file():
                return _failed(name, d, str(ModelConfigError(
                    config.source, None, "model_warmup",
                    f"warmup {w.name!r}: input {inp.name!r} reads {inp.data_file!r}, which is not a file in "
                    f"{d / 'warmup'}")), digest)
    return RepositoryModel(name, str(d), config, versions, None, digest)


def _repository(repo_dir: str | Path) -> Path:
    root = Path(repo_dir)
    if not root.is_dir():
        raise RepositoryError(f"model repository {str(root)!r} is not a directory")
    return root


def scan(repo_dir: str | Path, previous: Mapping[str, RepositoryModel] | None = None,
         torch_ok: bool = True, check_files: bool = True) -> list[RepositoryModel]:
    """Every model of the repository, by name: each subdirectory not starting with ``.``. A model that
    fails carries its error; the others are unaffected. ``previous`` (the last scan's models by name,
    ``poll`` mode) saves re-reading unchanged files (:func:`read_model`, which says what ``torch_ok`` and
    ``check_files`` do). Raises
    :class:`RepositoryError` when ``repo_dir`` is not a directory."""
    root = _repository(repo_dir)
    before = previous or {}
    try:
        dirs = sorted((p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")), key=lambda q: q.name)
    except OSError as e:
        raise RepositoryError(f"model repository {str(root)!r} cannot be listed: {e}") from None
    return [read_model(p, before.get(p.name), torch_ok, check_files) for p in dirs]


def load_model(repo_dir: str | Path, name: str, previous: RepositoryModel | None = None,
               torch_ok: bool = True, check_files: bool = True) -> RepositoryModel:
    """One model of the repository by name (explicit mode's load). A name that is not a plain directory
    name (empty, a path, hidden) raises :class:`RepositoryError`; a model with no directory comes back
    with that error."""
    root = _repository(repo_dir)
    if not isinstance(name, str) or not name or name in (".", "..") or name.startswith(".") \
            or "/" in name or "\\" in name or "\0" in name:
        raise RepositoryError(f"{name!r} is not a model name (a directory name in the repository)")
    d = root / name
    if not d.is_dir():
        return _failed(name, d, str(ModelConfigError(str(d), None, "model", f"no model {name!r} in {root}")), None)
    return read_model(d, previous, torch_ok, check_files)
