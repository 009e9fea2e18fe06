"""Decoding of the evaluator's raw tensors (OIP datatype names) into float64 numpy arrays.

Every comparison is made in float64 so the metrics measure the paths, not the evaluator.
BF16 has no numpy dtype: its 16 bits are the upper half of an IEEE float32, so widening is a
shift. Byte sizes are checked against shape and datatype before anything is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from switchyard.judge.judge_errors import BadTensor

_NUMPY: dict[str, str] = {
    "FP64": "<f8",
    "FP32": "<f4",
    "FP16": "<f2",
    "INT64": "<i8",
    "INT32": "<i4",
    "INT16": "<i2",
    "INT8": "i1",
    "UINT64": "<u8",
    "UINT32": "<u4",
    "UINT16": "<u2",
    "UINT8": "u1",
    "BOOL": "?",
}
FLOAT_TYPES = frozenset({"FP64", "FP32", "FP16", "BF16"})


@dataclass(frozen=True)
class DecodedTensor:
    """A tensor widened to float64, with the datatype it arrived in."""

    datatype: str
    values: npt.NDArray[np.float64]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.values.shape)


def itemsize(datatype: str) -> int:
    if datatype == "BF16":
        return 2
    if datatype not in _NUMPY:
        raise BadTensor(
            f"datatype {datatype!r} cannot be compared; use one of {', '.join(sorted([*_NUMPY, 'BF16']))}"
        )
    return int(np.dtype(_NUMPY[datatype]).itemsize)


def decode(name: str, datatype: str, shape: list[int], data: bytes) -> DecodedTensor:
    """Decode raw little-endian bytes; `name` says which tensor in error messages."""
    if any(d < 0 for d in shape):
        raise BadTensor(f"{name}: shape {shape} has a negative dimension")
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    expected = count * itemsize(datatype)
    if len(data) != expected:
        raise BadTensor(
            f"{name}: {len(data)} bytes do not match shape {shape} of {datatype} ({expected} bytes expected)"
        )
    if datatype == "BF16":
        bits = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
        values = bits.view(np.float32).astype(np.float64)
    else:
        values = np.frombuffer(data, dtype=_NUMPY[datatype]).astype(np.float64)
    return DecodedTensor(datatype, values.reshape(shape))


def encode(values: npt.NDArray[np.generic], datatype: str) -> bytes:
    """The inverse of `decode` (used by clients and tests to build requests)."""
    if datatype == "BF16":
        as32 = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
        # round to nearest even, as torch does when it narrows float32 to bfloat16
        rounded = (as32 + 0x7FFF + ((as32 >> 16) & 1)) >> 16
        return rounded.astype("<u2").tobytes()
    itemsize(datatype)
    return np.ascontiguousarray(values, dtype=_NUMPY[datatype]).tobytes()
