"""inference.GRPCInferenceService on an executor: gRPC's adapter over the data plane.

Each inference RPC converts the call and asks `DataPlane` (`data_plane.py`), which decodes,
bounds, batches, selects outputs, keeps the statistics and owns the errors; ModelStreamInfer
runs its stream here, as the frame server runs a connection, a generation decoupled beside
the stream's other requests (`generation_calls.GenerationCalls.stream`); statuses come from
the exception tree via switchyard.grpcio. Framed inference (`frame_server.py`) is the other
adapter over the same data plane. What a client asks about the server and its models is
answered from the same executor by `oip_metadata.OipMetadata`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from services.executor.data_plane import DataPlane
from services.executor.generation import generation_oip as gen_oip
from services.executor.oip_metadata import OipMetadata
from services.streams import StreamReplies
from switchyard.gen.inference import grpc_service_pb2 as pb
from switchyard.gen.inference import grpc_service_pb2_grpc as pb_grpc
from switchyard.grpcio import ServicerContext


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane
        self.metadata = OipMetadata(plane.executor)

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: ServicerContext
    ) -> pb.ModelInferResponse:
        return await self.plane.infer(request, context.time_remaining(), context.invocation_metadata)

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: ServicerContext
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """A stream's requests, each answered in order (`DataPlane.answer`). A generation (a causal
        LM's request) is decoupled: it runs beside the stream's other requests, and its responses
        are built as the stream's writer comes to them, each with the tokens that came since
        the last (`generation_oip.StreamedResponses`)."""
        stream: StreamReplies[pb.ModelStreamInferResponse | gen_oip.StreamedResponses] = StreamReplies()
        plane, generations = self.plane, self.plane.generations

        async def read() -> None:
            async for request in request_iterator:
                model = generations.decoupled(request)
                if model is None:
                    stream.put(await plane.answer(request, context.time_remaining()))
                    continue
                # a caller that leaves cancels it: the generation's slot is freed
                stream.start(generations.stream(model, request, stream.out, context.time_remaining()))

        async with contextlib.aclosing(stream.replies(read)) as replies:  # closed as the caller leaves
            async for reply in replies:
                if not isinstance(reply, gen_oip.StreamedResponses):
                    yield reply
                elif (message := reply.take()) is not None:
                    yield message

    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: ServicerContext
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: ServicerContext
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.metadata.ready())

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: ServicerContext
    ) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=self.metadata.model_ready(request.name, request.version))

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: ServicerContext
    ) -> pb.ServerMetadataResponse:
        return self.metadata.server_metadata()

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: ServicerContext
    ) -> pb.ModelMetadataResponse:
        return self.metadata.model_metadata(request.name, request.version)

    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: ServicerContext
    ) -> pb.ModelConfigResponse:
        return pb.ModelConfigResponse(config=self.metadata.model_config(request.name, request.version))

    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: ServicerContext
    ) -> pb.ModelStatisticsResponse:
        return self.metadata.model_statistics(request.name, request.version)
