"""The router's OIP servicer (`inference.GRPCInferenceService`): an adapter over `RequestPath`.

ModelInfer is registered with no (de)serialiser, so the request arrives as the caller's bytes
and the executor's bytes go back out: tensors are never decoded or re-encoded in the router.
ModelStreamInfer routes each request of a stream the same way. The small metadata RPCs are
answered from a serving deployment of the model's route, with the model name the caller used.
Server-level RPCs describe the router itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from services import inband_status
from services.router import ids, wire, wire_write
from services.router.request_path import RequestPath
from services.streams import StreamReplies
from switchyard import telemetry
from switchyard.errors import SwitchyardError, Unavailable, Unimplemented
from switchyard.gen.inference import grpc_service_pb2 as pb
from switchyard.grpcio import ServicerContext, map_errors

SERVICE = "inference.GRPCInferenceService"
VERSION = "0.1.0"
# registered with gRPC's core; the rest are found by the generic handler (ServerOptions)
HOT_METHODS = frozenset((f"/{SERVICE}/ModelInfer", f"/{SERVICE}/ModelStreamInfer"))
STREAM_WINDOW = 64  # requests of one ModelStreamInfer stream in the router at once
Req = TypeVar("Req", bound=Message)
Rep = TypeVar("Rep", bound=Message)
Ctx = ServicerContext


class OipServicer:
    def __init__(self, path: RequestPath) -> None:
        self.path = path
        self._tracing = telemetry.enabled()  # set up before the router starts, as the CLI does

    async def model_infer(self, raw: bytes, context: Ctx) -> bytes:
        metadata = context.invocation_metadata() or ()
        span = (
            telemetry.call_span(f"/{SERVICE}/ModelInfer", metadata)
            if self._tracing
            else contextlib.nullcontext()
        )
        with span:
            return await self.path.serve_tensor(raw, metadata, context.time_remaining(), context.peer())

    async def _upstream(
        self, model: str, context: Ctx, method: str, request: Req, reply_type: type[Rep]
    ) -> Rep:
        """Ask one serving deployment of the route the small RPC, as the model name it serves."""
        metadata = context.invocation_metadata() or ()
        call = (method, request, reply_type)
        return await self.path.ask(model, metadata, context.peer(), context.time_remaining(), call)

    async def model_metadata(
        self, request: pb.ModelMetadataRequest, context: Ctx
    ) -> pb.ModelMetadataResponse:
        name = request.name
        reply = await self._upstream(name, context, "ModelMetadata", request, pb.ModelMetadataResponse)
        reply.name = name
        return reply

    async def model_config(self, request: pb.ModelConfigRequest, context: Ctx) -> pb.ModelConfigResponse:
        name = request.name
        reply = await self._upstream(name, context, "ModelConfig", request, pb.ModelConfigResponse)
        reply.config.name = name
        return reply

    async def model_ready(self, request: pb.ModelReadyRequest, context: Ctx) -> pb.ModelReadyResponse:
        try:
            return await self._upstream(request.name, context, "ModelReady", request, pb.ModelReadyResponse)
        except Unavailable:
            return pb.ModelReadyResponse(ready=False)  # no healthy deployment: not ready, not an error

    async def server_live(self, request: pb.ServerLiveRequest, context: Ctx) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, request: pb.ServerReadyRequest, context: Ctx) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.path.forwarder.serving())

    async def server_metadata(
        self, request: pb.ServerMetadataRequest, context: Ctx
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(
            name="switchyard-router", version=VERSION, extensions=["model_configuration", "statistics"]
        )

    async def model_statistics(
        self, request: pb.ModelStatisticsRequest, context: Ctx
    ) -> pb.ModelStatisticsResponse:
        """One serving deployment's statistics for the model, under the name the caller used."""
        if not request.name:
            raise Unimplemented(
                "the router answers ModelStatistics per model: set `name` (executors report all of theirs)"
            )
        name = request.name
        reply = await self._upstream(name, context, "ModelStatistics", request, pb.ModelStatisticsResponse)
        for stats in reply.model_stats:
            stats.name = name
        return reply

    async def model_stream_infer(self, requests: AsyncIterator[bytes], context: Ctx) -> AsyncIterator[bytes]:
        """Each request routed as ModelInfer routes it, up to STREAM_WINDOW of a stream at once;
        an error is answered in-band as "STATUS: why" (with the request's id) and the stream goes
        on, as the executors answer. Requests to ordinary models are answered in request order;
        a request to a decoupled (generative) model streams its responses as they come, each
        flagged `triton_final_response`, beside the others (Triton's decoupled semantics). A
        caller without a valid key is refused the stream itself; each request is still admitted
        on its own, so a key revoked mid-stream stops working within the auth cache's TTL."""
        metadata = context.invocation_metadata() or ()
        peer = context.peer()
        await self.path.admission.identify(metadata, "stream:ModelStreamInfer", ids.time_ordered_hex(), peer)
        answers = _StreamAnswers(self, metadata, peer, context)
        # closed as the caller leaves: its work is dropped at the executors
        async with contextlib.aclosing(answers.replies.replies(lambda: answers.read(requests))) as replies:
            async for item in replies:
                yield item

    async def is_decoupled(self, raw: bytes) -> bool:
        try:
            return await self.path.is_decoupled(wire.read_header(raw).model_name)
        except SwitchyardError:
            return False  # the one-answer path answers with the error

    async def stream_generation(
        self, raw: bytes, metadata: Any, time_remaining: float | None, peer: str
    ) -> AsyncIterator[bytes]:
        try:
            async for response in self.path.generate(raw, metadata, time_remaining, peer):
                yield wire_write.stream_answer(response.SerializeToString())
            return
        except Exception as exc:  # one bad request must not end the stream the others share
            message = inband_status.encode_error(exc, f"/{SERVICE}/ModelStreamInfer")
        yield inband_status.error_response(message, _request_id(raw), final=True).SerializeToString()

    async def stream_answer(
        self, raw: bytes, metadata: Any, time_remaining: float | None, peer: str
    ) -> bytes:
        # with tracing on, each message is a span of the trace the stream's metadata names
        span = (
            telemetry.call_span(f"/{SERVICE}/ModelStreamInfer", metadata)
            if self._tracing
            else contextlib.nullcontext()
        )
        try:
            with span:
                answer = await self.path.serve_tensor(raw, metadata, time_remaining, peer)
                return wire_write.stream_answer(answer)
        except Exception as exc:  # one bad request must not end the stream the others share
            message = inband_status.encode_error(exc, f"/{SERVICE}/ModelStreamInfer")
        return wire_write.stream_error(message, _request_id(raw))


class _StreamAnswers:
    """One ModelStreamInfer call's requests in the router: each answered on its own task, at most
    STREAM_WINDOW at once; ordinary ones in request order, generations as their responses come."""

    def __init__(self, servicer: OipServicer, metadata: Any, peer: str, context: Ctx) -> None:
        self._servicer = servicer
        self._metadata = metadata
        self._peer = peer
        self._context = context
        self.replies: StreamReplies[bytes] = StreamReplies()
        self._window = asyncio.Semaphore(STREAM_WINDOW)
        self._last: asyncio.Task[None] | None = None  # the previous ordered answer

    async def read(self, requests: AsyncIterator[bytes]) -> None:
        async for raw in requests:
            await self._window.acquire()
            if await self._servicer.is_decoupled(raw):
                self.replies.start(self._decoupled(raw))
            else:
                self._last = self.replies.start(self._ordered(raw, self._last))

    async def _ordered(self, raw: bytes, before: asyncio.Task[None] | None) -> None:
        try:
            time_remaining = self._context.time_remaining()
            answer = await self._servicer.stream_answer(raw, self._metadata, time_remaining, self._peer)
            if before is not None:
                await asyncio.wait({before})  # answers keep the order of their requests
            self.replies.put(answer)
        finally:
            self._window.release()

    async def _decoupled(self, raw: bytes) -> None:
        try:
            time_remaining = self._context.time_remaining()
            answers = self._servicer.stream_generation(raw, self._metadata, time_remaining, self._peer)
            async for answer in answers:
                self.replies.put(answer)
        finally:
            self._window.release()


def _request_id(raw: bytes) -> str:
    """The id the caller gave its request, to answer an error with ("" if unreadable)."""
    try:
        return wire.read_header(raw).request_id
    except SwitchyardError:
        return ""


def _handler(
    name: str, fn: Callable[..., Any], request_type: type[Message] | None
) -> grpc.RpcMethodHandler[Any, Any]:
    """One method, its errors mapped to statuses here: no interceptor on the request path."""
    behavior = map_errors(fn, f"/{SERVICE}/{name}")
    if request_type is None:
        return grpc.unary_unary_rpc_method_handler(behavior)
    return grpc.unary_unary_rpc_method_handler(
        behavior,
        request_deserializer=request_type.FromString,
        response_serializer=lambda m: m.SerializeToString(),
    )


def add_to_server(servicer: OipServicer, server: grpc.aio.Server) -> None:
    """Registers the OIP front (start it with `map_errors_in_servicers`)."""
    unary: dict[str, tuple[Callable[..., Any], type[Message] | None]] = {
        "ModelInfer": (servicer.model_infer, None),  # bytes in, bytes out
        "ModelMetadata": (servicer.model_metadata, pb.ModelMetadataRequest),
        "ModelConfig": (servicer.model_config, pb.ModelConfigRequest),
        "ModelReady": (servicer.model_ready, pb.ModelReadyRequest),
        "ServerLive": (servicer.server_live, pb.ServerLiveRequest),
        "ServerReady": (servicer.server_ready, pb.ServerReadyRequest),
        "ServerMetadata": (servicer.server_metadata, pb.ServerMetadataRequest),
        "ModelStatistics": (servicer.model_statistics, pb.ModelStatisticsRequest),
    }
    handlers = {name: _handler(name, fn, request_type) for name, (fn, request_type) in unary.items()}
    handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
        map_errors(servicer.model_stream_infer, f"/{SERVICE}/ModelStreamInfer")
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)  # looked up by path, as generated code does
