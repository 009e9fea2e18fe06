"""Framed inference (services.frames) against a real executor: the port Describe reports, the
same answers as gRPC, errors in the reply, many requests in flight on one connection, limits."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from services import frames
from services.executor.executor_server import RunningExecutor
from services.executor.frame_server import FrameServer
from switchyard import net, oip_params
from switchyard.gen.inference import grpc_service_pb2 as pb
from switchyard.gen.inference import grpc_service_pb2_grpc as pbgrpc
from switchyard.gen.switchyard.v1 import executor_pb2, executor_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="session")


def _request(rows: int, request_id: str = "", model: str = "mlp") -> pb.ModelInferRequest:
    x = np.random.default_rng(rows).standard_normal((rows, 64)).astype(np.float32)
    req = pb.ModelInferRequest(model_name=model, id=request_id)
    req.parameters[oip_params.STATS].bool_param = True  # as the router asks, for load and timings
    req.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    req.raw_input_contents.append(x.tobytes())
    return req


async def _send(channel: frames.FrameChannel, request: pb.ModelInferRequest) -> pb.ModelStreamInferResponse:
    reply = await channel.request([request.SerializeToString()], 10.0)
    return pb.ModelStreamInferResponse.FromString(reply)


async def _connect(port: int, limit: int = net.MAX_MESSAGE_BYTES) -> frames.FrameChannel:
    return await frames.FrameChannel.connect("127.0.0.1", port, limit, 5.0)


async def test_describe_reports_the_frame_port_and_answers_equal_grpc(executor: RunningExecutor) -> None:
    async with grpc.aio.insecure_channel(executor.address) as grpc_channel:
        described = await executor_pb2_grpc.ExecutorControlStub(grpc_channel).Describe(
            executor_pb2.DescribeRequest()
        )
        assert executor.frames is not None and described.frames_port == executor.frames.port > 0
        direct = await pbgrpc.GRPCInferenceServiceStub(grpc_channel).ModelInfer(_request(3, "r1"))
    channel = await _connect(described.frames_port)
    try:
        reply = await _send(channel, _request(3, "r1"))
    finally:
        channel.close()
    assert not reply.error_message
    framed = reply.infer_response
    assert framed.id == "r1" and framed.model_name == "mlp"
    assert [(o.name, list(o.shape)) for o in framed.outputs] == [
        (o.name, list(o.shape)) for o in direct.outputs
    ]
    assert framed.raw_output_contents == direct.raw_output_contents  # same model, same bytes
    assert framed.parameters[oip_params.COMPUTE_US].int64_param > 0


async def test_errors_come_back_in_the_reply_and_the_connection_goes_on(executor: RunningExecutor) -> None:
    assert executor.frames is not None
    channel = await _connect(executor.frames.port)
    try:
        unknown = await _send(channel, _request(1, model="no-such-model"))
        assert unknown.error_message.startswith("NOT_FOUND: ") and "no-such-model" in unknown.error_message
        garbage = pb.ModelStreamInferResponse.FromString(await channel.request([b"\xff\xff\xff"], 10.0))
        assert garbage.error_message.startswith("INVALID_ARGUMENT: not a ModelInferRequest")
        expired = _request(1)
        expired.parameters[oip_params.TIMEOUT].int64_param = -5
        bad = await _send(channel, expired)
        assert bad.error_message.startswith("INVALID_ARGUMENT: parameter 'timeout'")
        assert not (await _send(channel, _request(2))).error_message  # still serving
    finally:
        channel.close()


async def test_many_requests_in_flight_on_one_connection_each_get_their_own_answer(
    executor: RunningExecutor,
) -> None:
    assert executor.frames is not None
    channel = await _connect(executor.frames.port)
    try:
        requests = [_request(1 + i % 4, f"req-{i}") for i in range(48)]
        replies = await asyncio.gather(*(_send(channel, r) for r in requests))
    finally:
        channel.close()
    for request, reply in zip(requests, replies, strict=True):
        assert reply.infer_response.id == request.id
        assert list(reply.infer_response.outputs[0].shape) == [request.inputs[0].shape[0], 16]
    batched = [r.infer_response.parameters[oip_params.BATCH_SIZE].int64_param for r in replies]
    assert max(batched) > 1  # they were in flight together, so the executor batched them


async def test_an_oversized_request_is_refused_and_the_connection_goes_on(executor: RunningExecutor) -> None:
    small = FrameServer(executor.plane, limit=4096)
    port = await small.start("127.0.0.1", 0)
    channel = await _connect(port)
    try:
        big = await _send(channel, _request(32))  # 8 KiB of input
        assert big.error_message == "RESOURCE_EXHAUSTED: request exceeds 4096 bytes"
        assert not (await _send(channel, _request(1))).error_message
    finally:
        channel.close()
        await small.close()


async def test_closing_the_server_fails_requests_in_flight_and_refuses_new_ones(
    executor: RunningExecutor,
) -> None:
    server = FrameServer(executor.plane, limit=1 << 20)
    port = await server.start("127.0.0.1", 0)
    channel = await _connect(port)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(frames.header(0, 1, 9))  # not a kind a client sends: not our protocol
        assert await asyncio.wait_for(reader.read(), 5) == b""  # the executor hung up
        assert not (await _send(channel, _request(1))).error_message
        await server.close()
        with pytest.raises(frames.FrameClosed):
            await _send(channel, _request(1))
        assert not channel.is_open
        with pytest.raises(OSError):
            await _connect(port)
    finally:
        writer.close()
        channel.close()
