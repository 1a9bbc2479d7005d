"""Torch model files with named tensors (``torchscript``, ``torch_export``, ``compile``): answers equal to
the file run directly (``torch.jit.load`` / ``torch.export.load(...).module()``) within each engine's
stated tolerance at batch 1, the middle and the max; inputs bound by forward's names, Triton's
``INPUT__<i>`` or the signature's order; tuple, dict and tensor outputs; BF16 as uint16 bits; a dynamic
batch dimension (torch.export.Dim); a data-dependent output at max_batch_size 0; every error path one
clear EngineError. Models are built in tmp_path (tests/gpuprims/engines/filemodels.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gpuprims.engines import EngineCache, EngineError, Target
from gpuprims.engines.file_torch import CompileFileEngine, TorchExportFileEngine, bind_inputs
from gpuprims.engines.files import make_file_engine
from gpuprims.tensors import DataType, ModelSignature, SignatureError, TensorSpec
from tests.gpuprims.engines import filemodels as fm

#: torch 2.13 deprecates TorchScript; the tests still build TorchScript files, as users' repositories hold them.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")
BATCHES = (1, fm.MAX_BATCH // 2, fm.MAX_BATCH)
CPU = Target("cpu", threads=1)


@pytest.fixture(autouse=True)
def _torch_threads_unchanged() -> Iterator[None]:
    """The engines set torch's (process-wide) thread count from the target: put it back."""
    was = torch.get_num_threads()
    yield
    torch.set_num_threads(was)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> EngineCache:
    return EngineCache(tmp_path_factory.mktemp("engine-cache"))


def _close(got: np.ndarray, want: torch.Tensor, tol: tuple[float, float]) -> None:
    ref = want.detach().numpy()
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if np.issubdtype(ref.dtype, np.floating):
        np.testing.assert_allclose(got, ref, rtol=tol[0], atol=tol[1])
    else:
        np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("how", ["script", "trace"])
@pytest.mark.parametrize("returns", ["tuple", "dict"])
def test_torchscript_equals_torch_jit_load(how: str, returns: str, tmp_path: Path, cache: EngineCache) -> None:
    path, sig = fm.torchscript(tmp_path / "model.pt", how, returns)
    eng = make_file_engine("torchscript", path, sig, CPU)
    eng.prepare(cache)
    # tuple: Triton's INPUT__0/OUTPUT__0 names bind by index; dict: forward's own names bind by name
    assert eng.describe()["binding"] == ("by index" if returns == "tuple" else "by name")
    direct = torch.jit.load(str(path))
    ins = [s.name for s in sig.inputs]
    for n in BATCHES:
        x, y = fm.torch_inputs(n, seed=n)
        got = eng.run({ins[0]: x, ins[1]: y})
        with torch.inference_mode():
            ref = direct(torch.from_numpy(x), torch.from_numpy(y))
        refs = list(ref) if returns == "tuple" else [ref["sum"], ref["next"]]
        for spec, r in zip(sig.outputs, refs):
            _close(got[spec.name], r, eng.tolerance)
    assert eng.describe()["threads"] == 1 and torch.get_num_threads() == 1


def test_inputs_bound_in_the_signatures_order_when_nothing_names_them(tmp_path: Path, cache: EngineCache) -> None:
    path, _ = fm.torchscript(tmp_path / "model.pt", "script", "tuple")
    plain = ModelSignature((TensorSpec("a", DataType.FP32, (4,)), TensorSpec("b", DataType.INT64, (4,))),
                           (TensorSpec("p", DataType.FP32, (4,)), TensorSpec("q", DataType.INT64, (4,))), fm.MAX_BATCH)
    eng = make_file_engine("torchscript", path, plain, CPU)
    eng.prepare(cache)
    assert eng.describe()["binding"] == "in order"
    assert make_file_engine("eager", path, plain, CPU).kind == "torchscript"  # apps.yaml's default engine
    x, y = fm.torch_inputs(3)
    got = eng.run({"b": y, "a": x}, outputs=["q"])
    assert list(got) == ["q"]
    np.testing.assert_array_equal(got["q"], y + 1)
    # the binding rules on their own
    assert bind_inputs(["image", "scale"], ModelSignature(
        (TensorSpec("scale", DataType.FP32, (1,)), TensorSpec("image", DataType.FP32, (1,))),
        (TensorSpec("o", DataType.FP32, (1,)),))) == (["image", "scale"], "by name")
    assert bind_inputs([], ModelSignature(
        (TensorSpec("INPUT__1", DataType.FP32, (1,)), TensorSpec("INPUT__0", DataType.FP32, (1,))),
        (TensorSpec("o", DataType.FP32, (1,)),))) == (["INPUT__0", "INPUT__1"], "by index")


@pytest.mark.slow
def test_torch_export_equals_the_program_run_directly(tmp_path: Path, cache: EngineCache) -> None:
    path, sig = fm.exported(tmp_path / "model.pt2")
    # the signature lists the inputs in another order than forward: they bind by forward's names
    swapped = ModelSignature(tuple(reversed(sig.inputs)), sig.outputs, sig.max_batch_size)
    eng = make_file_engine("torch_export", path, swapped, CPU)
    eng.prepare(cache)
    assert eng.describe()["binding"] == "by name" and eng.describe()["call_order"] == ["image", "scale"]
    direct = torch.export.load(str(path)).module()
    rng = np.random.default_rng(0)
    for n in (*BATCHES, 3, 7):  # the batch dimension is dynamic (torch.export.Dim)
        image = rng.standard_normal((n, 3)).astype(np.float32)
        scale = rng.standard_normal((n, 3)).astype(np.float32)
        got = eng.run({"image": image, "scale": scale})
        ref = direct(torch.from_numpy(image), torch.from_numpy(scale))
        _close(got["scaled"], ref[0], eng.tolerance)
        _close(got["plus one"], ref[1], eng.tolerance)
        assert got["plus one"].dtype == np.float16


@pytest.mark.slow
def test_compile_over_an_exported_program_and_its_cache(tmp_path: Path) -> None:
    path, sig = fm.exported(tmp_path / "model.pt2")
    cache = EngineCache(tmp_path / "cache")
    eng = make_file_engine("compile", path, sig, CPU, {"backend": "aot_eager"})
    info = eng.prepare(cache)
    assert not info.cache_hit and set(info.extra["compile_ms"]) == {1, 2, fm.MAX_BATCH}
    assert info.artefact == str(cache.root / "inductor")
    direct = torch.export.load(str(path)).module()
    rng = np.random.default_rng(1)
    for n in (*BATCHES, 5):
        image = rng.standard_normal((n, 3)).astype(np.float32)
        scale = rng.standard_normal((n, 3)).astype(np.float32)
        got = eng.run({"image": image, "scale": scale})
        ref = direct(torch.from_numpy(image), torch.from_numpy(scale))
        _close(got["scaled"], ref[0], CompileFileEngine.tolerance)
        _close(got["plus one"], ref[1], CompileFileEngine.tolerance)
    again = make_file_engine("compile", path, sig, CPU, {"backend": "aot_eager"})
    assert again.prepare(cache).cache_hit


@pytest.mark.slow
def test_compile_with_inductor(tmp_path: Path) -> None:
    """Inductor's C++ kernels on the CPU (a first compile takes tens of seconds on a busy 2-core machine)."""
    path, sig = fm.exported(tmp_path / "model.pt2")
    eng = make_file_engine("compile", path, sig, CPU)
    eng.prepare(EngineCache(tmp_path / "cache"))
    direct = torch.export.load(str(path)).module()
    image, scale = np.ones((fm.MAX_BATCH, 3), np.float32), np.full((fm.MAX_BATCH, 3), 2, np.float32)
    ref = direct(torch.from_numpy(image), torch.from_numpy(scale))
    _close(eng.run({"image": image, "scale": scale})["scaled"], ref[0], CompileFileEngine.tolerance)


def test_bf16_travels_as_uint16_bits(tmp_path: Path, cache: EngineCache) -> None:
    path, sig = fm.bf16_torchscript(tmp_path / "bf16.pt")
    eng = make_file_engine("torchscript", path, sig, CPU)
    eng.prepare(cache)
    values = np.array([[1.0, -2.5, 0.15625, 3.0e10]], np.float32)
    for n in BATCHES:
        bits = fm.to_bf16_bits(np.repeat(values, n, axis=0))
        got = eng.run({"x": bits})["y"]
        assert got.dtype == np.uint16 and got.shape == (n, 4)
        ref = torch.jit.load(str(path))(torch.from_numpy(bits).view(torch.bfloat16))
        np.testing.assert_array_equal(got, ref.view(torch.int16).numpy().view(np.uint16))
        np.testing.assert_array_equal(fm.from_bf16_bits(got), fm.from_bf16_bits(bits) * 2)


def test_unbatched_model_with_a_data_dependent_output(tmp_path: Path, cache: EngineCache) -> None:
    class Where(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nonzero(x).flatten()

    path = tmp_path / "where.pt"
    torch.jit.save(torch.jit.script(Where()), str(path))
    sig = ModelSignature((TensorSpec("x", DataType.FP32, (-1,)),), (TensorSpec("where", DataType.INT64, (-1,)),), 0)
    eng = make_file_engine("torchscript", path, sig, CPU)
    eng.prepare(cache)
    for x in ([0, 1.5, 0, 3], [0.0], [1, 1, 1, 0, 0, 2, 0]):
        got = eng.run({"x": np.array(x, np.float32)})["where"]
        np.testing.assert_array_equal(got, np.flatnonzero(np.array(x)))


@pytest.mark.slow
def test_read_only_request_arrays_are_taken(tmp_path: Path, cache: EngineCache) -> None:
    path, sig = fm.exported(tmp_path / "model.pt2")
    eng = make_file_engine("torch_export", path, sig, CPU)
    eng.prepare(cache)
    body = np.ones((2, 3), np.float32)
    body.setflags(write=False)  # a zero-copy view of a wire body is read-only
    got = eng.run({"image": body, "scale": body})
    np.testing.assert_allclose(got["scaled"], np.ones((2, 3)) + np.array([0.5, -1.0, 2.0]))


# -- error paths ---------------------------------------------------------------------------------------
def test_file_errors_are_one_clear_engine_error(tmp_path: Path, cache: EngineCache) -> None:
    pt, sig = fm.torchscript(tmp_path / "model.pt", "script", "dict")
    pt2, esig = fm.exported(tmp_path / "model.pt2")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(EngineError, match=r"'torchscript': junk.pt is not a TorchScript archive torch can load: "):
        make_file_engine("torchscript", junk, sig, CPU).prepare(cache)
    state = tmp_path / "state.pt"
    torch.save({"w": torch.zeros(2)}, str(state))  # a state dict, not a TorchScript archive
    with pytest.raises(EngineError, match=r"state.pt is not a TorchScript archive"):
        make_file_engine("torchscript", state, sig, CPU).prepare(cache)
    bad2 = tmp_path / "bad.pt2"
    bad2.write_bytes(b"nope")
    with pytest.raises(EngineError, match=r"'torch_export': bad.pt2 is not a torch.export program torch can load"):
        make_file_engine("torch_export", bad2, esig, CPU).prepare(cache)
    with pytest.raises(EngineError, match=r"engine 'torch_export' runs .pt2 files; model.pt is a TorchScript archive "
                                          r"\(use engine 'torchscript'\)"):
        make_file_engine("torch_export", pt, sig, CPU)
    with pytest.raises(EngineError, match=r"engine 'compile' runs torch.export programs \(.pt2\); model.pt is a "
                                          r"TorchScript archive, which torch.compile refuses to compile"):
        make_file_engine("compile", pt, sig, CPU)
    with pytest.raises(EngineError, match=r"engine 'torchscript' runs .pt or .pth files; model.pt2 is a torch.export"):
        make_file_engine("torchscript", pt2, esig, CPU)
    with pytest.raises(EngineError, match=r"'torchscript': model file '.*gone.pt' does not exist"):
        make_file_engine("torchscript", tmp_path / "gone.pt", sig, CPU)


def test_an_exported_program_that_disagrees_with_the_signature(tmp_path: Path, cache: EngineCache) -> None:
    path, sig = fm.exported(tmp_path / "model.pt2")
    cases = [
        (ModelSignature((TensorSpec("image", DataType.FP64, (3,)), sig.inputs[1]), sig.outputs, fm.MAX_BATCH),
         r"input 'image' is FP32 in the file, the signature says FP64"),
        (ModelSignature(sig.inputs, (sig.outputs[0], TensorSpec("plus one", DataType.FP32, (3,))), fm.MAX_BATCH),
         r"output 'plus one' is FP16 in the file, the signature says FP32"),
        (ModelSignature(sig.inputs, sig.outputs[:1], fm.MAX_BATCH),
         r"model.pt2 gives 2 output tensor\(s\); the signature has 1: \['scaled'\]"),
        (ModelSignature((TensorSpec("image", DataType.FP32, (4,)), sig.inputs[1]), sig.outputs, fm.MAX_BATCH),
         r"input 'image' has shape \[\?,3\] in the file, the signature gives \[-1,4\]"),
        (ModelSignature((*sig.inputs, TensorSpec("extra", DataType.FP32, (3,))), sig.outputs, fm.MAX_BATCH),
         r"forward takes 2 input\(s\) \['image', 'scale'\]; the signature has 3"),
    ]
    for bad, match in cases:
        with pytest.raises(EngineError, match=match) as info:
            make_file_engine("torch_export", path, bad, CPU).prepare(cache)
        assert "\n" not in str(info.value)
    assert TorchExportFileEngine.tolerance == (1e-6, 1e-7)


def test_torchscript_outputs_that_disagree_are_named_at_run(tmp_path: Path, cache: EngineCache) -> None:
    path, sig = fm.torchscript(tmp_path / "model.pt", "script", "dict")
    x, y = fm.torch_inputs(2)
    cases = [
        (ModelSignature(sig.inputs, (TensorSpec("total", DataType.FP32, (4,)),), fm.MAX_BATCH),
         r"returns a dict with keys \['next', 'sum'\], without the signature's output\(s\) \['total'\]"),
        (ModelSignature(sig.inputs, (sig.outputs[0], TensorSpec("next", DataType.INT32, (4,))), fm.MAX_BATCH),
         r"output 'next' of model.pt is int64, the signature says INT32"),
    ]
    for bad, match in cases:
        eng = make_file_engine("torchscript", path, bad, CPU)
        eng.prepare(cache)
        with pytest.raises(EngineError, match=match):
            eng.run({"x": x, "y": y})
    tup, tsig = fm.torchscript(tmp_path / "tuple.pt", "script", "tuple")
    three = ModelSignature(tsig.inputs, (*tsig.outputs, TensorSpec("OUTPUT__2", DataType.FP32, (4,))), fm.MAX_BATCH)
    eng = make_file_engine("torchscript", tup, three, CPU)
    eng.prepare(cache)
    with pytest.raises(EngineError, match=r"returns 2 tensors; the signature names outputs up to 'OUTPUT__2'"):
        eng.run({"INPUT__0": x, "INPUT__1": y})
    # a request that does not fit is the request's fault
    with pytest.raises(SignatureError, match=r"input 'INPUT__1' has numpy dtype float32, the model wants INT64"):
        eng.run({"INPUT__0": x, "INPUT__1": x})


def test_a_model_that_raises_is_an_engine_error(tmp_path: Path, cache: EngineCache) -> None:
    class Picky(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 100:
                raise ValueError("too large")
            return x

    path = tmp_path / "picky.pt"
    torch.jit.save(torch.jit.script(Picky()), str(path))
    sig = ModelSignature((TensorSpec("x", DataType.FP32, (2,)),), (TensorSpec("y", DataType.FP32, (2,)),), 4)
    eng: Any = make_file_engine("torchscript", path, sig, CPU)
    eng.prepare(cache)
    assert eng.run({"x": np.ones((1, 2), np.float32)})["y"].shape == (1, 2)
    with pytest.raises(EngineError, match=r"engine 'torchscript' failed to run picky.pt: .*too large"):
        eng.run({"x": np.full((1, 2), 100, np.float32)})
