"""Architectures of the model zoo, written in plain torch.

Each network follows the layer layout of the original paper and of its torchvision counterpart, so that
at width 1.0 and the default class count the parameter counts are the well-known ones (AlexNet
61,100,840; VGG-19 143,667,240; ResNet-18 11,689,512; ResNet-50 25,557,032; ResNeXt-50 32x4d
25,028,904; MobileNetV2 3,504,872).

Two deliberate additions make the networks usable at small input sizes and in tiny test variants:

- `width` scales every channel count and hidden fully connected size (MobileNetV2 follows its own
  paper's rule: multiples of 8, and the last 1280 channels never shrink).
- A max-pool whose window no longer fits the spatial size it receives (AlexNet and VGG at inputs
  smaller than 224x224, e.g. 32x32) is built with a window of 1 in that dimension, i.e. it passes the
  feature map through. Pools have no parameters, so the parameter count does not change, and at
  224x224 the network is exactly the original.

The constructors only create layers; weights are set by `apps.zoo.init.init_weights`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch
from torch import nn

#: Marks the last BatchNorm of a residual branch; `init_weights` gives it a small scale so that the
#: residual stream of a deep network stays bounded in inference mode.
RESIDUAL_BN_ATTR = "_zoo_residual_bn"


def scale_channels(channels: int, width: float) -> int:
    """Return `channels * width` rounded to the nearest integer, at least 1."""
    return max(1, round(channels * width))


def make_divisible(value: float, divisor: int = 8) -> int:
    """Round `value` to a multiple of `divisor`, never more than 10% below it (MobileNetV2's rule)."""
    new_value = max(divisor, int(value + divisor / 2) // divisor * divisor)
    if new_value < 0.9 * value:
        new_value += divisor
    return new_value


def _conv_out(size: int, kernel: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def _fitting_max_pool(kernel: int, stride: int, hw: tuple[int, int]) -> tuple[nn.MaxPool2d, tuple[int, int]]:
    """A max-pool of `kernel`/`stride`, with window 1 in any dimension smaller than `kernel`."""
    kernels = tuple(kernel if size >= kernel else 1 for size in hw)
    strides = tuple(stride if size >= kernel else 1 for size in hw)
    out = tuple(_conv_out(size, k, s, 0) for size, k, s in zip(hw, kernels, strides))
    return nn.MaxPool2d(kernel_size=kernels, stride=strides), (out[0], out[1])


#: Marks a convolution whose input is not rectified (the image, a linear bottleneck): `init_weights`
#: uses gain 1 instead of ReLU's 2 for it, so every layer's output keeps about unit variance.
LINEAR_INPUT_ATTR = "_zoo_linear_input"


def _mark_residual(bn: nn.BatchNorm2d) -> nn.BatchNorm2d:
    setattr(bn, RESIDUAL_BN_ATTR, True)
    return bn


_ModuleT = TypeVar("_ModuleT", bound=nn.Module)


def _mark_linear_input(conv: _ModuleT) -> _ModuleT:
    setattr(conv, LINEAR_INPUT_ATTR, True)
    return conv


class AlexNet(nn.Module):
    """AlexNet (Krizhevsky et al. 2012), single-tower layout as in torchvision.

    Needs inputs of at least 7x7 pixels (the first 11x11 convolution, stride 4, padding 2).
    """

    def __init__(self, num_classes: int, input_shape: tuple[int, int, int], width: float = 1.0) -> None:
        super().__init__()
        in_ch, height, width_px = input_shape
        if min(height, width_px) < 7:
            raise ValueError(f"alexnet needs inputs of at least 7x7 pixels, got input_shape={input_shape}")
        c1, c2, c3, c4, c5 = (scale_channels(c, width) for c in (64, 192, 384, 256, 256))
        hidden = scale_channels(4096, width)
        hw = (_conv_out(height, 11, 4, 2), _conv_out(width_px, 11, 4, 2))
        pool1, hw = _fitting_max_pool(3, 2, hw)
        pool2, hw = _fitting_max_pool(3, 2, hw)
        pool3, hw = _fitting_max_pool(3, 2, hw)
        self.features = nn.Sequential(
            _mark_linear_input(nn.Conv2d(in_ch, c1, kernel_size=11, stride=4, padding=2)),
            nn.ReLU(inplace=True),
            pool1,
            nn.Conv2d(c1, c2, kernel_size=5, padding=2),
            nn.ReLU(inplace=True),
            pool2,
            nn.Conv2d(c2, c3, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(c3, c4, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(c4, c5, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            pool3,
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(p=0.5),
            nn.Linear(c5 * 6 * 6, hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(p=0.5),
            nn.Linear(hidden, hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


#: VGG layer configurations (Simonyan and Zisserman 2015): channel counts, "M" for a 2x2 max-pool.
VGG_CONFIGS: dict[str, tuple[int | str, ...]] = {
    "vgg16": (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"),
    "vgg19": (
        64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M",
        512, 512, 512, 512, "M", 512, 512, 512, 512, "M",
    ),
}  # fmt: skip


class VGG(nn.Module):
    """VGG without batch normalisation (configurations D = VGG-16 and E = VGG-19)."""

    def __init__(
        self,
        config: Sequence[int | str],
        num_classes: int,
        input_shape: tuple[int, int, int],
        width: float = 1.0,
    ) -> None:
        super().__init__()
        in_ch, height, width_px = input_shape
        hw = (height, width_px)
        layers: list[nn.Module] = []
        channels = in_ch
        for item in config:
            if item == "M":
                pool, hw = _fitting_max_pool(2, 2, hw)
                layers.append(pool)
            else:
                out = scale_channels(int(item), width)
                conv = nn.Conv2d(channels, out, kernel_size=3, padding=1)
                if not layers:
                    _mark_linear_input(conv)
                layers += [conv, nn.ReLU(inplace=True)]
                channels = out
        hidden = scale_channels(4096, width)
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(channels * 7 * 7, hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(p=0.5),
            nn.Linear(hidden, hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(p=0.5),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def _conv3x3(in_ch: int, out_ch: int, stride: int = 1, groups: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, kernel_size=3, stride=stride, padding=1, groups=groups, bias=False)


def _conv1x1(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with an identity (or 1x1 projection) shortcut; ResNet-18/34."""

    expansion = 1

    def __init__(self, in_ch: int, planes: int, stride: int = 1, groups: int = 1, base_width: int = 64) -> None:
        super().__init__()
        if groups != 1 or base_width != 64:
            raise ValueError(f"BasicBlock supports groups=1, base_width=64 only, got {groups}, {base_width}")
        self.conv1 = _conv3x3(in_ch, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = _mark_residual(nn.BatchNorm2d(planes))
        self.downsample: nn.Module | None = None
        if stride != 1 or in_ch != planes:
            self.downsample = nn.Sequential(_conv1x1(in_ch, planes, stride), nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (grouped for ResNeXt), 1x1 expand by 4, with shortcut; ResNet-50, ResNeXt-50.

    The stride sits on the 3x3 convolution (ResNet v1.5, as in torchvision).
    """

    expansion = 4

    def __init__(self, in_ch: int, planes: int, stride: int = 1, groups: int = 1, base_width: int = 64) -> None:
        super().__init__()
        inner = max(1, int(planes * (base_width / 64.0))) * groups
        out_ch = planes * self.expansion
        self.conv1 = _conv1x1(in_ch, inner)
        self.bn1 = nn.BatchNorm2d(inner)
        self.conv2 = _conv3x3(inner, inner, stride, groups)
        self.bn2 = nn.BatchNorm2d(inner)
        self.conv3 = _conv1x1(inner, out_ch)
        self.bn3 = _mark_residual(nn.BatchNorm2d(out_ch))
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(_conv1x1(in_ch, out_ch, stride), nn.BatchNorm2d(out_ch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """ResNet (He et al. 2016) and ResNeXt (Xie et al. 2017) with a 7x7 stem and four stages.

    Every layer is padded, so any input of at least 1x1 pixels runs (the stages reduce by 32).
    """

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: Sequence[int],
        num_classes: int,
        input_shape: tuple[int, int, int],
        width: float = 1.0,
        groups: int = 1,
        width_per_group: int = 64,
    ) -> None:
        super().__init__()
        if len(layers) != 4:
            raise ValueError(f"ResNet needs 4 stage depths, got {layers}")
        in_ch = input_shape[0]
        stem = scale_channels(64, width)
        self.conv1 = _mark_linear_input(nn.Conv2d(in_ch, stem, kernel_size=7, stride=2, padding=3, bias=False))
        self.bn1 = nn.BatchNorm2d(stem)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        channels = stem
        stages: list[nn.Sequential] = []
        for index, (base_planes, depth) in enumerate(zip((64, 128, 256, 512), layers)):
            planes = scale_channels(base_planes, width)
            stride = 1 if index == 0 else 2
            blocks: list[nn.Module] = []
            for block_index in range(depth):
                blocks.append(block(channels, planes, stride if block_index == 0 else 1, groups, width_per_group))
                channels = planes * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _conv_bn_relu6(in_ch: int, out_ch: int, kernel: int = 3, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_ch, out_ch, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
        nn.BatchNorm2d(out_ch),
        nn.ReLU6(inplace=True),
    )


class InvertedResidual(nn.Module):
    """MobileNetV2 block: 1x1 expand, 3x3 depthwise, linear 1x1 projection, shortcut when shapes match."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        hidden = round(in_ch * expand_ratio)
        self.use_shortcut = stride == 1 and in_ch == out_ch
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            expand = _conv_bn_relu6(in_ch, hidden, kernel=1)
            _mark_linear_input(expand[0])  # the block input is a linear bottleneck
            layers.append(expand)
        project_bn = nn.BatchNorm2d(out_ch)
        if self.use_shortcut:
            _mark_residual(project_bn)
        layers += [
            _conv_bn_relu6(hidden, hidden, stride=stride, groups=hidden),
            nn.Conv2d(hidden, out_ch, 1, 1, 0, bias=False),
            project_bn,
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(x)
        return x + out if self.use_shortcut else out


#: MobileNetV2 stages: expansion t, output channels c, repeats n, first stride s.
MOBILENET_V2_SETTINGS: tuple[tuple[int, int, int, int], ...] = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


class MobileNetV2(nn.Module):
    """MobileNetV2 (Sandler et al. 2018) with torchvision's channel rounding; any input size runs."""

    def __init__(self, num_classes: int, input_shape: tuple[int, int, int], width: float = 1.0) -> None:
        super().__init__()
        channels = make_divisible(32 * width)
        self.last_channel = make_divisible(1280 * max(1.0, width))
        stem = _conv_bn_relu6(input_shape[0], channels, stride=2)
        _mark_linear_input(stem[0])
        features: list[nn.Module] = [stem]
        for expand, out_base, repeats, first_stride in MOBILENET_V2_SETTINGS:
            out_ch = make_divisible(out_base * width)
            for index in range(repeats):
                features.append(InvertedResidual(channels, out_ch, first_stride if index == 0 else 1, expand))
                channels = out_ch
        head = _conv_bn_relu6(channels, self.last_channel, kernel=1)
        _mark_linear_input(head[0])
        features.append(head)
        self.features = nn.Sequential(*features)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.classifier = nn.Sequential(nn.Dropout(p=0.2), nn.Linear(self.last_channel, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))
