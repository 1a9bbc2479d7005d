"""Model zoo: the paper's DNNs in plain torch, with deterministic weights from a seed (no downloads).

`build_model("resnet50", seed=0)` gives the same weights in every process, so a request's output from
the framework can be checked against running the same model directly in torch. `load_model` also takes
a user model as ``"package.module:factory"``.
"""

from __future__ import annotations

from apps.zoo.registry import (
    ALIASES,
    DEFAULT_INPUT_SHAPE,
    MODELS,
    RECOG_ROUTER_LABELS,
    RESNET_CAR_LABELS,
    VGG_FACE_IDENTITIES,
    InputShape,
    ModelSpec,
    build_model,
    canonical_name,
    load_model,
    model_info,
    route_labels,
)

__all__ = [
    "ALIASES",
    "DEFAULT_INPUT_SHAPE",
    "MODELS",
    "RECOG_ROUTER_LABELS",
    "RESNET_CAR_LABELS",
    "VGG_FACE_IDENTITIES",
    "InputShape",
    "ModelSpec",
    "build_model",
    "canonical_name",
    "load_model",
    "model_info",
    "route_labels",
]
