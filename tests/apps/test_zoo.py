from __future__ import annotations

import hashlib
import multiprocessing as mp
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from apps.zoo import (
    ALIASES,
    MODELS,
    RECOG_ROUTER_LABELS,
    RESNET_CAR_LABELS,
    VGG_FACE_IDENTITIES,
    build_model,
    canonical_name,
    load_model,
    model_info,
    route_labels,
)
from apps.zoo.init import generator_for, init_weights

SMALL = (3, 32, 32)
# Tiny variants that every test can afford to build and run on two cores.
TINY_WIDTH = {
    "alexnet": 0.125,
    "mobilenet_v2": 0.25,
    "resnet18": 0.25,
    "resnet50": 0.25,
    "vgg19": 0.125,
    "resnext50": 0.25,
    "recog_router": 0.25,
    "vgg_face": 0.125,
    "resnet_car": 0.25,
}

# Parameter counts of the original architectures (torchvision's figures), at 224x224 and width 1.
KNOWN_PARAMS = {
    "alexnet": 61_100_840,
    "mobilenet_v2": 3_504_872,
    "resnet18": 11_689_512,
    "resnet50": 25_557_032,
    "vgg19": 143_667_240,
    "resnext50": 25_028_904,
    # VGG-16 (138,357,544) with a 2,622-way head instead of 1,000.
    "vgg_face": 138_357_544 - (4096 * 1000 + 1000) + (4096 * 2622 + 2622),
    # ResNet-50 with an 11-way head instead of 1,000.
    "resnet_car": 25_557_032 - (2048 * 1000 + 1000) + (2048 * 11 + 11),
}


def _digest(model: nn.Module) -> str:
    sha = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        sha.update(name.encode())
        sha.update(tensor.detach().contiguous().numpy().tobytes())
    return sha.hexdigest()


def _input(batch: int, shape: tuple[int, int, int] = SMALL, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, *shape, generator=torch.Generator().manual_seed(seed))


#: The co-execution papers' models (tested in test_zoo_seqnets.py): they take their own input shapes.
SEQ_MODELS = {"wide_deep", "siamese", "mt_dnn", "lstm"}
#: The multi-branch models of Opara (tested in test_zoo_inception.py).
BRANCH_MODELS = {"googlenet", "inception_v3", "bert"}


def test_models_lists_every_required_name() -> None:
    assert set(MODELS) == set(TINY_WIDTH) | SEQ_MODELS | BRANCH_MODELS
    for name, spec in MODELS.items():
        assert spec.name == name
        assert spec.num_classes >= 1
        assert spec.description
    assert MODELS["recog_router"].labels == RECOG_ROUTER_LABELS == ("person", "vehicle", "other")
    assert MODELS["resnet_car"].num_classes == len(RESNET_CAR_LABELS)
    assert MODELS["vgg_face"].num_classes == VGG_FACE_IDENTITIES


@pytest.mark.parametrize("name", sorted(KNOWN_PARAMS))
def test_parameter_counts_match_the_originals(name: str) -> None:
    model = build_model(name, device="meta")
    assert model_info(model)["params"] == KNOWN_PARAMS[name]
    assert next(model.parameters()).device.type == "meta"


#: The zoo's biggest at a tiny width still take seconds each: out of the fast tier (make test runs them).
SLOW_SMALL_RUNS = {"resnet50", "resnext50"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_SMALL_RUNS else n
                                  for n in sorted(TINY_WIDTH)])
def test_every_model_runs_small_inputs_with_input_dependent_output(name: str) -> None:
    model = build_model(name, input_shape=SMALL, width=TINY_WIDTH[name], num_classes=7)
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    x = _input(4)
    with torch.inference_mode():
        out = model(x)
        again = model(x)
    assert out.shape == (4, 7)
    assert torch.isfinite(out).all()
    assert torch.equal(out, again)  # eval mode: dropout off, BatchNorm uses running statistics
    # Not degenerate: different inputs give different outputs.
    assert (out[0] - out[1]).abs().max().item() > 1e-4
    assert out.std().item() > 1e-3


def test_non_square_and_other_sizes_run() -> None:
    for name, shape in (("alexnet", (3, 64, 48)), ("vgg19", (1, 40, 24)), ("mobilenet_v2", (3, 17, 9))):
        model = build_model(name, input_shape=shape, width=0.125 if name != "mobilenet_v2" else 0.25)
        with torch.inference_mode():
            out = model(_input(2, shape))
        assert out.shape == (2, MODELS[name].num_classes)


def test_same_name_and_seed_give_identical_weights_and_outputs() -> None:
    a = build_model("resnet18", seed=3, input_shape=SMALL, width=0.25)
    b = build_model("resnet18", seed=3, input_shape=SMALL, width=0.25)
    assert _digest(a) == _digest(b)
    x = _input(2)
    with torch.inference_mode():
        assert torch.equal(a(x), b(x))


def test_different_seeds_and_names_give_different_weights() -> None:
    a = build_model("resnet50", seed=0, input_shape=SMALL, width=0.25, num_classes=11)
    b = build_model("resnet50", seed=1, input_shape=SMALL, width=0.25, num_classes=11)
    c = build_model("resnet_car", seed=0, input_shape=SMALL, width=0.25)
    assert a.state_dict().keys() == c.state_dict().keys()
    assert _digest(a) != _digest(b)
    assert _digest(a) != _digest(c)  # same architecture, different name: different weights
    for key, tensor in a.state_dict().items():
        if tensor.is_floating_point():
            assert not torch.equal(tensor, b.state_dict()[key]), key


def test_weights_do_not_depend_on_spatial_size_or_global_rng() -> None:
    state = torch.get_rng_state()
    small = build_model("mobilenet", seed=5, input_shape=(3, 32, 32), width=0.25)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is left untouched
    torch.manual_seed(1234)
    large = build_model("mobilenet_v2", seed=5, input_shape=(3, 96, 96), width=0.25)
    assert _digest(small) == _digest(large)


def _child_digest(queue: mp.Queue) -> None:  # runs in a spawned child
    torch.set_num_threads(1)
    torch.manual_seed(999)
    queue.put(_digest(build_model("resnext50", seed=7, input_shape=SMALL, width=0.25)))


@pytest.mark.real
def test_weights_are_bit_identical_in_another_process() -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_digest, args=(queue,))
    child.start()
    try:
        digest = queue.get(timeout=60)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == 0
    assert digest == _digest(build_model("resnext50", seed=7, input_shape=SMALL, width=0.25))


def test_names_are_case_insensitive_and_aliases_resolve() -> None:
    assert canonical_name("ResNet50") == "resnet50"
    assert canonical_name(" mobilenet ") == "mobilenet_v2"
    for alias, target in ALIASES.items():
        assert canonical_name(alias) == target


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown model 'resnet51'") as info:
        build_model("resnet51")
    for name in MODELS:
        assert name in str(info.value)
    with pytest.raises(ValueError, match="must be a string"):
        canonical_name(50)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seed": 1.5}, "seed"),
        ({"seed": True}, "seed"),
        ({"num_classes": 0}, "num_classes"),
        ({"num_classes": True}, "num_classes"),
        ({"input_shape": (3, 32)}, "input_shape"),
        ({"input_shape": (3, 0, 32)}, "input_shape"),
        ({"input_shape": (3, 32.0, 32)}, "input_shape"),
        ({"input_shape": "3x32x32"}, "input_shape"),
        ({"width": 0}, "width"),
        ({"width": -1.0}, "width"),
        ({"width": float("nan")}, "width"),
        ({"width": True}, "width"),
    ],
)
def test_bad_build_arguments_raise_value_error(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_model("resnet18", **kwargs)  # type: ignore[arg-type]


def test_alexnet_refuses_inputs_below_its_first_convolution() -> None:
    with pytest.raises(ValueError, match="at least 7x7"):
        build_model("alexnet", input_shape=(3, 6, 32), device="meta")


def test_model_info_counts_parameters_buffers_and_input_bytes() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))
    info = model_info(model, (3, 8, 8))
    assert info["params"] == (3 * 4 * 9 + 4) + (4 + 4) + (4 * 2 + 2)
    assert info["param_bytes"] == 4 * info["params"]
    assert info["buffers"] == 4 + 4 + 1  # running mean, running var, num_batches_tracked
    assert info["buffer_bytes"] == 4 * 8 + 8
    assert info["total_bytes"] == info["param_bytes"] + info["buffer_bytes"]
    assert info["input_shape"] == [3, 8, 8]
    assert info["input_bytes"] == 3 * 8 * 8 * 4
    assert "input_bytes" not in model_info(model)
    with pytest.raises(ValueError, match=r"torch\.nn\.Module"):
        model_info("resnet50")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="input_shape"):
        model_info(model, (3, 8))  # type: ignore[arg-type]


def test_model_info_of_a_full_size_model_on_meta() -> None:
    info = model_info(build_model("resnet50", device="meta"), (3, 224, 224))
    assert info["param_bytes"] == 4 * 25_557_032
    assert info["input_bytes"] == 588 * 1024  # the paper's 588 one-KiB packets per image


def test_route_labels() -> None:
    logits = torch.tensor([[0.1, 0.9, 0.0], [2.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert route_labels(logits) == ["vehicle", "person", "other"]
    model = build_model("recog_router", input_shape=SMALL, width=0.25)
    with torch.inference_mode():
        labels = route_labels(model(_input(3)))
    assert len(labels) == 3 and set(labels) <= set(RECOG_ROUTER_LABELS)
    with pytest.raises(ValueError, match=r"shape \(N, 3\)"):
        route_labels(torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"shape \(N, 3\)"):
        route_labels(torch.zeros(3))


def test_init_weights_refuses_unknown_layers_and_non_cpu_tensors() -> None:
    with pytest.raises(ValueError, match=r"does not know how to initialise parameter '1\.weight_ih_l0'"):
        init_weights(nn.Sequential(nn.Linear(2, 2), nn.GRU(2, 2)), "k")
    with torch.device("meta"):
        meta = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="on meta"):
        init_weights(meta, "k")
    with pytest.raises(ValueError, match="affine=True"):
        init_weights(nn.BatchNorm2d(2, affine=False), "k")
    with pytest.raises(ValueError, match="non-empty string"):
        generator_for("")


# --- user models given as "package.module:factory" ---------------------------------------------------

USER_MODULE = textwrap.dedent(
    """
    from torch import nn

    SEEN = {}

    def tiny(num_classes=3, input_shape=(3, 8, 8)):
        SEEN["kwargs"] = {"num_classes": num_classes, "input_shape": input_shape}
        return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0] * input_shape[1] * input_shape[2], num_classes),
                             nn.Dropout(0.5))

    def takes_all(**kwargs):
        SEEN["all"] = dict(kwargs)
        return nn.Linear(2, 2)

    class Factories:
        @staticmethod
        def nested(num_classes=2):
            return nn.Linear(4, num_classes)

    def not_a_module():
        return 42

    NOT_CALLABLE = 5
    """
)


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = "zoo_user_models_under_test"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


def test_load_model_by_zoo_name() -> None:
    model = load_model("mobilenet", input_shape=SMALL, width=0.25, seed=2)
    assert _digest(model) == _digest(build_model("mobilenet_v2", input_shape=SMALL, width=0.25, seed=2))


def test_load_user_model_passes_only_accepted_kwargs_and_is_deterministic(user_module: str) -> None:
    state = torch.get_rng_state()
    a = load_model(f"{user_module}:tiny", num_classes=5, input_shape=(3, 8, 8), width=0.5, seed=4)
    assert torch.equal(torch.get_rng_state(), state)
    seen = sys.modules[user_module].SEEN
    assert seen["kwargs"] == {"num_classes": 5, "input_shape": (3, 8, 8)}
    b = load_model(f"{user_module}:tiny", num_classes=5, input_shape=(3, 8, 8), seed=4)
    c = load_model(f"{user_module}:tiny", num_classes=5, input_shape=(3, 8, 8), seed=5)
    assert _digest(a) == _digest(b) != _digest(c)
    assert not a.training and all(not p.requires_grad for p in a.parameters())

    load_model(f"{user_module}:takes_all", seed=1, width=0.5, num_classes=None)
    assert seen["all"] == {"seed": 1, "width": 0.5}
    load_model(f"{user_module}:tiny", num_classes=None)
    assert seen["kwargs"]["num_classes"] == 3  # None leaves the factory's default
    nested = load_model(f"{user_module}:Factories.nested", num_classes=3, device="meta")
    assert next(nested.parameters()).device.type == "meta"  # moved, as the factory takes no device


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("", "zoo name or"),
        (":tiny", "package.module:factory"),
        ("{mod}:", "package.module:factory"),
        ("{mod}:tiny:extra", "package.module:factory"),
        ("no_such_module_for_zoo_tests:f", "cannot import module"),
        ("{mod}:missing", "has no attribute 'missing'"),
        ("{mod}:Factories.missing", "has no attribute 'Factories.missing'"),
        ("{mod}:NOT_CALLABLE", "is not callable"),
        ("{mod}:not_a_module", "returned int, not a torch.nn.Module"),
    ],
)
def test_load_model_bad_specs(user_module: str, spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_model(spec.format(mod=user_module))


def test_load_model_bad_seed_for_user_model(user_module: str) -> None:
    with pytest.raises(ValueError, match="seed"):
        load_model(f"{user_module}:tiny", seed="x")


@pytest.mark.gpu
def test_cuda_model_has_the_cpu_weights() -> None:
    cpu = build_model("resnet18", seed=1, input_shape=SMALL, width=0.25)
    gpu = build_model("resnet18", seed=1, input_shape=SMALL, width=0.25, device="cuda")
    assert next(gpu.parameters()).device.type == "cuda"
    for (name, a), (_, b) in zip(cpu.state_dict().items(), gpu.state_dict().items()):
        assert torch.equal(a, b.cpu()), name


@pytest.mark.parametrize("name", ["alexnet", "vgg19", "resnet18"])
def test_request_in_a_batch_matches_the_direct_run_within_documented_tolerance(name: str) -> None:
    model = build_model(name, input_shape=SMALL, width=TINY_WIDTH[name])
    x = _input(4)
    with torch.inference_mode():
        batched = model(x)
        alone = torch.cat([model(x[i : i + 1]) for i in range(4)])
    torch.testing.assert_close(batched, alone, rtol=1e-4, atol=1e-4)


def test_recog_router_routes_different_inputs_differently() -> None:
    model = build_model("recog_router", input_shape=SMALL, width=0.25)
    x = torch.cat([_input(16, seed=2), torch.rand(16, *SMALL, generator=torch.Generator().manual_seed(3))])
    with torch.inference_mode():
        labels = route_labels(model(x))
    assert len(set(labels)) >= 2


@pytest.mark.parametrize("name", ["resnet18", "vgg19", "mobilenet_v2"])
def test_inputs_spread_over_classes(name: str) -> None:
    model = build_model(name, input_shape=SMALL, width=TINY_WIDTH[name])
    with torch.inference_mode():
        classes = model(_input(16)).argmax(dim=1)
    assert len(set(classes.tolist())) >= 4  # random weights, but not one class for every input


def test_every_output_unit_ignores_the_mean_of_its_inputs() -> None:
    model = build_model("mobilenet_v2", input_shape=SMALL, width=0.25)
    for name, module in model.named_modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            rows = module.weight.view(module.weight.shape[0], -1)
            if rows.shape[1] > 1:
                assert rows.sum(dim=1).abs().max().item() < 1e-5, name


def test_weights_are_float32_whatever_the_default_dtype() -> None:
    reference = build_model("resnet18", seed=2, input_shape=SMALL, width=0.25)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = build_model("resnet18", seed=2, input_shape=SMALL, width=0.25)
    finally:
        torch.set_default_dtype(previous)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert _digest(model) == _digest(reference)
