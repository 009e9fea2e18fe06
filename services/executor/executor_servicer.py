"""inference.GRPCInferenceService on an executor: gRPC's adapter over the data plane.

Each inference RPC converts the call and asks `DataPlane` (`data_plane.py`), which decodes,
bounds, batches, selects outputs, keeps the statistics and owns the errors; statuses come from
the exception tree via switchyard.grpcio. Framed inference (`frame_server.py`) is the other
adapter over the same data plane. What a client asks about the server and its models is
answered from the same executor by `oip_metadata.OipMetadata`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from services.executor.data_plane import DataPlane
from services.executor.oip_metadata import OipMetadata
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
        replies = self.plane.stream(request_iterator, context.time_remaining)
        async with contextlib.aclosing(replies):  # closed as the caller leaves
            async for reply in replies:
                yield reply

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
