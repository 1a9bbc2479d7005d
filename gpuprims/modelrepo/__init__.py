"""A Triton model repository read into typed records (torch-free).

- :mod:`gpuprims.modelrepo.config`: ``config.pbtxt`` -> :class:`ModelConfig` (supported, ignored and
  refused fields; errors ``FILE:LINE: FIELD: what is wrong``).
- :mod:`gpuprims.modelrepo.complete`: a missing or partial config completed from the model file.
- :mod:`gpuprims.modelrepo.layout`: the repository's models, versions and content fingerprints.

Importing this package imports protobuf, tritonclient's ModelConfig message and numpy; never torch,
onnx or tensorrt.
"""

from __future__ import annotations

from gpuprims.modelrepo.config import (
    Accelerator,
    DynamicBatching,
    EngineChoice,
    GpuprimsParameters,
    InstanceGroup,
    InstanceKind,
    ModelConfig,
    QueuePolicy,
    TimeoutAction,
    VersionPolicy,
    Warmup,
    WarmupInput,
    build_config,
    config_for_file,
    load_config,
    parse_config,
)
from gpuprims.modelrepo.errors import ModelConfigError
from gpuprims.modelrepo.layout import (
    RepositoryError,
    RepositoryModel,
    VersionFiles,
    fingerprint,
    load_model,
    read_model,
    scan,
    stat_key,
)

__all__ = [
    "Accelerator",
    "DynamicBatching",
    "EngineChoice",
    "GpuprimsParameters",
    "InstanceGroup",
    "InstanceKind",
    "ModelConfig",
    "ModelConfigError",
    "QueuePolicy",
    "RepositoryError",
    "RepositoryModel",
    "TimeoutAction",
    "VersionFiles",
    "VersionPolicy",
    "Warmup",
    "WarmupInput",
    "build_config",
    "config_for_file",
    "fingerprint",
    "load_config",
    "load_model",
    "parse_config",
    "read_model",
    "scan",
    "stat_key",
]
