"""Reading the protobuf wire format, so that the router forwards OIP messages undecoded.

The router never decodes tensors. It reads the few top-level header fields of a
`ModelInferRequest` (model name, version, id) by walking the wire format and skipping the
length-delimited tensor fields by their length. Responses are read the same way: only their
`parameters` entries are parsed. What the router writes, it appends (`wire_write`): the
request's header is read here as it comes in, the answer is written there as it leaves.
"""

from __future__ import annotations

from dataclasses import dataclass

from switchyard.errors import InvalidArgument
from switchyard.gen.inference import grpc_service_pb2 as pb

# Top-level field numbers shared by ModelInferRequest and ModelInferResponse.
MODEL_NAME = 1
MODEL_VERSION = 2
ID = 3
PARAMETERS = 4

_VARINT, _FIXED64, LEN, _FIXED32 = 0, 1, 2, 5  # wire types (LEN: length-delimited)


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
        if wire == LEN:
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


# ModelStreamInferResponse fields: an in-band error ("STATUS: why") or the response.
STREAM_ERROR, STREAM_RESPONSE = 1, 2


Param = str | int | float | bool

_TENSOR_FIELDS = frozenset((5, 6))  # outputs, raw_output_contents of a ModelInferResponse
# Below this size the native (upb) decoder reads a whole response faster than Python walks it.
FULL_PARSE_BYTES = 256 * 1024


def _header_prefix(buf: bytes) -> bytes:
    """The bytes before the first tensor field (executors write fields in number order)."""
    pos = 0
    end = len(buf)
    params_after_tensors = False
    tensors_at = -1
    while pos < end:
        key, value_at = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire != LEN:
            raise InvalidArgument(f"malformed ModelInferResponse: field {field} has wire type {wire}")
        length, data_at = _varint(buf, value_at)
        if field in _TENSOR_FIELDS and tensors_at < 0:
            tensors_at = pos
        elif field == PARAMETERS and tensors_at >= 0:
            params_after_tensors = True
            break
        pos = data_at + length
    if params_after_tensors or tensors_at < 0:
        return buf  # unusual order or no tensors: read it all
    return buf[:tensors_at]


def read_parameters(buf: bytes) -> dict[str, Param]:
    """The `parameters` map of a ModelInferResponse, without decoding large tensors."""
    head = buf if len(buf) <= FULL_PARSE_BYTES else _header_prefix(buf)
    message = pb.ModelInferResponse.FromString(head)
    out: dict[str, Param] = {}
    for key, param in message.parameters.items():
        which = param.WhichOneof("parameter_choice")
        if which is not None:
            out[key] = getattr(param, which)
    return out


def read_int_parameters(buf: bytes, keys: tuple[str, ...]) -> tuple[int, ...]:
    """Just the named int64 parameters of a response (0 when absent): the router's hot path."""
    head = buf if len(buf) <= FULL_PARSE_BYTES else _header_prefix(buf)
    params = pb.ModelInferResponse.FromString(head).parameters
    return tuple(params[k].int64_param if k in params else 0 for k in keys)
