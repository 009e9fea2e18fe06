"""Protobuf wire-format helpers that let the router forward OIP messages without re-encoding.

The router never decodes tensors. It reads the few top-level header fields of a
`ModelInferRequest` (model name, version, id) by walking the wire format and skipping the
length-delimited tensor fields by their length, and it changes a message by *appending*
fields: in protobuf a later scalar field wins and a later map entry replaces an earlier one,
so `original + override` is the edited message and the tensor bytes are never copied into
a new encoding. Responses are read the same way: only their `parameters` entries are parsed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from switchyard.errors import InvalidArgument
from switchyard.gen.inference import grpc_service_pb2 as pb

# Top-level field numbers shared by ModelInferRequest and ModelInferResponse.
MODEL_NAME = 1
MODEL_VERSION = 2
ID = 3
PARAMETERS = 4

_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= len(buf):
            raise InvalidArgument("malformed ModelInferRequest: truncated varint; send a valid protobuf")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise InvalidArgument("malformed ModelInferRequest: varint too long; send a valid protobuf")


def encode_varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


@dataclass(frozen=True)
class Header:
    """What the router needs from a request: the rest of it stays opaque bytes."""

    model_name: str
    model_version: str
    request_id: str


def scan_fields(buf: bytes, wanted: frozenset[int]) -> dict[int, list[tuple[int, int]]]:
    """(start, end) of each length-delimited value of the wanted top-level fields."""
    found: dict[int, list[tuple[int, int]]] = {}
    pos = 0
    end = len(buf)
    while pos < end:
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == _LEN:
            length, pos = _varint(buf, pos)
            if pos + length > end:
                raise InvalidArgument("malformed message: a field runs past the end; send a valid protobuf")
            if field in wanted:
                found.setdefault(field, []).append((pos, pos + length))
            pos += length
        elif wire == _VARINT:
            _, pos = _varint(buf, pos)
        elif wire == _FIXED64:
            pos += 8
        elif wire == _FIXED32:
            pos += 4
        else:
            raise InvalidArgument(f"malformed message: wire type {wire} of field {field} is not supported")
    if pos != end:
        raise InvalidArgument("malformed message: truncated fixed-width field; send a valid protobuf")
    return found


_HEADER_FIELDS = frozenset((MODEL_NAME, MODEL_VERSION, ID))


def read_header(buf: bytes) -> Header:
    found = scan_fields(buf, _HEADER_FIELDS)

    def last(field: int) -> str:
        spans = found.get(field)
        if not spans:
            return ""
        start, stop = spans[-1]  # proto3: the last occurrence of a scalar wins
        try:
            return buf[start:stop].decode()
        except UnicodeDecodeError as exc:
            raise InvalidArgument(f"field {field} of ModelInferRequest is not valid UTF-8") from exc

    return Header(last(MODEL_NAME), last(MODEL_VERSION), last(ID))


def string_field(field: int, value: str) -> bytes:
    data = value.encode()
    return encode_varint((field << 3) | _LEN) + encode_varint(len(data)) + data


Param = str | int | float | bool


def _parameter_value(value: Param) -> bytes:
    # InferParameter oneof: bool_param=1, int64_param=2, string_param=3, double_param=4.
    if isinstance(value, bool):
        return bytes((1 << 3 | _VARINT,)) + encode_varint(int(value))
    if isinstance(value, int):
        return bytes((2 << 3 | _VARINT,)) + encode_varint(value)
    if isinstance(value, float):
        return bytes((4 << 3 | _FIXED64,)) + struct.pack("<d", value)
    return string_field(3, value)


def parameters_field(params: dict[str, Param]) -> bytes:
    """Encoded `parameters` map entries (field 4) to append to a request or response."""
    out = bytearray()
    for key, value in params.items():
        inner = _parameter_value(value)
        entry = string_field(1, key) + encode_varint(2 << 3 | _LEN) + encode_varint(len(inner)) + inner
        out += encode_varint(PARAMETERS << 3 | _LEN)
        out += encode_varint(len(entry))
        out += entry
    return bytes(out)


_PARAM_FIELDS = frozenset((PARAMETERS,))


def read_parameters(buf: bytes) -> dict[str, Param]:
    """The `parameters` map of a ModelInferResponse, without decoding its tensors."""
    spans = scan_fields(buf, _PARAM_FIELDS).get(PARAMETERS, [])
    if not spans:
        return {}
    # Re-frame only the parameter entries and let the real decoder read them.
    framed = bytearray()
    for start, stop in spans:
        framed += encode_varint(PARAMETERS << 3 | _LEN) + encode_varint(stop - start)
        framed += buf[start:stop]
    message = pb.ModelInferResponse.FromString(bytes(framed))
    out: dict[str, Param] = {}
    for key, param in message.parameters.items():
        which = param.WhichOneof("parameter_choice")
        if which is not None:
            out[key] = getattr(param, which)
    return out
