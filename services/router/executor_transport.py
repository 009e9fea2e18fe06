"""How a request reaches an executor: the `ExecutorTransport` port the forwarder sends through.

The forwarder (`forwarder`) decides where a request goes and what to do when it fails; a
transport only carries it there and back. Two carry inference: `GrpcStreamTransport`
(long-lived ModelStreamInfer streams, `executor_streams`) and `FrameTransport` (framed
inference on a plain TCP connection, opened by the health watch); `ExecutorPool`
(`executor_pool`, which holds `FrameTransport` too) offers both behind this one port, choosing
per deployment, and watches their health.

Every failure is an `UpstreamError` with the executor's own status: its in-band "STATUS: why"
(services.inband_status) parsed back, or UNAVAILABLE for a connection or stream that broke
under the request (the executor did not take it: the forwarder may try elsewhere).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol, TypeVar

from google.protobuf.message import Message

from services import inband_status
from services.router import wire, wire_write
from switchyard import oip_params, telemetry
from switchyard.gen.inference import grpc_service_pb2 as pb

Reply = TypeVar("Reply", bound=Message)
_STREAM_FIELDS = frozenset((wire.STREAM_ERROR, wire.STREAM_RESPONSE))


class ExecutorTransport(Protocol):
    """Carries requests to a named deployment's executor."""

    async def send_tensor(self, deployment: str, parts: Sequence[bytes], timeout_s: float) -> bytes:
        """One ModelInferRequest (the concatenated `parts`, the router's overrides appended);
        returns the serialized ModelInferResponse."""
        ...

    def stream(
        self, deployment: str, parts: Sequence[bytes], timeout_s: float
    ) -> AsyncIterator[pb.ModelInferResponse]:
        """One request's responses as the executor sends them (a decoupled model's many)."""
        ...

    async def call(
        self, deployment: str, method: str, request: Message, reply_type: type[Reply], timeout_s: float
    ) -> Reply:
        """One small unary OIP RPC (ModelMetadata, ModelConfig, ...) by its method name."""
        ...


# what every unary request asks besides its deadline: one answer even from a decoupled
# (generative) model, and the executor's statistics (the router routes and meters by them)
_UNARY_STATS = wire_write.parameters_field({oip_params.UNARY: True, oip_params.STATS: True})
_TIMEOUT = oip_params.TIMEOUT.encode()


def request_parameters(timeout_s: float, unary: bool, tracing: bool) -> bytes:
    """The parameters every request carries to the executor, appended to its bytes: the remaining
    deadline (Triton's `timeout`, microseconds), for one answer (`unary`) that one answer is
    wanted even from a decoupled model and with the executor's statistics (`switchyard_stats`),
    and the trace context when tracing."""
    # the entries written directly (wire_write), not through a protobuf message per request
    deadline = wire_write.int_parameter(_TIMEOUT, max(1, int(timeout_s * 1e6)))
    if not unary and not tracing:
        return deadline
    parts = [deadline]
    if unary:
        parts.append(_UNARY_STATS)
    if tracing:
        carrier = telemetry.trace_parameters()
        parts.extend(wire_write.string_parameter(key.encode(), value) for key, value in carrier.items())
    return b"".join(parts)  # later map entries win


def unwrap_answer(reply: bytes) -> bytes:
    """The ModelInferResponse inside a serialized ModelStreamInferResponse, without decoding its
    tensors; its in-band error as an UpstreamError."""
    fields = wire.scan_fields(reply, _STREAM_FIELDS)
    if wire.STREAM_ERROR in fields:
        start, stop = fields[wire.STREAM_ERROR][-1]
        raise inband_status.parse(reply[start:stop].decode(errors="replace"))
    start, stop = fields[wire.STREAM_RESPONSE][-1] if wire.STREAM_RESPONSE in fields else (0, 0)
    return reply[start:stop]
