"""OIP tensor codec: `raw_input_contents` / `raw_output_contents` <-> numpy and torch.

A request's inputs may come as typed `contents` instead (`decode_contents`): they are read as
the raw bytes they stand for, and decoded as raw contents are.

Raw contents are little-endian, row-major. BYTES elements are each a 4-byte little-endian
length followed by the bytes. Decoding a fixed-size datatype is a zero-copy, read-only numpy
view of the request's bytes; the one copy happens when a batch is assembled (it has to exist
anyway to pad and stack requests). BF16 has no numpy dtype, so it travels as uint16 bit
patterns and becomes `torch.bfloat16` by a reinterpreting view.

Errors are `InvalidArgument` with a message that says what to fix. This module needs numpy;
torch is imported only by the functions that convert to or from it (clients need no torch).
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from switchyard.errors import InvalidArgument

if TYPE_CHECKING:  # torch is imported lazily: clients and the CLI use the codec without it
    import torch

# OIP datatype -> (numpy dtype used on the wire, name of the torch dtype)
_FIXED: dict[str, tuple[np.dtype[np.generic], str]] = {
    "BOOL": (np.dtype(np.bool_), "bool"),
    "UINT8": (np.dtype("<u1"), "uint8"),
    "INT8": (np.dtype("<i1"), "int8"),
    "INT16": (np.dtype("<i2"), "int16"),
    "INT32": (np.dtype("<i4"), "int32"),
    "INT64": (np.dtype("<i8"), "int64"),
    "FP16": (np.dtype("<f2"), "float16"),
    "BF16": (np.dtype("<u2"), "bfloat16"),
    "FP32": (np.dtype("<f4"), "float32"),
    "FP64": (np.dtype("<f8"), "float64"),
}
DATATYPES = (*_FIXED, "BYTES")
_NUMPY_TO_OIP = {np.dtype(d).newbyteorder("<"): n for n, (d, _) in _FIXED.items() if n != "BF16"}
# OIP datatype -> the field of typed `contents` (InferTensorContents) that carries it; FP16 and
# BF16 have none and only come raw, BYTES come in `bytes_contents`
CONTENT_FIELDS = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    return {name: getattr(torch, attr) for name, (_, attr) in _FIXED.items()}


@functools.cache
def _torch_to_oip() -> dict[torch.dtype, str]:
    return {t: name for name, t in _torch_dtypes().items()}


@dataclass(frozen=True)
class WireTensor:
    """One decoded tensor: `array` is a read-only view (BF16 as uint16 bit patterns)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    array: np.ndarray


def element_size(datatype: str) -> int:
    if datatype not in _FIXED:
        raise InvalidArgument(f"datatype {datatype!r} has no fixed element size")
    return int(_FIXED[datatype][0].itemsize)


def torch_dtype(datatype: str) -> torch.dtype:
    if datatype not in _FIXED:
        raise InvalidArgument(f"datatype {datatype!r} is not a tensor datatype; use one of {DATATYPES}")
    return _torch_dtypes()[datatype]


def oip_datatype(dtype: torch.dtype) -> str:
    try:
        return _torch_to_oip()[dtype]
    except KeyError:
        raise InvalidArgument(f"torch dtype {dtype} has no OIP datatype") from None


def numpy_datatype(dtype: np.dtype[np.generic]) -> str:
    if dtype.kind in ("S", "O", "U"):
        return "BYTES"
    try:
        return _NUMPY_TO_OIP[dtype.newbyteorder("<")]
    except KeyError:
        raise InvalidArgument(f"numpy dtype {dtype} has no OIP datatype") from None


MAX_RANK = 16  # dimensions of one tensor, at most


def _check_shape(name: str, shape: Sequence[int]) -> tuple[int, ...]:
    if len(shape) > MAX_RANK:  # before anything is decoded: numpy's reshape would raise past 64
        raise InvalidArgument(f"input {name!r}: shape has {len(shape)} dimensions; the limit is {MAX_RANK}")
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"input {name!r}: shape {list(shape)} has a negative dimension")
    return tuple(int(d) for d in shape)


def decode(name: str, datatype: str, shape: Sequence[int], raw: bytes) -> WireTensor:
    """Decodes one raw tensor, validating its byte size against shape and datatype."""
    dims = _check_shape(name, shape)
    count = math.prod(dims)
    if datatype == "BYTES":
        return WireTensor(name, datatype, dims, _decode_bytes(name, raw, count).reshape(dims))
    if datatype not in _FIXED:
        raise InvalidArgument(f"input {name!r}: unknown datatype {datatype!r}; use one of {DATATYPES}")
    np_dtype = _FIXED[datatype][0]
    expected = count * np_dtype.itemsize
    if len(raw) != expected:
        raise InvalidArgument(
            f"input {name!r}: {len(raw)} bytes of raw contents, but shape {list(dims)} of {datatype} "
            f"needs {expected} bytes"
        )
    return WireTensor(name, datatype, dims, np.frombuffer(raw, dtype=np_dtype).reshape(dims))


def _decode_bytes(name: str, raw: bytes, count: int) -> np.ndarray:
    items: list[bytes] = []
    view = memoryview(raw)
    pos = 0
    while pos < len(raw):
        if pos + 4 > len(raw):
            raise InvalidArgument(f"input {name!r}: BYTES contents end inside a 4-byte length prefix")
        (length,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + length > len(raw):
            raise InvalidArgument(f"input {name!r}: BYTES element {len(items)} runs past the contents")
        items.append(bytes(view[pos : pos + length]))
        pos += length
    if len(items) != count:
        raise InvalidArgument(f"input {name!r}: {len(items)} BYTES elements, but the shape needs {count}")
    out = np.empty(count, dtype=object)
    out[:] = items
    return out


def decode_contents(name: str, datatype: str, shape: Sequence[int], contents: Any) -> WireTensor:
    """Decodes one tensor sent in typed `contents` (OIP's InferTensorContents: a repeated field
    per datatype) rather than raw bytes; datatypes that have no such field must come raw."""
    if datatype == "BYTES":
        return decode(name, datatype, shape, encode_bytes(list(contents.bytes_contents)))
    field = CONTENT_FIELDS.get(datatype) if datatype in _FIXED else None
    if field is None:
        raise InvalidArgument(f"input {name!r}: {datatype} must be sent in raw_input_contents")
    data = np.asarray(getattr(contents, field), dtype=element_dtype(datatype)).tobytes()
    return decode(name, datatype, shape, data)


def encode_bytes(values: Sequence[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


def to_torch(array: np.ndarray, datatype: str) -> torch.Tensor:
    """Numpy (possibly a read-only view) -> torch; copies only when the view is read-only."""
    if datatype == "BYTES":
        raise InvalidArgument("BYTES tensors cannot become torch tensors")
    import torch

    if not array.flags.writeable:
        array = array.copy()
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if datatype == "BF16" else tensor


def encode_torch(tensor: torch.Tensor) -> tuple[str, bytes]:
    """A CPU tensor -> (datatype, raw little-endian bytes); one copy, into the bytes object."""
    import torch

    datatype = oip_datatype(tensor.dtype)
    t = tensor.detach().contiguous()
    if datatype == "BF16":
        t = t.view(torch.int16)
    return datatype, t.numpy().tobytes()


def encode_numpy(array: np.ndarray) -> tuple[str, bytes]:
    """A numpy array -> (datatype, raw bytes); object/bytes arrays become BYTES."""
    datatype = numpy_datatype(array.dtype)
    if datatype == "BYTES":
        flat = [v if isinstance(v, bytes) else str(v).encode() for v in array.reshape(-1)]
        return datatype, encode_bytes(flat)
    return datatype, np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def decode_numpy(datatype: str, shape: Sequence[int], raw: bytes) -> np.ndarray:
    """Client side: raw output -> numpy; BF16 widens exactly to float32."""
    wire = decode("output", datatype, shape, raw)
    if datatype == "BF16":
        return (wire.array.astype(np.uint32) << 16).view(np.float32)
    return wire.array


def element_dtype(datatype: str) -> np.dtype[np.generic]:
    """The numpy dtype of a fixed-size datatype on the wire (BF16: uint16 bit patterns)."""
    if datatype not in _FIXED:
        raise InvalidArgument(f"datatype {datatype!r} has no fixed element size")
    return _FIXED[datatype][0]
