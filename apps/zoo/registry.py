"""How each zoo model is built, and loading of user models given as ``module:factory`` (the names,
class counts and shapes, which need no torch, are in `apps.zoo.names`).

Determinism contract (the correctness oracle of the framework relies on it): `build_model(name,
seed=s, num_classes=k, input_shape=shape, width=w)` builds the same architecture and bit-identical
weights in every process and on every machine, whatever the thread count or the global RNG state, which
it leaves untouched. Weights are drawn on the CPU from a generator keyed by the canonical name, the
seed, the class count, the input channel count and the width (`apps.zoo.init`), and only then moved to
`device`. So the framework's output for a request can be checked by building the same model in a test
and running it on the same input.

Weights are bit-identical; outputs are bit-identical only for the same batch on the same backend.
Kernels pick different blockings for different batch sizes, so one request run inside a batch of 8
and the same request run alone differ by float rounding (about 1e-6 relative on the CPU backend):
compare a request against the direct run with a tolerance (rtol=1e-4, atol=1e-4 holds for every zoo
model; ``torch.testing.assert_close``'s float32 default is too tight for AlexNet and VGG) or rerun the
same batch.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from apps.zoo.inception import Bert, GoogLeNet, InceptionV3
from apps.zoo.init import init_weights
from apps.zoo.names import (
    DEFAULT_INPUT_SHAPE,
    NAMES,
    RECOG_ROUTER_LABELS,
    InputShape,
    canonical_name,
    check_input_shape,
)
from apps.zoo.nets import VGG, VGG_CONFIGS, AlexNet, BasicBlock, Bottleneck, MobileNetV2, ResNet
from apps.zoo.seqnets import MTDNN, Siamese, StackedLSTM, WideDeep

Builder = Callable[[int, InputShape, float], nn.Module]


@dataclass(frozen=True)
class ModelSpec:
    """What the zoo knows about one model: how to build it, its default class count and labels."""

    name: str
    builder: Builder
    num_classes: int
    description: str
    labels: tuple[str, ...] | None = None
    #: The request shape (C, H, W) used when ``build_model`` is given none.
    input_shape: InputShape = DEFAULT_INPUT_SHAPE


def _resnet(block: type[BasicBlock] | type[Bottleneck], layers: tuple[int, ...], **kw: int) -> Builder:
    def build(num_classes: int, input_shape: InputShape, width: float) -> nn.Module:
        return ResNet(block, layers, num_classes, input_shape, width, **kw)

    return build


def _vgg(config: str) -> Builder:
    def build(num_classes: int, input_shape: InputShape, width: float) -> nn.Module:
        return VGG(VGG_CONFIGS[config], num_classes, input_shape, width)

    return build


#: How each zoo model is built (its names, class counts and shapes are in `apps.zoo.names`).
_BUILDERS: Mapping[str, Builder] = {
    "alexnet": AlexNet,
    "mobilenet_v2": MobileNetV2,
    "resnet18": _resnet(BasicBlock, (2, 2, 2, 2)),
    "resnet50": _resnet(Bottleneck, (3, 4, 6, 3)),
    "vgg19": _vgg("vgg19"),
    "resnext50": _resnet(Bottleneck, (3, 4, 6, 3), groups=32, width_per_group=4),
    "recog_router": MobileNetV2,
    "vgg_face": _vgg("vgg16"),
    "resnet_car": _resnet(Bottleneck, (3, 4, 6, 3)),
    "googlenet": GoogLeNet,
    "inception_v3": InceptionV3,
    "bert": Bert,
    "wide_deep": WideDeep,
    "siamese": Siamese,
    "mt_dnn": MTDNN,
    "lstm": StackedLSTM,
}

#: Zoo models by canonical (lower-case) name: `apps.zoo.names.NAMES` with a builder each.
MODELS: Mapping[str, ModelSpec] = MappingProxyType({
    n.name: ModelSpec(n.name, _BUILDERS[n.name], n.num_classes, n.description, n.labels, n.input_shape)
    for n in NAMES.values()})


def _check_int(label: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{label} must be an integer >= {minimum}, got {value!r}")
    return value


def build_model(
    name: str,
    *,
    seed: int = 0,
    num_classes: int | None = None,
    input_shape: InputShape | None = None,
    width: float = 1.0,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """Build zoo model `name` with deterministic weights, in inference mode.

    The model takes float32 input of shape (N, *input_shape) and returns logits (N, num_classes);
    `num_classes` defaults to the model's own (`MODELS[name].num_classes`) and `input_shape` to its own
    (`MODELS[name].input_shape`: (3, 224, 224) for the image models). `width` scales channel and
    hidden sizes for small test variants. The returned module is in `.eval()` mode with
    `requires_grad` off on every parameter. Same arguments give bit-identical weights in any process
    (see the module docstring); a different `seed` gives different weights.

    `device="meta"` builds the architecture without allocating or initialising weights (cheap: for
    parameter counts and memory planning with `model_info`). Any other device gets the CPU-drawn
    weights moved to it.

    Raises ValueError for an unknown name (listing the known ones) or a bad seed, class count, input
    shape or width.
    """
    canonical = canonical_name(name)
    spec = MODELS[canonical]
    _check_int("seed", seed, -(1 << 63))
    classes = spec.num_classes if num_classes is None else _check_int("num_classes", num_classes, 1)
    shape = check_input_shape(spec.input_shape if input_shape is None else input_shape)
    if isinstance(width, bool) or not isinstance(width, (int, float)) or not math.isfinite(width) or width <= 0:
        raise ValueError(f"width must be a finite number > 0, got {width!r}")
    target = torch.device(device)
    # Build on the meta device: no memory, no default initialisation, no use of the global RNG.
    with torch.device("meta"):
        model = spec.builder(classes, shape, float(width))
    if target.type != "meta":
        # float32 whatever torch's default dtype is, so the draws (and so the weights) never change.
        model = model.to_empty(device="cpu").float()
        # Height and width only change parameter-free pooling windows, so they are not in the key:
        # the weights of a model built for 224x224 and for 64x64 inputs are the same tensors.
        key = f"{canonical}:seed={seed}:classes={classes}:channels={shape[0]}:width={float(width)!r}"
        init_weights(model, key)
        if target.type != "cpu":
            model = model.to(target)
    model.requires_grad_(False)
    return model.eval()


def _split_factory_spec(spec: str) -> tuple[str, str]:
    module_name, _, attr_path = spec.partition(":")
    module_name, attr_path = module_name.strip(), attr_path.strip()
    if not module_name or not attr_path or ":" in attr_path:
        raise ValueError(f"user model must be given as 'package.module:factory', got {spec!r}")
    return module_name, attr_path


def _accepted_kwargs(factory: Callable[..., Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return dict(kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return dict(kwargs)
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in kwargs.items() if k in names}


def load_model(spec: str, **kwargs: Any) -> nn.Module:
    """Build a zoo model by name, or a user model given as ``"package.module:factory"``.

    For a zoo name this is `build_model(spec, **kwargs)`. For a user model the module is imported, the
    (possibly dotted) attribute looked up and called with those of `kwargs` its signature accepts
    (all of them if it takes ``**kwargs``; a None value is left out so the factory's default applies),
    while the global torch RNG is seeded with
    ``kwargs.get("seed", 0)`` and restored afterwards, so a factory that initialises with torch's
    default initialisers is deterministic too. The result is put in `.eval()` mode with
    `requires_grad` off, and moved to ``kwargs["device"]`` if the factory did not take `device`.

    Raises ValueError when the spec is malformed, the module does not import, the attribute is missing,
    it is not callable, or it does not return a `torch.nn.Module`.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"model spec must be a zoo name or 'package.module:factory', got {spec!r}")
    if ":" not in spec:
        return build_model(spec, **kwargs)
    module_name, attr_path = _split_factory_spec(spec)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"user model {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    factory: Any = module
    for part in attr_path.split("."):
        if not hasattr(factory, part):
            raise ValueError(f"user model {spec!r}: module {module_name!r} has no attribute {attr_path!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ValueError(f"user model {spec!r}: {attr_path!r} is not callable (it is {type(factory).__name__})")
    seed = _check_int("seed", kwargs.get("seed", 0), -(1 << 63))
    # None means "the factory's own default" (as num_classes=None does for zoo models).
    accepted = _accepted_kwargs(factory, {k: v for k, v in kwargs.items() if v is not None})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed & ((1 << 63) - 1))
        model = factory(**accepted)
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"user model {spec!r}: factory returned {type(model).__name__}, not a torch.nn.Module"
        )
    if "device" in kwargs and "device" not in accepted:
        model = model.to(torch.device(kwargs["device"]))
    model.requires_grad_(False)
    return model.eval()


def model_info(model: nn.Module, input_shape: InputShape | None = None) -> dict[str, Any]:
    """Return sizes of `model`: parameter and buffer counts and bytes, and per-request input bytes.

    Keys: ``params`` (number of parameter elements), ``param_bytes``, ``buffers`` (buffer elements,
    e.g. BatchNorm statistics), ``buffer_bytes``, ``total_bytes`` (parameters plus buffers); with
    `input_shape` also ``input_shape`` (a list) and ``input_bytes`` (one float32 request). Shared
    tensors count once. Works on meta-device models (nothing is allocated).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    params = list(model.parameters())
    buffers = list(model.buffers())
    info: dict[str, Any] = {
        "params": sum(p.numel() for p in params),
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "buffers": sum(b.numel() for b in buffers),
        "buffer_bytes": sum(b.numel() * b.element_size() for b in buffers),
    }
    info["total_bytes"] = info["param_bytes"] + info["buffer_bytes"]
    if input_shape is not None:
        shape = check_input_shape(input_shape)
        info["input_shape"] = list(shape)
        info["input_bytes"] = math.prod(shape) * torch.finfo(torch.float32).bits // 8
    return info


def route_labels(logits: torch.Tensor, labels: tuple[str, ...] = RECOG_ROUTER_LABELS) -> list[str]:
    """Return, per row of `logits` (N, len(labels)), the label of its largest logit.

    Used by DNN-Recog: ``recog_router`` outputs are mapped to "person", "vehicle" or "other".
    """
    if logits.dim() != 2 or logits.shape[1] != len(labels):
        raise ValueError(f"logits must have shape (N, {len(labels)}), got {tuple(logits.shape)}")
    return [labels[int(i)] for i in logits.argmax(dim=1).tolist()]
