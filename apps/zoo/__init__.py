"""Model zoo: the paper's DNNs in plain torch, with deterministic weights from a seed (no downloads).

`build_model("resnet50", seed=0)` gives the same weights in every process, so a request's output from
the framework can be checked against running the same model directly in torch. `load_model` also takes
a user model as ``"package.module:factory"``.

Importing this package imports no torch: the names (`apps.zoo.names`) are here at once, and what
builds or runs a model (`build_model`, `load_model`, `model_info`, `route_labels`, `MODELS`,
`ModelSpec`, from `apps.zoo.registry`) imports torch the first time one of them is used, so the
orchestrator's node and CLI can check model names without loading torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from apps.zoo.names import (
    ALIASES,
    DEFAULT_INPUT_SHAPE,
    NAMES,
    RECOG_ROUTER_LABELS,
    RESNET_CAR_LABELS,
    VGG_FACE_IDENTITIES,
    InputShape,
    ZooName,
    canonical_name,
    known_names,
)

#: Names served by `apps.zoo.registry`, which imports torch (PEP 562 lazy attributes).
_REGISTRY = frozenset({"MODELS", "ModelSpec", "build_model", "load_model", "model_info", "route_labels"})

__all__ = [
    "ALIASES",
    "DEFAULT_INPUT_SHAPE",
    "MODELS",
    "NAMES",
    "RECOG_ROUTER_LABELS",
    "RESNET_CAR_LABELS",
    "VGG_FACE_IDENTITIES",
    "InputShape",
    "ModelSpec",
    "ZooName",
    "build_model",
    "canonical_name",
    "known_names",
    "load_model",
    "model_info",
    "route_labels",
]


def __getattr__(name: str) -> Any:
    if name in _REGISTRY:
        return getattr(importlib.import_module("apps.zoo.registry"), name)
    raise AttributeError(f"module 'apps.zoo' has no attribute {name!r}")
