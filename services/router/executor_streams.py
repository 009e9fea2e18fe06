"""The gRPC-stream `ExecutorTransport`: inference on long-lived ModelStreamInfer streams.

A request takes a stream from the deployment's idle set (or opens one), writes the request,
reads the answer and puts the stream back. A message on an open stream costs about half a
unary call's round trip here (no per-call stream set-up, headers or trailers), which is most
of what a Python hop adds. What a unary call carried per call travels in request parameters
instead (`executor_transport.request_parameters`): the remaining deadline as Triton's
`timeout` (the executor drops the request from its queue when it passes, and the router
cancels the stream then too) and the trace context. A stream whose request timed out or whose
caller went away is cancelled, never reused (its late answer would belong to nobody); the
executor then drops the queued work. A generation (`stream`) gets a call of its own, read until
its final response. The small metadata RPCs are plain unary calls on the same channel.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import grpc
from google.protobuf.message import Message

from services import inband_status
from services.router.executor_transport import Reply, request_parameters, unwrap_answer
from switchyard import oip_params, telemetry
from switchyard.errors import Status, UpstreamError
from switchyard.gen.inference import grpc_service_pb2 as pb
from switchyard.grpcio import status_of

SERVICE = "inference.GRPCInferenceService"
STREAM_METHOD = f"/{SERVICE}/ModelStreamInfer"
MAX_IDLE_STREAMS = 64  # per deployment; more concurrent requests open more, closed when idle
# A stream that ends with one of these was broken under the request (the executor killed or
# stopped, the connection lost: grpc reports "Internal error from Core" for a write on a dead
# connection): UNAVAILABLE, so the router ejects the deployment and retries elsewhere.
_BROKEN = frozenset((grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN))
_EXPIRED = "deadline exceeded waiting for the executor"
_CLOSED = "the executor closed the stream"


def _stream_broke(exc: grpc.aio.AioRpcError) -> UpstreamError:
    """The executor's status for a stream call that ended with `exc`: a broken stream is
    UNAVAILABLE (the executor answers its own errors in-band, never by ending the stream)."""
    code, details = exc.code(), exc.details() or exc.code().name
    if code in _BROKEN:
        return UpstreamError(Status.UNAVAILABLE, f"the stream to the executor broke: {details}")
    return UpstreamError(status_of(code), details)


def _expire_after(call: Any, timeout_s: float) -> tuple[asyncio.TimerHandle, Callable[[], bool]]:
    """Cancels `call` when its deadline passes; returns the timer and whether it fired."""
    fired = False

    def expire() -> None:
        nonlocal fired
        fired = True
        call.cancel()

    return asyncio.get_running_loop().call_later(timeout_s, expire), lambda: fired


class GrpcStreamTransport:
    """Inference over each deployment's gRPC channel, on pooled ModelStreamInfer streams."""

    def __init__(self, channels: Mapping[str, grpc.aio.Channel]) -> None:
        self._channels = channels
        # Identity (de)serialisers: request and response stay bytes end to end.
        self._open_stream: dict[str, Any] = {
            name: ch.stream_stream(STREAM_METHOD) for name, ch in channels.items()
        }
        self._idle: dict[str, list[Any]] = {name: [] for name in channels}
        self._tracing = telemetry.enabled()  # set up before the router starts, as the CLI does

    def close(self) -> None:
        for calls in self._idle.values():
            for call in calls:
                call.cancel()
            calls.clear()

    async def send_streamed(self, deployment: str, parts: Sequence[bytes], timeout_s: float) -> bytes:
        message = b"".join((*parts, request_parameters(timeout_s, True, self._tracing)))
        return unwrap_answer(await self.answer(deployment, message, timeout_s))

    async def answer(self, deployment: str, message: bytes, timeout_s: float) -> bytes:
        """One message on one of the deployment's streams; returns the ModelStreamInferResponse."""
        idle = self._idle[deployment]
        call = None
        while idle and call is None:
            call = idle.pop()
            if call.done():  # ended while idle (executor restarted or drained)
                call = None
        if call is None:
            call = self._open_stream[deployment]()
        timer, expired = _expire_after(call, timeout_s)
        try:
            await call.write(message)
            answer = await call.read()
        except (asyncio.CancelledError, grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            call.cancel()  # it owes an answer that would belong to nobody: never reuse it
            if expired():
                raise UpstreamError(Status.DEADLINE_EXCEEDED, _EXPIRED) from None
            if isinstance(exc, asyncio.CancelledError):
                raise  # the caller went away
            if isinstance(exc, grpc.aio.AioRpcError):
                raise _stream_broke(exc) from None
            # InvalidStateError: the stream ended between the check above and the write
            raise UpstreamError(Status.UNAVAILABLE, _CLOSED) from None
        finally:
            timer.cancel()
        if answer is grpc.aio.EOF:
            raise UpstreamError(Status.UNAVAILABLE, _CLOSED)
        if len(idle) < MAX_IDLE_STREAMS:
            idle.append(call)
        else:
            await call.done_writing()
        reply: bytes = answer
        return reply

    async def stream(
        self, deployment: str, parts: Sequence[bytes], timeout_s: float
    ) -> AsyncIterator[pb.ModelInferResponse]:
        """One request on a ModelStreamInfer call of its own: each response until the one flagged
        `triton_final_response` (a decoupled model's many), or the only one of another model.
        Leaving early cancels the call, and with it the executor's work (its slot is freed)."""
        call = self._open_stream[deployment]()
        timer, expired = _expire_after(call, timeout_s)
        try:
            try:
                await call.write(b"".join((*parts, request_parameters(timeout_s, False, self._tracing))))
                await call.done_writing()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                raise UpstreamError(Status.UNAVAILABLE, _CLOSED) from None
            answered = False
            while (response := await self._next_response(call, expired, answered)) is not None:
                answered = True
                yield response
                final = response.parameters.get(oip_params.FINAL)
                if final is None or final.bool_param:
                    return
        finally:
            timer.cancel()
            call.cancel()  # done (a no-op) or given up on: nothing more is owed to anyone

    @staticmethod
    async def _next_response(
        call: Any, expired: Callable[[], bool], answered: bool
    ) -> pb.ModelInferResponse | None:
        """The stream's next response; None at its end after an answer."""
        try:
            answer = await call.read()
        except grpc.aio.AioRpcError as exc:
            if expired():
                raise UpstreamError(Status.DEADLINE_EXCEEDED, _EXPIRED) from None
            raise _stream_broke(exc) from None
        if answer is grpc.aio.EOF:
            if not answered:
                raise UpstreamError(Status.UNAVAILABLE, _CLOSED)
            return None
        message = pb.ModelStreamInferResponse.FromString(answer)
        if message.error_message:
            raise inband_status.parse(message.error_message)
        return message.infer_response

    async def call(
        self, deployment: str, method: str, request: Message, reply_type: type[Reply], timeout_s: float
    ) -> Reply:
        stub: Any = self._channels[deployment].unary_unary(
            f"/{SERVICE}/{method}",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=reply_type.FromString,
        )
        try:
            reply: Reply = await stub(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise UpstreamError(status_of(exc.code()), exc.details() or exc.code().name) from None
        return reply
