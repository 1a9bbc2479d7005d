from __future__ import annotations

import hashlib
import multiprocessing as mp

import pytest
import torch
from torch import nn

from apps.zoo import MODELS, build_model
from apps.zoo.names import MT_DNN_TAGS, wide_deep_shape
from apps.zoo.seqnets import wide_deep_image_side

#: Small request shapes and widths every test can afford on two cores.
SMALL = {
    "wide_deep": (wide_deep_shape(16), 0.25),
    "siamese": ((2, 8, 16), 0.25),
    "mt_dnn": ((1, 8, 32), 0.25),
    "lstm": ((1, 6, 16), 1.0),
}


def _digest(model: nn.Module) -> str:
    sha = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        sha.update(name.encode())
        sha.update(tensor.detach().contiguous().numpy().tobytes())
    return sha.hexdigest()


def _input(shape: tuple[int, int, int], batch: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, *shape, generator=torch.Generator().manual_seed(seed))


def _build(name: str, seed: int = 0) -> nn.Module:
    shape, width = SMALL[name]
    return build_model(name, seed=seed, input_shape=shape, width=width)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_shape_and_input_dependent_output(name: str) -> None:
    model = _build(name)
    assert not model.training and all(not p.requires_grad for p in model.parameters())
    x = _input(SMALL[name][0])
    with torch.inference_mode():
        out, again = model(x), model(x)
    assert out.shape == (3, MODELS[name].num_classes)
    assert torch.isfinite(out).all() and torch.equal(out, again)
    assert (out[0] - out[1]).abs().max().item() > 1e-4


@pytest.mark.parametrize("name", sorted(SMALL))
def test_same_seed_same_weights_other_seed_other_weights(name: str) -> None:
    assert _digest(_build(name)) == _digest(_build(name))
    assert _digest(_build(name)) != _digest(_build(name, seed=1))


def _child_digest(name: str, queue: mp.Queue) -> None:
    torch.manual_seed(1234)  # the global RNG must not matter
    queue.put(_digest(_build(name)))


@pytest.mark.real
def test_weights_are_bit_identical_in_another_process() -> None:
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    p = ctx.Process(target=_child_digest, args=("siamese", q))
    p.start()
    try:
        got = q.get(timeout=120)
    finally:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    assert got == _digest(_build("siamese"))


def test_default_shapes_are_the_models_own() -> None:
    assert MODELS["siamese"].input_shape == (2, 64, 64)
    assert MODELS["lstm"].input_shape == (1, 96, 64)
    assert MODELS["resnet50"].input_shape == (3, 224, 224)
    assert wide_deep_image_side(MODELS["wide_deep"].input_shape[2]) == 64
    model = build_model("lstm", device="meta")  # the registered default shape: 12 layers of cells
    assert len(model.cells) == 12 and model.seq_len == 96
    assert MODELS["mt_dnn"].num_classes == sum(MT_DNN_TAGS) == 116


@pytest.mark.parametrize(("name", "shape", "match"), [
    ("wide_deep", (1, 1, 1000), "wide_deep takes input"),
    ("wide_deep", (3, 224, 224), "wide_deep takes input_shape"),
    ("siamese", (3, 8, 8), "siamese takes input_shape"),
    ("lstm", (2, 8, 8), "lstm takes input_shape"),
])
def test_wrong_input_shapes_are_refused_with_the_expected_one(name: str, shape: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_model(name, input_shape=shape)


def test_mt_dnn_refuses_another_class_count() -> None:
    with pytest.raises(ValueError, match="116"):
        build_model("mt_dnn", input_shape=(1, 8, 32), num_classes=5)


def test_unrolled_lstm_equals_torchs_fused_lstm_with_the_same_weights() -> None:
    # The cell-by-cell model is a real stacked LSTM: nn.LSTM with its cells' weights agrees.
    model = build_model("lstm", input_shape=(1, 5, 8), width=1.0)
    ref = nn.LSTM(8, model.hidden, num_layers=len(model.cells), batch_first=True)
    with torch.no_grad():
        for i, cell in enumerate(model.cells):
            for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                getattr(ref, f"{kind}_l{i}").copy_(getattr(cell, kind))
    x = _input((1, 5, 8), batch=2)
    with torch.inference_mode():
        want = model.head(ref(x[:, 0])[0][:, -1])
        torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-6)


def test_layer_norm_without_affine_is_refused() -> None:
    from apps.zoo.init import init_weights

    with pytest.raises(ValueError, match="elementwise_affine"):
        init_weights(nn.LayerNorm(4, elementwise_affine=False), "k")
