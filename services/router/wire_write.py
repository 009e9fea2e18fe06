"""Writing the protobuf wire format: what the router appends to the messages it forwards.

The router changes a message by *appending* fields: in protobuf a later scalar field wins and
a later map entry replaces an earlier one, so `original + override` is the edited message and
the tensor bytes are never copied into a new encoding. The overrides of a route's target go
onto the request (`forwarder`), the router's own parameters onto the executor's answer
(`router_answer`, the last step of the request path); what the router reads is `wire`.
"""

from __future__ import annotations

from collections.abc import Mapping

from services.router.wire import ID, LEN, MODEL_NAME, STREAM_ERROR, STREAM_RESPONSE, Param
from switchyard.gen.inference import grpc_service_pb2 as pb


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


def bytes_field(field: int, data: bytes) -> bytes:
    return encode_varint((field << 3) | LEN) + encode_varint(len(data)) + data


def string_field(field: int, value: str) -> bytes:
    return bytes_field(field, value.encode())


def stream_answer(response: bytes) -> bytes:
    """A serialized ModelInferResponse as a ModelStreamInferResponse, its bytes not re-encoded."""
    return bytes_field(STREAM_RESPONSE, response)


def stream_error(message: str, request_id: str) -> bytes:
    """An in-band stream error, with the request's id in infer_response."""
    answer = bytes_field(STREAM_RESPONSE, string_field(ID, request_id)) if request_id else b""
    return string_field(STREAM_ERROR, message) + answer


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
