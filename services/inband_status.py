"""The in-band status of a stream answer: "STATUS: why" in `ModelStreamInferResponse.error_message`.

A ModelStreamInfer stream (and a frame connection, services.frames, which carries the same
messages) answers each request on its own: a failed request cannot end the stream with a gRPC
status, since the stream's other requests go on. So its status travels in the answer as text,
the status name (docs/architecture.md#errors), a colon and a space, and the message that says
what to fix; Triton's clients read it the same way. The executor writes it and the router reads
it back into an `UpstreamError` that keeps the status, so the caller gets the executor's own
status whether it called the executor directly or through the router. This module is the one
place that writes and parses that text.
"""

from __future__ import annotations

from switchyard import oip_params
from switchyard.errors import Status, SwitchyardError, UpstreamError
from switchyard.gen.inference import grpc_service_pb2 as pb
from switchyard.grpcio import internal_error

_SEPARATOR = ": "


def encode(status: Status, why: str) -> str:
    """The in-band text of a status and its message."""
    return f"{status.value}{_SEPARATOR}{why}"


def encode_error(exc: BaseException, method: str) -> str:
    """The in-band text for an exception raised answering a stream request: a SwitchyardError's
    own status and message; anything else INTERNAL with a logged reference, never a traceback."""
    if isinstance(exc, SwitchyardError):
        return encode(exc.status, str(exc))
    return encode(Status.INTERNAL, internal_error(exc, method))


def parse(text: str) -> UpstreamError:
    """The status and message an in-band text names; UNKNOWN with the whole text when it names
    no status (or OK, which is no error)."""
    name, sep, why = text.partition(_SEPARATOR)
    status = Status.__members__.get(name) if sep else None
    if status is None:
        return UpstreamError(Status.UNKNOWN, text)
    return UpstreamError(status, why)


def error_response(message: str, request_id: str = "", final: bool = False) -> pb.ModelStreamInferResponse:
    """A stream answer carrying the in-band `message`, with the request's id when known; `final`
    flags it `triton_final_response` (the last answer of a decoupled request)."""
    response = pb.ModelStreamInferResponse(error_message=message)
    if request_id:
        response.infer_response.id = request_id
    if final:
        response.infer_response.parameters[oip_params.FINAL].bool_param = True
    return response
