"""The zoo's names: which models it has, their default class counts, labels and input shapes.

This module imports no torch (nor anything but the standard library), so the orchestrator, its
configuration checks and the CLI can know and check the zoo's names without paying for torch; how
each model is built lives in `apps.zoo.registry`, which needs torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

InputShape = tuple[int, int, int]
DEFAULT_INPUT_SHAPE: InputShape = (3, 224, 224)

#: Classes of the DNN-Recog router; its output picks the next model (paper Fig. 10).
RECOG_ROUTER_LABELS: tuple[str, ...] = ("person", "vehicle", "other")

#: Classes of the MIO-TCD classification challenge, the data set of the paper's ResNet-Car [47].
RESNET_CAR_LABELS: tuple[str, ...] = (
    "articulated_truck", "bicycle", "bus", "car", "motorcycle", "non-motorized_vehicle",
    "pedestrian", "pickup_truck", "single_unit_truck", "work_van", "background",
)  # fmt: skip

#: VGG-Face (Parkhi et al. 2015) was trained on 2,622 identities.
VGG_FACE_IDENTITIES = 2622

#: Wide&Deep's packed feature row (DUET): wide features, deep features, a sequence, then an image.
WIDE_DEEP_WIDE = 363
WIDE_DEEP_DEEP = 13
WIDE_DEEP_SEQ_LEN = 16
WIDE_DEEP_SEQ_FEATURES = 80
#: The ten MT-DNN tasks' tag counts (DUET Table I).
MT_DNN_TAGS = (29, 3, 3, 7, 9, 11, 9, 25, 7, 13)


def wide_deep_shape(image_side: int) -> tuple[int, int, int]:
    """The input shape of a Wide&Deep request carrying an ``image_side``-pixel square image."""
    if image_side < 1:
        raise ValueError(f"image_side must be >= 1, got {image_side}")
    fixed = WIDE_DEEP_WIDE + WIDE_DEEP_DEEP + WIDE_DEEP_SEQ_LEN * WIDE_DEEP_SEQ_FEATURES
    return (1, 1, fixed + 3 * image_side * image_side)


@dataclass(frozen=True)
class ZooName:
    """What the zoo says about one model without building it."""

    name: str
    num_classes: int
    description: str
    labels: tuple[str, ...] | None = None
    #: The request shape (C, H, W) used when ``build_model`` is given none.
    input_shape: InputShape = DEFAULT_INPUT_SHAPE


_NAMES = (
    ZooName("alexnet", 1000, "AlexNet (Krizhevsky et al. 2012), 61.1M parameters"),
    ZooName("mobilenet_v2", 1000, "MobileNetV2 (Sandler et al. 2018), 3.5M parameters"),
    ZooName("resnet18", 1000, "ResNet-18 (He et al. 2016), 11.7M parameters"),
    ZooName("resnet50", 1000, "ResNet-50 (He et al. 2016), 25.6M parameters"),
    ZooName("vgg19", 1000, "VGG-19 (Simonyan and Zisserman 2015), 143.7M parameters"),
    ZooName("resnext50", 1000, "ResNeXt-50 32x4d (Xie et al. 2017), 25.0M parameters"),
    ZooName(
        "recog_router",
        len(RECOG_ROUTER_LABELS),
        "DNN-Recog stage 1: MobileNetV2 classifier routing a request to vgg_face (person), "
        "resnet_car (vehicle) or nowhere (other)",
        RECOG_ROUTER_LABELS,
    ),
    ZooName(
        "vgg_face",
        VGG_FACE_IDENTITIES,
        "DNN-Recog person branch: VGG-Face (Parkhi et al. 2015), VGG-16 with 2,622 identities, 145.0M parameters",
    ),
    ZooName(
        "resnet_car",
        len(RESNET_CAR_LABELS),
        "DNN-Recog vehicle branch: ResNet-Car (Jung et al. 2017), ResNet-50 with the 11 MIO-TCD classes",
        RESNET_CAR_LABELS,
    ),
    ZooName(
        "googlenet",
        1000,
        "GoogLeNet (Szegedy et al. 2015) without its training-only auxiliary heads, 6.6M parameters; "
        "nine 4-branch Inception blocks (Opara's model)",
    ),
    ZooName(
        "inception_v3",
        1000,
        "Inception-v3 (Szegedy et al. 2016) without its training-only auxiliary head, 23.8M parameters; "
        "Inception blocks of 2 to 6 parallel branches (Opara's model)",
        input_shape=(3, 299, 299),
    ),
    ZooName(
        "bert",
        2,
        "BERT-base-like encoder (Devlin et al. 2019) over 32 token embeddings of 768: 12 layers with separate "
        "query/key/value projections, pooler and a 2-way classifier, 85.6M parameters (Opara's model)",
        input_shape=(1, 32, 768),
    ),
    ZooName(
        "wide_deep",
        2,
        "Wide&Deep (Cheng et al. 2016) as in DUET: wide linear, deep FFN, 2-layer LSTM and ResNet-18 "
        "encoders over one packed feature row (apps.zoo.seqnets), then a merge layer",
        input_shape=wide_deep_shape(64),
    ),
    ZooName(
        "siamese",
        2,
        "Siamese network as in DUET: two independent 2-layer LSTMs (hidden 128) over two sequences of "
        "64 x 64, cosine-merged",
        input_shape=(2, 64, 64),
    ),
    ZooName(
        "mt_dnn",
        sum(MT_DNN_TAGS),
        "MT-DNN shape as in DUET: a shared 2-block Transformer encoder over 32 x 128 embeddings and ten "
        "independent LSTM tagging heads (116 scores)",
        input_shape=(1, 32, 128),
    ),
    ZooName(
        "lstm",
        10,
        "Chrion's stacked LSTM: 12 layers of LSTM cells over 96 steps of 64 features, unrolled per cell",
        input_shape=(1, 96, 64),
    ),
)

#: Zoo models by canonical (lower-case) name.
NAMES: Mapping[str, ZooName] = MappingProxyType({n.name: n for n in _NAMES})

#: Other accepted names and the canonical name each stands for.
ALIASES: Mapping[str, str] = MappingProxyType(
    {"mobilenet": "mobilenet_v2", "mobilenetv2": "mobilenet_v2", "resnext50_32x4d": "resnext50",
     "inception": "inception_v3", "inceptionv3": "inception_v3"}
)


def known_names() -> frozenset[str]:
    """Every name the zoo accepts: canonical names and aliases (for configuration checks)."""
    return frozenset(NAMES) | frozenset(ALIASES)


def canonical_name(name: str) -> str:
    """Return the zoo's canonical name for `name` (case-insensitive, aliases resolved).

    Raises ValueError naming the known models if `name` is not one of them.
    """
    if not isinstance(name, str):
        raise ValueError(f"model name must be a string, got {name!r}")
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in NAMES:
        known = ", ".join(sorted(NAMES))
        aliases = ", ".join(f"{a} -> {c}" for a, c in sorted(ALIASES.items()))
        raise ValueError(f"unknown model {name!r}; known models: {known} (aliases: {aliases})")
    return key


def check_input_shape(input_shape: object) -> InputShape:
    """Return `input_shape` as a (C, H, W) tuple of positive ints, or raise ValueError naming it."""
    if not isinstance(input_shape, (tuple, list)) or len(input_shape) != 3:
        raise ValueError(f"input_shape must be (channels, height, width), got {input_shape!r}")
    for dim in input_shape:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"input_shape must hold three positive integers, got {input_shape!r}")
    channels, height, width = input_shape
    return (channels, height, width)
