"""Multi-branch and recurrent networks of the CPU co-execution papers, in plain torch.

DUET's three models (Zhang et al., IPDPS'21, Table I) and Chrion's stacked LSTM (Ma et al. 2023),
shrunk so that a 2-core CPU runs them in milliseconds. Every model takes ONE float32 tensor per
request, shaped (N, C, H, W) like the image models, so it travels through the wire format, the
packet pool and the batcher unchanged; how a model reads its tensor is part of its contract:

- ``WideDeep`` (input (1, 1, D)): one packed feature row ``[wide 363 | deep 13 | sequence T x 80 |
  image 3 x S x S]``, T = ``WIDE_DEEP_SEQ_LEN``. Four independent encoders (a linear "wide" part, a
  feed-forward "deep" part, a 2-layer LSTM, a ResNet-18) and a merge layer: DUET Fig. 2.
- ``Siamese`` (input (2, T, F)): two sequences, each encoded by its own 2-layer LSTM (the two
  independent branches of DUET's Table II), merged by cosine similarity and a linear layer.
- ``MTDNN`` (input (1, T, E)): a shared Transformer encoder over T token embeddings, then ten
  independent task heads (LSTM + linear emission scores, the LSTM_CRF heads of DUET Table II without
  CRF decoding), whose per-task scores averaged over the tokens are concatenated (116 outputs).
- ``StackedLSTM`` (input (1, T, F)): Chrion's model, written cell by cell (``nn.LSTMCell`` per layer,
  a Python loop over time) so that each (layer, step) cell is an operator a partitioner can place;
  the head reads the last layer's final hidden state.

``width`` scales hidden sizes (and the ResNet's channels); weights come from ``apps.zoo.init``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from apps.zoo.names import (
    MT_DNN_TAGS,
    WIDE_DEEP_DEEP,
    WIDE_DEEP_SEQ_FEATURES,
    WIDE_DEEP_SEQ_LEN,
    WIDE_DEEP_WIDE,
)
from apps.zoo.nets import BasicBlock, ResNet, scale_channels

#: Chrion's baseline depth (12 stacked layers).
LSTM_LAYERS = 12


def wide_deep_image_side(features: int) -> int:
    """The image side S that a packed Wide&Deep row of ``features`` floats carries; ValueError if none."""
    rest = features - WIDE_DEEP_WIDE - WIDE_DEEP_DEEP - WIDE_DEEP_SEQ_LEN * WIDE_DEEP_SEQ_FEATURES
    side = math.isqrt(max(rest, 0) // 3)
    if rest <= 0 or rest % 3 or side * side * 3 != rest:
        fixed = WIDE_DEEP_WIDE + WIDE_DEEP_DEEP + WIDE_DEEP_SEQ_LEN * WIDE_DEEP_SEQ_FEATURES
        raise ValueError(f"wide_deep takes input (1, 1, {fixed} + 3*S*S) for an S x S image "
                         f"(e.g. (1, 1, {fixed + 3 * 64 * 64}) for 64x64), got {features} features")
    return side


def _need_shape(name: str, input_shape: tuple[int, int, int], *, channels: int | None = None,
                height: int | None = None) -> None:
    c, h, _ = input_shape
    if (channels is not None and c != channels) or (height is not None and h != height):
        want = f"({channels if channels is not None else 'C'}, {height if height is not None else 'T'}, F)"
        raise ValueError(f"{name} takes input_shape {want}, got {tuple(input_shape)}")


class WideDeep(nn.Module):
    """Wide&Deep with four encoders (module docstring); output (N, num_classes)."""

    def __init__(self, num_classes: int, input_shape: tuple[int, int, int], width: float = 1.0) -> None:
        super().__init__()
        _need_shape("wide_deep", input_shape, channels=1, height=1)
        self.side = wide_deep_image_side(input_shape[2])
        emb = scale_channels(64, width)
        self.seq_start = WIDE_DEEP_WIDE + WIDE_DEEP_DEEP
        self.img_start = self.seq_start + WIDE_DEEP_SEQ_LEN * WIDE_DEEP_SEQ_FEATURES
        self.wide = nn.Linear(WIDE_DEEP_WIDE, emb)
        self.deep = nn.Sequential(
            nn.Linear(WIDE_DEEP_DEEP, scale_channels(192, width)), nn.ReLU(),
            nn.Linear(scale_channels(192, width), scale_channels(128, width)), nn.ReLU(),
            nn.Linear(scale_channels(128, width), emb),
        )
        self.rnn = nn.LSTM(WIDE_DEEP_SEQ_FEATURES, emb, num_layers=2, batch_first=True)
        self.cnn = ResNet(BasicBlock, (2, 2, 2, 2), emb, (3, self.side, self.side), width)
        self.merge = nn.Linear(4 * emb, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        row = x.flatten(1)
        w = self.wide(row[:, :WIDE_DEEP_WIDE])
        d = self.deep(row[:, WIDE_DEEP_WIDE:self.seq_start])
        seq = row[:, self.seq_start:self.img_start].reshape(-1, WIDE_DEEP_SEQ_LEN, WIDE_DEEP_SEQ_FEATURES)
        r = self.rnn(seq)[0][:, -1]
        c = self.cnn(row[:, self.img_start:].reshape(-1, 3, self.side, self.side))
        return self.merge(torch.cat([w, d, r, c], dim=1))


class Siamese(nn.Module):
    """Two independent 2-layer LSTMs over the two sequences of a request, cosine-merged."""

    def __init__(self, num_classes: int, input_shape: tuple[int, int, int], width: float = 1.0) -> None:
        super().__init__()
        _need_shape("siamese", input_shape, channels=2)
        hidden = scale_channels(128, width)
        self.left = nn.LSTM(input_shape[2], hidden, num_layers=2, batch_first=True)
        self.right = nn.LSTM(input_shape[2], hidden, num_layers=2, batch_first=True)
        self.merge = nn.Linear(3, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.left(x[:, 0])[0][:, -1]
        b = self.right(x[:, 1])[0][:, -1]
        cos = torch.cosine_similarity(a, b, dim=1)
        dist = (a - b).norm(dim=1)
        return self.merge(torch.stack([cos, dist, (a * b).mean(dim=1)], dim=1))


class EncoderBlock(nn.Module):
    """A post-norm Transformer encoder layer (multi-head self-attention, then a 4x feed-forward)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"embedding size {dim} is not divisible by {heads} heads")
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.norm2 = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(x).reshape(n, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(self.head_dim), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(n, t, d)
        x = self.norm1(x + self.proj(y))
        return self.norm2(x + self.ff(x))


class TaggingHead(nn.Module):
    """One MT-DNN task: an LSTM over the shared encoding and per-token emission scores, averaged."""

    def __init__(self, dim: int, hidden: int, tags: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(dim, hidden, batch_first=True)
        self.emit = nn.Linear(hidden, tags)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.emit(self.lstm(h)[0]).mean(dim=1)


class MTDNN(nn.Module):
    """A shared 2-block encoder and ten independent tagging heads (module docstring)."""

    def __init__(self, num_classes: int, input_shape: tuple[int, int, int], width: float = 1.0) -> None:
        super().__init__()
        _need_shape("mt_dnn", input_shape, channels=1)
        if num_classes != sum(MT_DNN_TAGS):
            raise ValueError(f"mt_dnn outputs the {sum(MT_DNN_TAGS)} scores of its ten tasks; "
                             f"num_classes must be {sum(MT_DNN_TAGS)}, got {num_classes}")
        dim = input_shape[2]
        heads = 4 if dim % 4 == 0 else 1
        self.encoder = nn.Sequential(EncoderBlock(dim, heads), EncoderBlock(dim, heads))
        hidden = scale_channels(64, width)
        self.heads = nn.ModuleList(TaggingHead(dim, hidden, tags) for tags in MT_DNN_TAGS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x[:, 0])
        return torch.cat([head(h) for head in self.heads], dim=1)


class StackedLSTM(nn.Module):
    """Chrion's stacked LSTM, unrolled cell by cell (module docstring)."""

    def __init__(self, num_classes: int, input_shape: tuple[int, int, int], width: float = 1.0,
                 layers: int = LSTM_LAYERS) -> None:
        super().__init__()
        _need_shape("lstm", input_shape, channels=1)
        features = input_shape[2]
        self.seq_len = input_shape[1]
        self.hidden = scale_channels(features, width)
        self.cells = nn.ModuleList(
            nn.LSTMCell(features if i == 0 else self.hidden, self.hidden) for i in range(layers))
        self.head = nn.Linear(self.hidden, num_classes)

    def initial_state(self, batch: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero hidden and cell state for ``batch`` rows, on ``like``'s device and dtype."""
        z = like.new_zeros(batch, self.hidden)
        return z, z

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x[:, 0]
        state = [self.initial_state(seq.shape[0], seq) for _ in self.cells]
        for t in range(self.seq_len):
            inp = seq[:, t]
            for layer, cell in enumerate(self.cells):
                state[layer] = cell(inp, state[layer])
                inp = state[layer][0]
        return self.head(state[-1][0])
