"""Protobuf wire-format helpers that let the router forward OIP messages without re-encoding.

The router never decodes tensors. It reads the few top-level header fields of a
`ModelInferRequest` (model name, version, id) by walking the wire format and skipping the
length-delimited tensor fields by their length, and it changes a message by *appending*
fields: in protobuf a later scalar field wins and a later map entry replaces an earlier one,
so `original + override` is the edited message and the tensor bytes are never copied into
a new encoding. Responses are read the same way: only their `parameters` entries are parsed.
"""

from __future__ import annotations

from collections.abc import Mapping
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


def bytes_field(field: int, data: bytes) -> bytes:
    return encode_varint((field << 3) | _LEN) + encode_varint(len(data)) + data


def string_field(field: int, value: str) -> bytes:
    return bytes_field(field, value.encode())


# ModelStreamInferResponse fields: an in-band error ("STATUS: why") or the response.
STREAM_ERROR, STREAM_RESPONSE = 1, 2


def stream_answer(response: bytes) -> bytes:
    """A serialized ModelInferResponse as a ModelStreamInferResponse, its bytes not re-encoded."""
    return bytes_field(STREAM_RESPONSE, response)


def stream_error(message: str, request_id: str) -> bytes:
    """An in-band stream error, with the request's id in infer_response."""
    answer = bytes_field(STREAM_RESPONSE, string_field(ID, request_id)) if request_id else b""
    return string_field(STREAM_ERROR, message) + answer


Param = str | int | float | bool

_TENSOR_FIELDS = frozenset((5, 6))  # outputs, raw_output_contents of a ModelInferResponse
# Below this size the native (upb) decoder reads a whole response faster than Python walks it.
FULL_PARSE_BYTES = 256 * 1024


def parameters_field(params: Mapping[str, Param]) -> bytes:
    """Encoded `parameters` map entries (field 4) to append to a request or response."""
    message = pb.ModelInferResponse()
    for key, value in params.items():
        slot = message.parameters[key]
        if isinstance(value, bool):
            slot.bool_param = value
        elif isinstance(value, int):
            slot.int64_param = value
        elif isinstance(value, float):
            slot.double_param = value
        else:
            slot.string_param = value
    # A message holding only the map serialises to exactly the entries to append.
    return message.SerializeToString()


def string_parameter(key: bytes, value: str) -> bytes:
    """One `parameters` entry with a string value, as `parameters_field({key: value})` encodes
    it, written directly when key and value are short (about a third of the cost: the router
    adds the request id to every answer)."""
    data = value.encode()
    if len(key) + len(data) > 100:
        return parameters_field({key.decode(): value})
    inner = 2 + len(data)  # InferParameter: string_param (3), length, bytes
    head = bytes((0x22, 4 + len(key) + inner, 0x0A, len(key)))  # entry; its key (1)
    return b"".join((head, key, bytes((0x12, inner, 0x1A, len(data))), data))  # its value (2)


def int_parameter(key: bytes, value: int) -> bytes:
    """One `parameters` entry with an int64 value, as `parameters_field({key: value})` encodes
    it, written directly for a short key and a value >= 0."""
    if value < 0 or len(key) > 100:
        return parameters_field({key.decode(): value})
    data = encode_varint(value)
    inner = 1 + len(data)  # InferParameter: int64_param (2), varint
    head = bytes((0x22, 4 + len(key) + inner, 0x0A, len(key)))  # entry; its key (1)
    return b"".join((head, key, bytes((0x12, inner, 0x10)), data))  # its value (2)


_PATH_ENTRIES: dict[str, bytes] = {}  # path -> its encoded `path` parameter (paths are few)


def router_answer(reply: bytes, path: str, request_id: str, overhead_us: int, model_name: str = "") -> bytes:
    """An executor's serialized answer with the router's own fields appended: the model name the
    caller asked for (where the route's target serves it under another), and the parameters
    `path`, `request_id` and `router_overhead_us`."""
    entry = _PATH_ENTRIES.get(path)
    if entry is None:
        entry = _PATH_ENTRIES.setdefault(path, parameters_field({"path": path}))
    name = string_field(MODEL_NAME, model_name) if model_name else b""
    return b"".join(
        (
            reply,
            name,
            entry,
            string_parameter(b"request_id", request_id),
            int_parameter(b"router_overhead_us", overhead_us),
        )
    )


def _header_prefix(buf: bytes) -> bytes:
    """The bytes before the first tensor field (executors write fields in number order)."""
    pos = 0
    end = len(buf)
    params_after_tensors = False
    tensors_at = -1
    while pos < end:
        key, value_at = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire != _LEN:
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
