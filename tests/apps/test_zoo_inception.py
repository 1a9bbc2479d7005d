from __future__ import annotations

import hashlib
import multiprocessing as mp
import threading

import pytest
import torch
from torch import nn

from apps.zoo import MODELS, build_model, canonical_name, load_model, model_info

#: Small variants every test can afford on two cores: (input shape, width).
SMALL = {
    "googlenet": ((3, 32, 32), 0.125),
    "inception_v3": ((3, 75, 75), 0.125),
    "bert": ((1, 8, 48), 1.0),
}

#: torchvision's parameter counts less the training-only auxiliary heads (see apps/zoo/inception.py).
KNOWN_PARAMS = {
    "googlenet": 6_624_904,
    "inception_v3": 23_834_568,
    # BERT-base's 12 encoder layers (85,054,464), embedding LayerNorm, pooler and a 2-way classifier.
    "bert": 85_054_464 + 2 * 768 + (768 * 768 + 768) + (768 * 2 + 2),
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


@pytest.mark.parametrize("name", sorted(KNOWN_PARAMS))
def test_parameter_counts_match_torchvision_without_aux_heads(name: str) -> None:
    assert model_info(build_model(name, device="meta"))["params"] == KNOWN_PARAMS[name]


#: inception_v3 runs for seconds even small: out of the fast tier (make test runs it).
def _small_names() -> list[object]:
    return [pytest.param(n, marks=pytest.mark.slow) if n == "inception_v3" else n for n in sorted(SMALL)]


@pytest.mark.slow
@pytest.mark.parametrize("name", _small_names())
def test_small_variant_shape_and_input_dependent_output(name: str) -> None:
    model = load_model(name, input_shape=SMALL[name][0], width=SMALL[name][1], num_classes=7)
    assert isinstance(model, nn.Module)
    assert not model.training and all(not p.requires_grad for p in model.parameters())
    x = _input(SMALL[name][0])
    with torch.inference_mode():
        out, again = model(x), model(x)
    assert out.shape == (3, 7)
    assert torch.isfinite(out).all() and torch.equal(out, again)
    assert (out[0] - out[1]).abs().max().item() > 1e-4
    assert out.std().item() > 1e-3


def test_default_shapes_and_aliases() -> None:
    assert MODELS["googlenet"].input_shape == (3, 224, 224)
    assert MODELS["inception_v3"].input_shape == (3, 299, 299)
    assert canonical_name("Inception") == canonical_name("inceptionv3") == "inception_v3"
    assert MODELS["googlenet"].num_classes == MODELS["inception_v3"].num_classes == 1000
    assert MODELS["bert"].input_shape == (1, 32, 768) and MODELS["bert"].num_classes == 2


@pytest.mark.parametrize("shape", [(3, 32, 768), (1, 32, 100)])
def test_bert_refuses_shapes_it_cannot_read(shape: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError, match=r"bert takes input_shape \(1, tokens, hidden\)"):
        build_model("bert", input_shape=shape, device="meta")


@pytest.mark.parametrize("name", sorted(SMALL))
def test_same_seed_same_weights_other_seed_other_weights(name: str) -> None:
    assert _digest(_build(name)) == _digest(_build(name))
    assert _digest(_build(name)) != _digest(_build(name, seed=1))


def test_weights_are_identical_when_built_in_threads() -> None:
    digests: list[str] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            digests.append(_digest(_build("googlenet")))
        except BaseException as e:  # collected and re-raised in the test thread
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(digests) == 3
    assert set(digests) == {_digest(_build("googlenet"))}


def _child_digests(queue: mp.Queue) -> None:  # runs in a spawned child
    torch.set_num_threads(1)
    torch.manual_seed(4321)  # the global RNG must not matter
    queue.put({name: _digest(_build(name)) for name in sorted(SMALL)})


@pytest.mark.real
def test_weights_are_bit_identical_in_another_process() -> None:
    ctx = mp.get_context("spawn")
    queue: mp.Queue = ctx.Queue()
    child = ctx.Process(target=_child_digests, args=(queue,))
    child.start()
    try:
        got = queue.get(timeout=120)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
            child.join()
    assert got == {name: _digest(_build(name)) for name in sorted(SMALL)}


@pytest.mark.parametrize(("name", "side", "minimum"), [("googlenet", 15, 16), ("inception_v3", 74, 75)])
def test_inputs_below_the_minimum_are_refused_with_it(name: str, side: int, minimum: int) -> None:
    with pytest.raises(ValueError, match=f"{name} needs inputs of at least {minimum}x{minimum}"):
        build_model(name, input_shape=(3, side, side), device="meta")
    build_model(name, input_shape=(3, minimum, minimum), device="meta")


@pytest.mark.parametrize("name", ["googlenet", pytest.param("inception_v3", marks=pytest.mark.slow)])
def test_smallest_accepted_input_runs(name: str) -> None:
    side = {"googlenet": 16, "inception_v3": 75}[name]
    model = build_model(name, input_shape=(3, side, side), width=0.125)
    with torch.inference_mode():
        assert model(_input((3, side, side), batch=1)).shape == (1, 1000)
