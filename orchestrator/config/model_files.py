"""Model files as apps: an apps.yaml ``model: path/to/model.onnx`` and every model of a Triton model
repository (``node.model_repository``) become app entries the config validates like any other.

The config of a model (``gpuprims.modelrepo.ModelConfig``: its config.pbtxt completed from the file) sets
the app keys it speaks for, unless the entry gives them: ``slo_ms`` and ``gpu_pct`` (its gpuprims
``parameters``), ``max_batch`` (``max_batch_size``; 1 for a model without batching), ``max_wait_ms``
(``dynamic_batching.max_queue_delay_microseconds``; 0 without dynamic batching: what is queued is run at
once, never waited for), ``instances`` (the ``instance_group`` counts) and ``engine`` (the file's engine
on the node's backend). The entry's ``file`` carries the completed config as JSON (the one message from
the repository to the instance) with the model file, its version and its content fingerprint.

Torch-free: reading an ONNX file's signature uses the ``onnx`` package (a model without config.pbtxt).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from gpuprims.modelrepo import (
    ModelConfig,
    ModelConfigError,
    RepositoryError,
    RepositoryModel,
    config_for_file,
    proto,
    scan,
)
from gpuprims.modelrepo import load_model as load_repository_model
from gpuprims.modelrepo.complete import check_model_file
from gpuprims.modelrepo.formats import EXTENSIONS

#: What a model file's name ends with (a ``model:`` that ends so is a file, not a zoo name).
MODEL_FILE_SUFFIXES: tuple[str, ...] = tuple(EXTENSIONS)
#: An app's name (the config's rule, apps.yaml ``name``); a repository model named otherwise is unavailable.
_NAME_RE = re.compile(r"^[a-z0-9_-]{1,64}$")
#: The most requests one batch of a model file takes (the app's ``max_batch`` bound).
MAX_BATCH = 512


class ModelFileError(ValueError):
    """A model file or its config cannot be served as an app: ``key`` is the app key at fault."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(message)


def is_model_file(ref: str) -> bool:
    """Whether an apps.yaml ``model`` names a model file (by its suffix, or a path)."""
    return ref.lower().endswith(MODEL_FILE_SUFFIXES) or "/" in ref


def app_keys(cfg: ModelConfig, backend: str = "cpu") -> dict[str, Any]:
    """The app keys a model's config speaks for (see the module docstring)."""
    out: dict[str, Any] = {}
    p = cfg.parameters
    if p.slo_ms is not None:
        out["slo_ms"] = float(p.slo_ms)
    if p.gpu_pct is not None:
        out["gpu_pct"] = int(p.gpu_pct)
    out["max_batch"] = max(1, min(MAX_BATCH, cfg.max_batch_size)) if cfg.max_batch_size > 0 else 1
    out["max_wait_ms"] = cfg.dynamic_batching.max_queue_delay_us / 1000.0 if cfg.dynamic_batching else 0.0
    count = sum(g.count for g in cfg.instance_groups)
    if count:
        out["instances"] = count
    choice = cfg.engine("cuda" if backend == "cuda" else "cpu")
    out["engine"] = {"kind": choice.kind, **dict(choice.options)} if choice.options else choice.kind
    return out


def _file(cfg: ModelConfig, path: Path, version: int, fp: str, repository: str | None) -> dict[str, Any]:
    return {"path": str(path), "config_json": cfg.to_json(), "version": version, "fingerprint": fp,
            "repository": repository}


def _file_fingerprint(path: Path) -> str:
    """The content fingerprint of a model file outside a repository: its directory's files when it is
    an OpenVINO IR (model.xml beside model.bin), else the file alone."""
    from gpuprims.engines.files import file_fingerprint

    return file_fingerprint(path)


def file_app(entry: Mapping[str, Any], base_dir: Path | None, backend: str = "cpu") -> dict[str, Any]:
    """The apps.yaml entry of ``model: <file>`` completed: ``model`` made absolute (relative to
    ``base_dir``), the config's app keys where the entry gives none, and ``file``. ``config:`` (config.pbtxt
    keys as a mapping) overrides what the file says. Raises :class:`ModelFileError`."""
    ref = str(entry["model"])
    path = Path(ref).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    path = path.absolute()
    overrides = entry.get("config")
    text = None
    if overrides is not None:
        if not isinstance(overrides, Mapping):
            raise ModelFileError("config", f"must be a mapping of config.pbtxt keys, got {type(overrides).__name__}")
        try:
            text = proto.text_from_dict(dict(overrides))
        except Exception as e:  # json_format.ParseError and friends: a key or value config.pbtxt has not
            raise ModelFileError("config", f"not config.pbtxt keys: {e}") from None
    try:
        # torch_ok off: the node maps no torch; a torch.export file names its tensors in config:
        cfg = config_for_file(path, text, source=f"{ref} (config:)" if text else None,
                              name=str(entry.get("name", "")) or None, torch_ok=False)
        check_model_file(cfg, path)  # the config against the file, as Triton checks it at load (and a scan does)
    except ModelConfigError as e:
        raise ModelFileError("config" if text and e.file.endswith("(config:)") else "model", str(e)) from None
    try:
        fp = _file_fingerprint(path)
    except OSError as e:
        raise ModelFileError("model", f"{path}: cannot be read: {e}") from None
    keys = {k: v for k, v in app_keys(cfg, backend).items() if k not in entry}
    return {**keys, **entry, "model": str(path), "file": _file(cfg, path, 1, fp, None)}


def _check_readable(m: RepositoryModel, path: str) -> str | None:
    """Why the model file of ``m`` cannot be served, found without running it (a file the engine's own
    library cannot even parse), or None. Only ONNX files are checked here (with the ``onnx`` package when
    it is installed); any other failure shows when the instance loads the file."""
    if not path.lower().endswith(".onnx"):
        return None
    try:
        import onnx
    except ImportError:
        return None
    try:
        onnx.load(path, load_external_data=False)
    except Exception as e:  # DecodeError, OSError...: the file is not an ONNX model
        return f"{path}: not a readable ONNX model ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else e})"
    return None


def serves_versions(cfg: ModelConfig) -> bool:
    """Whether a model's ``version_policy`` may serve several versions at once (``latest`` with
    ``num_versions`` > 1, ``all``, ``specific`` with more than one version): then each served version is an
    app of its own, named :func:`version_app_name`. Otherwise the model is one app named as the model, and a
    new version replaces the old one by an Overlapped-Execution change of model."""
    p = cfg.version_policy
    return p.kind == "all" or (p.kind == "latest" and p.num_versions > 1) or (p.kind == "specific" and len(p.versions) > 1)


def version_app_name(model: str, version: int) -> str:
    """The app that serves ``version`` of ``model`` when its policy serves several versions (its UDP app
    id is that app's: ``status`` and the model's config, ``parameters.app_id``, give it)."""
    return f"{model}-v{version}"


def model_name(app_name: str, file_config_name: str | None, repository: str | None) -> str:
    """The OIP model name of an app: a repository model's (its config's ``name``), else the app's name."""
    return (file_config_name or app_name) if repository is not None else app_name


def repository_app(m: RepositoryModel, *, slo_ms: float, backend: str = "cpu", version: int | None = None) -> dict[str, Any]:
    """The app entry of one readable repository model: of ``version`` (default: its highest served version).
    A model whose policy serves several versions (:func:`serves_versions`) gets an app per version, named
    :func:`version_app_name`; another is one app named as the model. Raises :class:`ModelFileError` when it
    cannot be served."""
    if m.error is not None or m.config is None:
        raise ModelFileError("model", m.error or "no config")
    if not _NAME_RE.match(m.name):
        raise ModelFileError("name", f"model name {m.name!r} is not an app name gpuprims serves "
                                     "(1-64 characters of [a-z0-9_-])")
    files = m.latest if version is None else m.versions.get(version)
    if files is None:
        raise ModelFileError("version", "no version to serve" if version is None else
                                        f"version {version} is not served (served: {sorted(m.versions)})")
    why = _check_readable(m, files.model_path)
    if why is not None:
        raise ModelFileError("model", why)
    name = version_app_name(m.name, files.version) if serves_versions(m.config) else m.name
    if not _NAME_RE.match(name):
        raise ModelFileError("name", f"app name {name!r} of version {files.version} is longer than 64 characters; "
                                     "shorten the model's name")
    entry: dict[str, Any] = {"name": name, "model": files.model_path, "slo_ms": slo_ms}
    entry.update(app_keys(m.config, backend))
    entry["file"] = _file(m.config, Path(files.model_path), files.version, files.fingerprint,
                          str(Path(m.directory).parent))
    return entry


def repository_version_apps(m: RepositoryModel, *, slo_ms: float,
                            backend: str = "cpu") -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """The app entries of every version ``m`` serves (one, named as the model, unless its policy serves
    several: :func:`serves_versions`), and the versions that cannot be served with the reason. Raises
    :class:`ModelFileError` when the model itself cannot be served."""
    if m.error is not None or m.config is None or not serves_versions(m.config):
        return [repository_app(m, slo_ms=slo_ms, backend=backend)], []
    if not _NAME_RE.match(m.name):
        raise ModelFileError("name", f"model name {m.name!r} is not an app name gpuprims serves "
                                     "(1-64 characters of [a-z0-9_-])")
    apps: list[dict[str, Any]] = []
    bad: list[dict[str, str]] = []
    for v in m.versions:
        try:
            apps.append(repository_app(m, slo_ms=slo_ms, backend=backend, version=v))
        except ModelFileError as e:
            bad.append({"name": m.name, "version": str(v), "reason": str(e)})
    return apps, bad


def repository_apps(root: Path, *, mode: str = "none", load: Collection[str] = (), slo_ms: float = 100.0,
                    taken: Collection[Any] = (), backend: str = "cpu") -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """The app entries of a Triton model repository, and the models that cannot be served with the
    reason (each other model is unaffected). ``mode`` is the model control mode: ``explicit`` loads only
    the models named in ``load``; ``none`` and ``poll`` load all. ``taken`` are app names already used
    (apps.yaml's). Raises :class:`ModelFileError` when ``root`` is not a repository."""
    try:
        models = scan(root, torch_ok=False)
    except RepositoryError as e:
        raise ModelFileError("model_repository", str(e)) from None
    if mode == "explicit":
        found = {m.name for m in models}
        models = [m for m in models if m.name in load]
        missing = [n for n in load if n not in found]
        for n in missing:
            try:
                models.append(load_repository_model(root, n, torch_ok=False))
            except RepositoryError as e:
                models.append(RepositoryModel(n, str(root / n), None, {}, str(e)))
    apps: list[dict[str, Any]] = []
    bad: list[dict[str, str]] = []
    for m in models:
        if m.name in taken:
            bad.append({"name": m.name, "reason": f"an app of the config is named {m.name!r} too"})
            continue
        try:
            found, failed = repository_version_apps(m, slo_ms=slo_ms, backend=backend)
        except ModelFileError as e:
            bad.append({"name": m.name, "reason": str(e)})
            continue
        used = {*taken, *(a["name"] for a in apps)}
        clash = [a["name"] for a in found if a["name"] != m.name and a["name"] in used]
        if clash:
            bad.append({"name": m.name, "reason": f"the app name of a version, {clash[0]!r}, is taken by "
                                                  "another app"})
            continue
        apps.extend(found)
        bad.extend(failed)
    return apps, bad


__all__ = ["MODEL_FILE_SUFFIXES", "ModelFileError", "app_keys", "file_app", "is_model_file", "model_name",
           "repository_app", "repository_apps", "repository_version_apps", "serves_versions", "version_app_name"]
