"""The OIP tensor codec: every datatype round-trips, byte sizes are checked against shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from switchyard import codec
from switchyard.errors import InvalidArgument

NUMPY_TYPES = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}


@pytest.mark.parametrize("datatype", sorted(NUMPY_TYPES))
def test_numpy_round_trip_is_exact_and_zero_copy(datatype: str) -> None:
    array: np.ndarray = (np.arange(24).reshape(2, 3, 4) % 7 - 3).astype(NUMPY_TYPES[datatype])
    wire_type, raw = codec.encode_numpy(array)
    assert wire_type == datatype
    assert len(raw) == array.size * codec.element_size(datatype)
    decoded = codec.decode("t", datatype, array.shape, raw)
    np.testing.assert_array_equal(decoded.array, array)
    assert not decoded.array.flags.writeable  # a view of the request's bytes, not a copy
    tensor = codec.to_torch(decoded.array, datatype)
    assert tensor.dtype == codec.torch_dtype(datatype)
    back_type, back_raw = codec.encode_torch(tensor)
    assert (back_type, back_raw) == (datatype, raw)


def test_bf16_travels_as_bit_patterns_and_widens_exactly() -> None:
    tensor = torch.tensor([[1.5, -2.25, 3.0e10]], dtype=torch.bfloat16)
    datatype, raw = codec.encode_torch(tensor)
    assert datatype == "BF16" and len(raw) == 6
    wire = codec.decode("t", "BF16", [1, 3], raw)
    assert torch.equal(codec.to_torch(wire.array, "BF16"), tensor)
    np.testing.assert_array_equal(codec.decode_numpy("BF16", [1, 3], raw), tensor.float().numpy())


def test_bytes_use_four_byte_little_endian_length_prefix() -> None:
    values = [b"", b"a", b"hello \x00 world"]
    raw = codec.encode_bytes(values)
    assert raw[:4] == b"\x00\x00\x00\x00" and raw[4:8] == b"\x01\x00\x00\x00"
    decoded = codec.decode("s", "BYTES", [3], raw)
    assert list(decoded.array) == values
    assert codec.encode_numpy(np.array(values, dtype=object)) == ("BYTES", raw)


@pytest.mark.parametrize(
    ("datatype", "shape", "raw", "message"),
    [
        ("FP32", [2, 3], b"\x00" * 20, "needs 24 bytes"),
        ("INT64", [1], b"\x00" * 4, "needs 8 bytes"),
        ("FP32", [-1, 3], b"", "negative dimension"),
        ("FP8", [1], b"\x00", "unknown datatype"),
        ("BYTES", [2], codec.encode_bytes([b"x"]), "needs 2"),
        ("BYTES", [1], b"\x05\x00\x00\x00ab", "runs past"),
        ("BYTES", [1], b"\x05\x00", "length prefix"),
    ],
)
def test_bad_contents_are_invalid_argument_with_a_fix(
    datatype: str, shape: list[int], raw: bytes, message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        codec.decode("x", datatype, shape, raw)
