"""Model file formats of a Triton model repository: platform/backend names, default file names, the
file engines that run each format, and the repository's numeric version directories.

| platform / backend | format | default file | engine kinds (first: the default) |
|---|---|---|---|
| ``onnxruntime_onnx`` / ``onnxruntime`` | ``onnx`` | ``model.onnx`` | onnxruntime, openvino, tensorrt |
| ``tensorrt_plan`` / ``tensorrt`` | ``tensorrt_plan`` | ``model.plan`` | tensorrt |
| ``pytorch_libtorch`` / ``pytorch`` | ``torchscript`` | ``model.pt`` | torchscript, compile |
| ``pytorch`` with ``model.pt2`` | ``torch_export`` | ``model.pt2`` | torch_export, compile |
| backend ``openvino`` | ``openvino_ir`` (or ``onnx``) | ``model.xml`` | openvino |

The file's extension (``default_model_filename``) decides the format where it names one.
"""

from __future__ import annotations

from pathlib import Path

#: Triton platform -> the backend that serves it.
PLATFORMS: dict[str, str] = {
    "onnxruntime_onnx": "onnxruntime",
    "tensorrt_plan": "tensorrt",
    "pytorch_libtorch": "pytorch",
}
#: Backends gpuprims serves -> the format of their default file.
BACKENDS: dict[str, str] = {
    "onnxruntime": "onnx",
    "tensorrt": "tensorrt_plan",
    "pytorch": "torchscript",
    "openvino": "openvino_ir",
}
#: Platforms and backends Triton knows that gpuprims does not serve (a clearer refusal than "unknown").
UNSUPPORTED: dict[str, str] = {
    "tensorflow_graphdef": "TensorFlow models are not supported",
    "tensorflow_savedmodel": "TensorFlow models are not supported",
    "tensorflow": "TensorFlow models are not supported",
    "caffe2_netdef": "Caffe2 models are not supported",
    "python": "Python-backend models are not supported",
    "fil": "FIL (tree) models are not supported",
    "dali": "DALI pipelines are not supported",
    "vllm": "vLLM models are not supported",
    "tensorrtllm": "TensorRT-LLM models are not supported",
    "ensemble": "ensembles are not supported yet: they come with pipelines",
}
#: Format -> its default file name in a version directory.
DEFAULT_FILENAMES: dict[str, str] = {
    "onnx": "model.onnx",
    "tensorrt_plan": "model.plan",
    "torchscript": "model.pt",
    "torch_export": "model.pt2",
    "openvino_ir": "model.xml",
}
#: File extension -> format (a ``default_model_filename`` that names one decides the format).
EXTENSIONS: dict[str, str] = {
    ".onnx": "onnx",
    ".plan": "tensorrt_plan",
    ".engine": "tensorrt_plan",
    ".pt": "torchscript",
    ".pth": "torchscript",
    ".pt2": "torch_export",
    ".xml": "openvino_ir",
}
#: Format -> the file engine kinds (gpuprims.engines.files) that can run it, the default first.
ENGINE_KINDS: dict[str, tuple[str, ...]] = {
    "onnx": ("onnxruntime", "openvino", "tensorrt"),
    "tensorrt_plan": ("tensorrt",),
    "torchscript": ("torchscript", "compile"),
    "torch_export": ("torch_export", "compile"),
    "openvino_ir": ("openvino",),
}
#: Every file engine kind a config may name (``parameters { key: "engine" ... }``).
ALL_ENGINE_KINDS: tuple[str, ...] = ("onnxruntime", "openvino", "tensorrt", "torchscript", "torch_export",
                                     "compile")


def backend_of(platform: str, backend: str) -> str | None:
    """The backend serving ``platform``/``backend`` ("" where neither is given), or None when they do
    not name one gpuprims serves (see :func:`platform_problem`)."""
    if backend:
        return backend if backend in BACKENDS else None
    if platform:
        return PLATFORMS.get(platform)
    return ""


def platform_problem(platform: str, backend: str) -> tuple[str, str] | None:
    """(field, what is wrong) when ``platform``/``backend`` are not ones gpuprims serves, else None."""
    for fld, value, known in (("platform", platform, PLATFORMS), ("backend", backend, BACKENDS)):
        if value and value not in known:
            if value in UNSUPPORTED:
                return fld, f"{fld} {value!r}: {UNSUPPORTED[value]}"
            return fld, (f"unknown {fld} {value!r}: gpuprims serves platforms {', '.join(PLATFORMS)} and "
                         f"backends {', '.join(BACKENDS)}")
    if platform and backend and PLATFORMS[platform] != backend:
        return "backend", (f"backend {backend!r} does not serve platform {platform!r} (its backend is "
                           f"{PLATFORMS[platform]!r})")
    return None


def format_of(backend: str, default_model_filename: str) -> str | None:
    """The model file's format: from the file name's extension where it names one, else from the
    backend; None when neither says."""
    if default_model_filename:
        fmt = EXTENSIONS.get(Path(default_model_filename).suffix.lower())
        if fmt is not None:
            return fmt
    return BACKENDS.get(backend)


def format_of_file(path: str | Path) -> str | None:
    """The format a model file's name says (``model.onnx`` -> ``onnx``), or None."""
    return EXTENSIONS.get(Path(path).suffix.lower())


def version_dirs(model_dir: str | Path) -> dict[int, Path]:
    """The model's version directories by version: the subdirectories named by a positive number
    without leading zeros (Triton ignores the others, ``0`` and ``01`` among them)."""
    out: dict[int, Path] = {}
    root = Path(model_dir)
    if not root.is_dir():
        return out
    for p in root.iterdir():
        if p.is_dir() and p.name.isdigit() and p.name.isascii() and not p.name.startswith("0"):
            out[int(p.name)] = p
    return dict(sorted(out.items()))


def model_file(version_dir: str | Path, filename: str) -> Path | None:
    """The model file of a version directory, or None when it has none. An ONNX model may be a
    directory ``model.onnx/`` holding ``model.onnx`` beside its external data (Triton's layout)."""
    p = Path(version_dir) / filename
    if p.is_file():
        return p
    if p.is_dir() and (p / filename).is_file():
        return p / filename
    return None


def guess_filename(version_dir: str | Path) -> str | None:
    """The default file name present in a version directory when the config names no platform,
    backend or file (Triton then finds the backend by the file), or None."""
    for name in DEFAULT_FILENAMES.values():
        if model_file(version_dir, name) is not None:
            return name
    return None
