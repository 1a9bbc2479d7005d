"""Multi-branch networks of the zoo: GoogLeNet, Inception-v3 and a BERT-base-like encoder (Opara's models).

Both follow torchvision's layer layout (torchvision itself has no build matching the pinned torch), so
at width 1.0 and 1000 classes the parameter counts are the well-known ones without the auxiliary
classifiers, which only training uses: GoogLeNet 6,624,904 (torchvision's 13,004,888 less its two aux
heads), Inception-v3 23,834,568 (27,161,264 less its aux head). GoogLeNet keeps torchvision's 3x3
convolution in the "5x5" branch. Every convolution is a `BasicConv2d` (convolution without bias,
BatchNorm with eps 0.001, ReLU), and every pooling is a module, so a traced graph names what each
operator is.

Each Inception block runs its branches on the same input and concatenates them: the operator
parallelism Opara's streams exploit (`gpuprims.opara`). `width` scales every channel count; the
concatenated widths follow from the scaled branches. Inputs must be large enough for the stem's
strides: at least 16x16 pixels for GoogLeNet and 75x75 for Inception-v3 (as torchvision); smaller
ones are refused with the minimum in the message.

`Bert` is a BERT-base-like encoder over token embeddings (its docstring): the paper's third model,
whose parallel operators are the query, key and value projections of each layer.

The constructors only create layers; weights are set by `apps.zoo.init.init_weights`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from apps.zoo.nets import LINEAR_INPUT_ATTR, scale_channels

#: The smallest input side each network accepts (the stem's strided layers need it).
GOOGLENET_MIN_SIDE = 16
INCEPTION_V3_MIN_SIDE = 75


class BasicConv2d(nn.Module):
    """Convolution (no bias), BatchNorm (eps 0.001), ReLU: the unit of both networks."""

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int | tuple[int, int], stride: int = 1,
                 padding: int | tuple[int, int] = 0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_ch, out_ch, kernel_size, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(out_ch, eps=0.001)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


def _check_side(model: str, input_shape: tuple[int, int, int], minimum: int) -> None:
    if min(input_shape[1], input_shape[2]) < minimum:
        raise ValueError(
            f"{model} needs inputs of at least {minimum}x{minimum} pixels, got input_shape={input_shape}"
        )


class GoogLeNetInception(nn.Module):
    """GoogLeNet's Inception block: 1x1 | 1x1-3x3 | 1x1-3x3 | maxpool-1x1, concatenated."""

    def __init__(self, in_ch: int, ch1x1: int, ch3x3red: int, ch3x3: int, ch5x5red: int, ch5x5: int,
                 pool_proj: int) -> None:
        super().__init__()
        self.branch1 = BasicConv2d(in_ch, ch1x1, 1)
        self.branch2 = nn.Sequential(BasicConv2d(in_ch, ch3x3red, 1), BasicConv2d(ch3x3red, ch3x3, 3, padding=1))
        self.branch3 = nn.Sequential(BasicConv2d(in_ch, ch5x5red, 1), BasicConv2d(ch5x5red, ch5x5, 3, padding=1))
        self.branch4 = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1, ceil_mode=True),
                                     BasicConv2d(in_ch, pool_proj, 1))
        self.out_channels = ch1x1 + ch3x3 + ch5x5 + pool_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch1(x), self.branch2(x), self.branch3(x), self.branch4(x)], 1)


#: GoogLeNet's nine Inception blocks: (1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool projection).
GOOGLENET_BLOCKS: dict[str, tuple[int, int, int, int, int, int]] = {
    "inception3a": (64, 96, 128, 16, 32, 32),
    "inception3b": (128, 128, 192, 32, 96, 64),
    "inception4a": (192, 96, 208, 16, 48, 64),
    "inception4b": (160, 112, 224, 24, 64, 64),
    "inception4c": (128, 128, 256, 24, 64, 64),
    "inception4d": (112, 144, 288, 32, 64, 64),
    "inception4e": (256, 160, 320, 32, 128, 128),
    "inception5a": (256, 160, 320, 32, 128, 128),
    "inception5b": (384, 192, 384, 48, 128, 128),
}


class GoogLeNet(nn.Module):
    """GoogLeNet (Szegedy et al. 2015) as in torchvision, without the auxiliary classifiers."""

    def __init__(self, num_classes: int, input_shape: tuple[int, int, int], width: float = 1.0) -> None:
        super().__init__()
        _check_side("googlenet", input_shape, GOOGLENET_MIN_SIDE)

        def s(c: int) -> int:
            return scale_channels(c, width)

        self.conv1 = BasicConv2d(input_shape[0], s(64), 7, stride=2, padding=3)
        setattr(self.conv1.conv, LINEAR_INPUT_ATTR, True)
        self.maxpool1 = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        self.conv2 = BasicConv2d(s(64), s(64), 1)
        self.conv3 = BasicConv2d(s(64), s(192), 3, padding=1)
        self.maxpool2 = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        channels = s(192)
        blocks: dict[str, GoogLeNetInception] = {}
        for name, config in GOOGLENET_BLOCKS.items():
            blocks[name] = GoogLeNetInception(channels, *(s(c) for c in config))
            channels = blocks[name].out_channels
        self.inception3a, self.inception3b = blocks["inception3a"], blocks["inception3b"]
        self.maxpool3 = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        self.inception4a, self.inception4b = blocks["inception4a"], blocks["inception4b"]
        self.inception4c, self.inception4d = blocks["inception4c"], blocks["inception4d"]
        self.inception4e = blocks["inception4e"]
        self.maxpool4 = nn.MaxPool2d(2, stride=2, ceil_mode=True)
        self.inception5a, self.inception5b = blocks["inception5a"], blocks["inception5b"]
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.dropout = nn.Dropout(p=0.2)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool1(self.conv1(x))
        x = self.maxpool2(self.conv3(self.conv2(x)))
        x = self.maxpool3(self.inception3b(self.inception3a(x)))
        x = self.inception4c(self.inception4b(self.inception4a(x)))
        x = self.maxpool4(self.inception4e(self.inception4d(x)))
        x = self.inception5b(self.inception5a(x))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(self.dropout(x))


class _Scale:
    """Scales a channel count by the network's width (`scale_channels`)."""

    def __init__(self, width: float) -> None:
        self.width = width

    def __call__(self, channels: int) -> int:
        return scale_channels(channels, self.width)


class InceptionA(nn.Module):
    """Inception-v3's 35x35 block: 1x1 | 1x1-5x5 | 1x1-3x3-3x3 | avgpool-1x1."""

    def __init__(self, in_ch: int, pool_features: int, s: _Scale) -> None:
        super().__init__()
        self.branch1x1 = BasicConv2d(in_ch, s(64), 1)
        self.branch5x5_1 = BasicConv2d(in_ch, s(48), 1)
        self.branch5x5_2 = BasicConv2d(s(48), s(64), 5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(in_ch, s(64), 1)
        self.branch3x3dbl_2 = BasicConv2d(s(64), s(96), 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(s(96), s(96), 3, padding=1)
        self.branch_pool_avg = nn.AvgPool2d(3, stride=1, padding=1)
        self.branch_pool = BasicConv2d(in_ch, s(pool_features), 1)
        self.out_channels = s(64) + s(64) + s(96) + s(pool_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)
        b5 = self.branch5x5_2(self.branch5x5_1(x))
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        bp = self.branch_pool(self.branch_pool_avg(x))
        return torch.cat([b1, b5, b3, bp], 1)


class InceptionB(nn.Module):
    """Inception-v3's grid reduction 35 -> 17: 3x3/2 | 1x1-3x3-3x3/2 | maxpool/2."""

    def __init__(self, in_ch: int, s: _Scale) -> None:
        super().__init__()
        self.branch3x3 = BasicConv2d(in_ch, s(384), 3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(in_ch, s(64), 1)
        self.branch3x3dbl_2 = BasicConv2d(s(64), s(96), 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(s(96), s(96), 3, stride=2)
        self.branch_pool = nn.MaxPool2d(3, stride=2)
        self.out_channels = s(384) + s(96) + in_ch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3(x)
        bd = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([b3, bd, self.branch_pool(x)], 1)


class InceptionC(nn.Module):
    """Inception-v3's 17x17 block with factorised 7x7 convolutions (1x7 and 7x1)."""

    def __init__(self, in_ch: int, channels_7x7: int, s: _Scale) -> None:
        super().__init__()
        c7 = s(channels_7x7)
        self.branch1x1 = BasicConv2d(in_ch, s(192), 1)
        self.branch7x7_1 = BasicConv2d(in_ch, c7, 1)
        self.branch7x7_2 = BasicConv2d(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7_3 = BasicConv2d(c7, s(192), (7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = BasicConv2d(in_ch, c7, 1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = BasicConv2d(c7, s(192), (1, 7), padding=(0, 3))
        self.branch_pool_avg = nn.AvgPool2d(3, stride=1, padding=1)
        self.branch_pool = BasicConv2d(in_ch, s(192), 1)
        self.out_channels = 4 * s(192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)
        b7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        bd = self.branch7x7dbl_1(x)
        bd = self.branch7x7dbl_5(self.branch7x7dbl_4(self.branch7x7dbl_3(self.branch7x7dbl_2(bd))))
        bp = self.branch_pool(self.branch_pool_avg(x))
        return torch.cat([b1, b7, bd, bp], 1)


class InceptionD(nn.Module):
    """Inception-v3's grid reduction 17 -> 8: 1x1-3x3/2 | 1x1-1x7-7x1-3x3/2 | maxpool/2."""

    def __init__(self, in_ch: int, s: _Scale) -> None:
        super().__init__()
        self.branch3x3_1 = BasicConv2d(in_ch, s(192), 1)
        self.branch3x3_2 = BasicConv2d(s(192), s(320), 3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(in_ch, s(192), 1)
        self.branch7x7x3_2 = BasicConv2d(s(192), s(192), (1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(s(192), s(192), (7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(s(192), s(192), 3, stride=2)
        self.branch_pool = nn.MaxPool2d(3, stride=2)
        self.out_channels = s(320) + s(192) + in_ch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3_2(self.branch3x3_1(x))
        b7 = self.branch7x7x3_4(self.branch7x7x3_3(self.branch7x7x3_2(self.branch7x7x3_1(x))))
        return torch.cat([b3, b7, self.branch_pool(x)], 1)


class InceptionE(nn.Module):
    """Inception-v3's 8x8 block, whose 3x3 branches fork again into 1x3 and 3x1 convolutions."""

    def __init__(self, in_ch: int, s: _Scale) -> None:
        super().__init__()
        self.branch1x1 = BasicConv2d(in_ch, s(320), 1)
        self.branch3x3_1 = BasicConv2d(in_ch, s(384), 1)
        self.branch3x3_2a = BasicConv2d(s(384), s(384), (1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(s(384), s(384), (3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(in_ch, s(448), 1)
        self.branch3x3dbl_2 = BasicConv2d(s(448), s(384), 3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(s(384), s(384), (1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(s(384), s(384), (3, 1), padding=(1, 0))
        self.branch_pool_avg = nn.AvgPool2d(3, stride=1, padding=1)
        self.branch_pool = BasicConv2d(in_ch, s(192), 1)
        self.out_channels = s(320) + 4 * s(384) + s(192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)
        b3 = self.branch3x3_1(x)
        b3 = torch.cat([self.branch3x3_2a(b3), self.branch3x3_2b(b3)], 1)
        bd = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        bd = torch.cat([self.branch3x3dbl_3a(bd), self.branch3x3dbl_3b(bd)], 1)
        bp = self.branch_pool(self.branch_pool_avg(x))
        return torch.cat([b1, b3, bd, bp], 1)


class InceptionV3(nn.Module):
    """Inception-v3 (Szegedy et al. 2016) as in torchvision, without the auxiliary classifier."""

    def __init__(self, num_classes: int, input_shape: tuple[int, int, int], width: float = 1.0) -> None:
        super().__init__()
        _check_side("inception_v3", input_shape, INCEPTION_V3_MIN_SIDE)
        s = _Scale(width)
        self.Conv2d_1a_3x3 = BasicConv2d(input_shape[0], s(32), 3, stride=2)
        setattr(self.Conv2d_1a_3x3.conv, LINEAR_INPUT_ATTR, True)
        self.Conv2d_2a_3x3 = BasicConv2d(s(32), s(32), 3)
        self.Conv2d_2b_3x3 = BasicConv2d(s(32), s(64), 3, padding=1)
        self.maxpool1 = nn.MaxPool2d(3, stride=2)
        self.Conv2d_3b_1x1 = BasicConv2d(s(64), s(80), 1)
        self.Conv2d_4a_3x3 = BasicConv2d(s(80), s(192), 3)
        self.maxpool2 = nn.MaxPool2d(3, stride=2)
        self.Mixed_5b = InceptionA(s(192), 32, s)
        self.Mixed_5c = InceptionA(self.Mixed_5b.out_channels, 64, s)
        self.Mixed_5d = InceptionA(self.Mixed_5c.out_channels, 64, s)
        self.Mixed_6a = InceptionB(self.Mixed_5d.out_channels, s)
        self.Mixed_6b = InceptionC(self.Mixed_6a.out_channels, 128, s)
        self.Mixed_6c = InceptionC(self.Mixed_6b.out_channels, 160, s)
        self.Mixed_6d = InceptionC(self.Mixed_6c.out_channels, 160, s)
        self.Mixed_6e = InceptionC(self.Mixed_6d.out_channels, 192, s)
        self.Mixed_7a = InceptionD(self.Mixed_6e.out_channels, s)
        self.Mixed_7b = InceptionE(self.Mixed_7a.out_channels, s)
        self.Mixed_7c = InceptionE(self.Mixed_7b.out_channels, s)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.dropout = nn.Dropout(p=0.5)
        self.fc = nn.Linear(self.Mixed_7c.out_channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))
        x = self.maxpool2(self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(self.maxpool1(x))))
        x = self.Mixed_6a(self.Mixed_5d(self.Mixed_5c(self.Mixed_5b(x))))
        x = self.Mixed_6e(self.Mixed_6d(self.Mixed_6c(self.Mixed_6b(x))))
        x = self.Mixed_7c(self.Mixed_7b(self.Mixed_7a(x)))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(self.dropout(x))


class BertLayer(nn.Module):
    """One BERT encoder layer: separate query, key and value projections (as BERT's own code has them:
    three independent matrix products Opara can run at once), scaled dot-product attention, output
    projection, residual and LayerNorm, then the GELU feed-forward with residual and LayerNorm."""

    def __init__(self, hidden: int, heads: int, intermediate: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.intermediate = nn.Linear(hidden, intermediate)
        self.act = nn.GELU()
        self.output = nn.Linear(intermediate, hidden)
        self.out_norm = nn.LayerNorm(hidden, eps=1e-12)

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        # No reads of .shape: a traced graph then holds tensor operators only, no shape arithmetic.
        return t.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        ctx = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2).flatten(2)
        x = self.attn_norm(x + self.attn_out(ctx))
        return self.out_norm(x + self.output(self.act(self.intermediate(x))))


#: BERT-base: 12 layers, 12 heads, feed-forward 4x the hidden size.
BERT_LAYERS = 12
BERT_HEADS = 12


class Bert(nn.Module):
    """A BERT-base-like encoder classifier (Devlin et al. 2019) over token embeddings.

    Input (N, 1, S, H): S token embeddings of size H per request (positions and segments already
    added, as a tokenizer-side embedding lookup gives them; the zoo's tensors are float), so the
    request travels like every other zoo input. Embedding LayerNorm, 12 encoder layers with H / 12
    per head (H must be a multiple of 12), the pooler (tanh of a linear map of the first token) and
    a linear classifier. At H = 768 it is BERT-base's encoder (85,054,464 parameters in the layers).
    `width` scales the feed-forward size (4H at width 1). The paper runs BERT at S = 32.
    """

    def __init__(self, num_classes: int, input_shape: tuple[int, int, int], width: float = 1.0) -> None:
        super().__init__()
        channels, _, hidden = input_shape
        if channels != 1 or hidden % BERT_HEADS:
            raise ValueError(f"bert takes input_shape (1, tokens, hidden) with hidden a multiple of {BERT_HEADS}, "
                             f"got {input_shape}")
        self.emb_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.layers = nn.Sequential(*(BertLayer(hidden, BERT_HEADS, scale_channels(4 * hidden, width))
                                      for _ in range(BERT_LAYERS)))
        self.pooler = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers(self.emb_norm(x[:, 0]))
        return self.classifier(torch.tanh(self.pooler(h[:, 0])))
