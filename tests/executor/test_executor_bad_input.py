"""Every bad input gets its docs/architecture.md#errors status and a message that says what to fix; the server
keeps serving (each test ends with a good request on the same server)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
import pytest_asyncio

from clients.executor_client import build_infer_request
from services.executor.executor_config import ExecutorConfig
from services.executor.executor_server import RunningExecutor, start_executor
from switchyard.errors import InvalidArgument
from switchyard.gen.inference import grpc_service_pb2 as oip
from switchyard.gen.inference import grpc_service_pb2_grpc as oip_grpc
from switchyard.gen.switchyard.v1 import executor_pb2 as ctl
from switchyard.gen.switchyard.v1 import executor_pb2_grpc as ctl_grpc

GOOD_X = np.ones((1, 64), np.float32)


@pytest_asyncio.fixture(loop_scope="session")
async def stub(executor: RunningExecutor) -> AsyncIterator[oip_grpc.GRPCInferenceServiceAsyncStub]:
    async with grpc.aio.insecure_channel(executor.address) as channel:
        yield oip_grpc.GRPCInferenceServiceStub(channel)


async def _expect(
    stub: oip_grpc.GRPCInferenceServiceAsyncStub,
    request: oip.ModelInferRequest,
    code: grpc.StatusCode,
    text: str,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ModelInfer(request, timeout=10)
    assert info.value.code() == code, info.value.details()
    assert text in (info.value.details() or "")
    ok = await stub.ModelInfer(build_infer_request("mlp", {"x": GOOD_X}), timeout=10)
    assert ok.outputs[0].shape == [1, 16]  # still serving


def _raw(model: str, name: str, datatype: str, shape: list[int], raw: bytes) -> oip.ModelInferRequest:
    request = oip.ModelInferRequest(model_name=model)
    request.inputs.add(name=name, datatype=datatype, shape=shape)
    request.raw_input_contents.append(raw)
    return request


NOT_FOUND = grpc.StatusCode.NOT_FOUND
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    ("request_", "code", "text"),
    [
        (build_infer_request("nope", {"x": GOOD_X}), NOT_FOUND, "unknown model 'nope'"),
        (build_infer_request("mlp", {"x": GOOD_X}, version="7"), NOT_FOUND, "no version '7'"),
        (build_infer_request("minilm-l6", {"input_ids": np.ones((1, 4), np.int64)}), NOT_FOUND, "not loaded"),
        (build_infer_request("mlp", {"x": GOOD_X.astype(np.int32)}), INVALID, "datatype INT32; send FP32"),
        (build_infer_request("mlp", {"x": GOOD_X.reshape(1, 1, 64)}), INVALID, "rank 3"),
        (build_infer_request("mlp", {"x": np.ones((1, 63), np.float32)}), INVALID, "dimension 1 is wrong"),
        (build_infer_request("mlp", {"x": np.ones((9, 64), np.float32)}), INVALID, "1 to 8 rows"),
        (build_infer_request("tiny-lm", {"input_ids": np.ones((1, 65), np.int64)}), INVALID, "at most 64"),
        (_raw("mlp", "x", "FP32", [1, 64], b"\x00" * 255), INVALID, "needs 256 bytes"),
        (build_infer_request("mlp", {}), INVALID, "missing input 'x'"),
        (build_infer_request("mlp", {"x": GOOD_X, "z": GOOD_X}), INVALID, "unexpected input(s) ['z']"),
    ],
    ids=[
        "model",
        "version",
        "not-loaded",
        "datatype",
        "rank",
        "dims",
        "batch",
        "max-seq",
        "bytes",
        "missing",
        "extra",
    ],
)
async def test_bad_request_status(
    stub: oip_grpc.GRPCInferenceServiceAsyncStub,
    request_: oip.ModelInferRequest,
    code: grpc.StatusCode,
    text: str,
) -> None:
    await _expect(stub, request_, code, text)


async def test_unknown_requested_output(stub: oip_grpc.GRPCInferenceServiceAsyncStub) -> None:
    request = build_infer_request("mlp", {"x": GOOD_X})
    request.outputs.add(name="logits")
    await _expect(stub, request, INVALID, "unknown output(s) ['logits']")


async def test_shared_memory_is_unimplemented(stub: oip_grpc.GRPCInferenceServiceAsyncStub) -> None:
    request = build_infer_request("mlp", {"x": GOOD_X})
    request.inputs[0].parameters["shared_memory_region"].string_param = "region0"
    await _expect(stub, request, grpc.StatusCode.UNIMPLEMENTED, "shared memory")


async def test_over_the_size_limit_is_resource_exhausted() -> None:
    running = await start_executor(
        ExecutorConfig(models=("mlp",), batch_buckets=(1,), max_message_bytes=1 << 20)
    )
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = oip_grpc.GRPCInferenceServiceStub(channel)
            big = _raw("mlp", "x", "FP32", [1, 64], b"\x00" * (2 << 20))
            await _expect(stub, big, grpc.StatusCode.RESOURCE_EXHAUSTED, "")
    finally:
        await running.stop(1)


async def test_a_switch_interval_below_one_microsecond_is_refused_at_start() -> None:
    with pytest.raises(InvalidArgument, match="gil_switch_interval_us is 0; use 1 or more"):
        await start_executor(ExecutorConfig(gil_switch_interval_us=0))


async def _load_slow_queue(address: str, queue_size: int) -> None:
    """Loads mlp:perturbed with a long batching delay so requests sit in the queue."""
    async with grpc.aio.insecure_channel(address) as channel:
        await ctl_grpc.ExecutorControlStub(channel).LoadModel(
            ctl.LoadModelRequest(
                model_name="mlp", version="perturbed", batch_buckets=[1, 8], dynamic_batching=True,
                max_queue_delay_us=400_000, max_queue_size=queue_size,
            )
        )  # fmt: skip


async def test_full_queue_is_resource_exhausted(
    executor: RunningExecutor, stub: oip_grpc.GRPCInferenceServiceAsyncStub
) -> None:
    await _load_slow_queue(executor.address, queue_size=2)
    request = build_infer_request("mlp", {"x": GOOD_X}, version="perturbed")
    calls = [stub.ModelInfer(request, timeout=10) for _ in range(5)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(refused) == 3
    assert all(
        r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in (r.details() or "")
        for r in refused
    )
    served = [r for r in results if isinstance(r, oip.ModelInferResponse)]
    assert [r.parameters["batch_size"].int64_param for r in served] == [2, 2]  # the two queued ran together


async def test_deadline_expiring_in_queue_drops_the_work(
    executor: RunningExecutor, stub: oip_grpc.GRPCInferenceServiceAsyncStub
) -> None:
    await _load_slow_queue(executor.address, queue_size=8)
    model = executor.executor.find("mlp", "perturbed")
    assert model.batcher is not None
    before = model.batcher.counters.executions
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ModelInfer(build_infer_request("mlp", {"x": GOOD_X}, version="perturbed"), timeout=0.1)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.sleep(0.15)  # well before the 400 ms batching delay ends
    assert model.batcher.counters.expired_in_queue == 1  # dropped at its deadline
    assert model.batcher.counters.executions == before  # never computed
    ok = await stub.ModelInfer(build_infer_request("mlp", {"x": GOOD_X}, version="perturbed"), timeout=5)
    assert ok.parameters["queue_us"].int64_param >= 300_000  # waited out the delay alone


async def test_expiry_in_queue_is_the_executors_own_deadline_exceeded(executor: RunningExecutor) -> None:
    """The data plane says DEADLINE_EXCEEDED itself (not only the caller's gRPC deadline)."""
    from services.executor.batching import ExpiredInQueue
    from switchyard.errors import Status

    await _load_slow_queue(executor.address, queue_size=8)
    request = build_infer_request("mlp", {"x": GOOD_X}, version="perturbed")
    with pytest.raises(ExpiredInQueue) as info:
        await executor.plane.infer(request, time_remaining=0.05)
    assert info.value.status is Status.DEADLINE_EXCEEDED and "it was not run" in str(info.value)


async def test_timeout_parameter_drops_queued_work_and_a_stream_survives_errors(
    executor: RunningExecutor,
) -> None:
    """Triton's `timeout` request parameter (microseconds) is a deadline in the queue; on a
    ModelStreamInfer stream each error comes back as "STATUS: why" and the stream goes on
    (the router sends every request on such streams)."""
    await _load_slow_queue(executor.address, queue_size=8)
    model = executor.executor.find("mlp", "perturbed")
    assert model.batcher is not None
    before = model.batcher.counters
    expired, executions = before.expired_in_queue, before.executions
    timed = build_infer_request("mlp", {"x": GOOD_X}, version="perturbed")
    timed.parameters["timeout"].int64_param = 50_000
    unknown = build_infer_request("nope", {"x": GOOD_X})
    good = build_infer_request("mlp", {"x": GOOD_X})
    async with grpc.aio.insecure_channel(executor.address) as channel:
        stream = oip_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=30)
        answers: list[oip.ModelStreamInferResponse] = []
        for request in (timed, unknown, good):
            await stream.write(request)
            answer = await stream.read()
            assert isinstance(answer, oip.ModelStreamInferResponse)
            answers.append(answer)
        await stream.done_writing()
    assert answers[0].error_message.startswith("DEADLINE_EXCEEDED: "), answers[0]
    assert "it was not run" in answers[0].error_message
    assert model.batcher.counters.expired_in_queue == expired + 1
    assert model.batcher.counters.executions == executions  # dropped before compute
    assert answers[1].error_message.startswith("NOT_FOUND: unknown model 'nope'")
    assert answers[2].infer_response.outputs[0].shape == [1, 16]  # the same stream still serves


async def test_non_positive_timeout_parameter_is_invalid(
    stub: oip_grpc.GRPCInferenceServiceAsyncStub,
) -> None:
    request = build_infer_request("mlp", {"x": GOOD_X})
    request.parameters["timeout"].int64_param = 0
    await _expect(stub, request, INVALID, "parameter 'timeout' is 0")
