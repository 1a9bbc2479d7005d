"""gpuprims.tensors: datatypes, tensor specs and a model's signature, as requests are checked against them."""

from __future__ import annotations

import numpy as np
import pytest

from gpuprims.tensors import DataType, ModelSignature, SignatureError, TensorSpec


def test_every_datatype_names_and_codes_round_trip() -> None:
    codes = set()
    for d in DataType:
        assert DataType.from_config(d.config_name) is d
        assert DataType.from_oip(d.value) is d
        assert DataType.from_code(d.code) is d
        codes.add(d.code)
        if d not in (DataType.BF16, DataType.BYTES):
            assert DataType.from_numpy(d.numpy) is d
    assert len(codes) == len(DataType)
    assert DataType.BYTES.config_name == "TYPE_STRING"
    assert DataType.BF16.numpy == np.dtype("<u2") and DataType.BF16.itemsize == 2
    assert DataType.from_numpy(np.dtype(">f4").newbyteorder("<")) is DataType.FP32


@pytest.mark.parametrize("bad", ["TYPE_FP8", "FP32", "", "TYPE_"])
def test_unknown_config_datatype_is_named(bad: str) -> None:
    with pytest.raises(ValueError, match="unknown data_type"):
        DataType.from_config(bad)


def test_unknown_codes_and_numpy_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match="code 0"):
        DataType.from_code(0)
    with pytest.raises(ValueError, match="complex64"):
        DataType.from_numpy(np.complex64)


@pytest.mark.parametrize("dims", [(0,), (-2,), (3, True), (1.5,)])
def test_bad_dims_are_refused(dims: tuple) -> None:
    with pytest.raises(ValueError, match="dims"):
        TensorSpec("x", DataType.FP32, dims)


def _sig() -> ModelSignature:
    return ModelSignature(
        inputs=(TensorSpec("image in", DataType.UINT8, (3, -1, -1)), TensorSpec("k.0", DataType.INT64, (1,)),
                TensorSpec("mask", DataType.BOOL, (4,), optional=True)),
        outputs=(TensorSpec("boxes", DataType.FP32, (-1, 4)), TensorSpec("scores", DataType.FP16, (-1,))),
        max_batch_size=0)


def test_a_request_that_fits_passes_and_shape_keys_group_it() -> None:
    sig = _sig()
    req = {"image in": np.zeros((3, 5, 7), np.uint8), "k.0": np.array([2], np.int64)}
    sig.check_request(req)
    sig.check_request({**req, "mask": np.ones(4, bool)})
    other = {"image in": np.zeros((3, 5, 8), np.uint8), "k.0": np.array([2], np.int64)}
    assert sig.shape_key(req) != sig.shape_key(other)
    assert sig.shape_key(req) == sig.shape_key({"k.0": np.array([9]), "image in": np.ones((3, 5, 7), np.uint8)})
    assert not sig.batched
    assert sig.input("k.0").fixed_bytes() == 8 and sig.input("image in").fixed_bytes() is None


@pytest.mark.parametrize(("req", "match"), [
    ({"k.0": np.array([2], np.int64)}, "missing input 'image in' UINT8"),
    ({"image in": np.zeros((3, 5, 7), np.float32), "k.0": np.array([2], np.int64)},
     "input 'image in' has datatype FP32, the model wants UINT8"),
    ({"image in": np.zeros((5, 7), np.uint8), "k.0": np.array([2], np.int64)},
     r"input 'image in' has shape \[5, 7\], the model wants \[3,-1,-1\]"),
    ({"image in": np.zeros((3, 5, 7), np.uint8), "k.0": np.array([2], np.int64), "extra": np.zeros(1)},
     "unknown input 'extra'"),
    ({"image in": np.zeros((3, 5, 7), np.uint8), "k.0": np.array([2, 3], np.int64)},
     r"input 'k.0' has shape \[2\]"),
])
def test_a_request_that_does_not_fit_names_the_tensor_and_what_the_model_wants(req: dict, match: str) -> None:
    with pytest.raises(SignatureError, match=match):
        _sig().check_request(req)


def test_signature_refuses_duplicates_and_empty_sides() -> None:
    a = TensorSpec("a", DataType.FP32, (1,))
    with pytest.raises(ValueError, match="repeated"):
        ModelSignature((a, a), (a,))
    with pytest.raises(ValueError, match="at least one input"):
        ModelSignature((), (a,))
    with pytest.raises(ValueError, match="max_batch_size"):
        ModelSignature((a,), (a,), max_batch_size=-1)


def test_signature_dict_round_trip() -> None:
    sig = ModelSignature((TensorSpec("x", DataType.BF16, (-1, 8), reshape=(2, -1, 4)),),
                         (TensorSpec("y", DataType.FP64, (3,)),), max_batch_size=8)
    assert ModelSignature.from_dict(sig.to_dict()) == sig
