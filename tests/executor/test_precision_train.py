"""Precision in LoadModel (fp64 golden runs, bf16/fp16) and the Train RPC (loss per step)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
import pytest_asyncio
import torch

from clients.executor_client import build_infer_request, parse_infer_response
from services.executor.executor_server import RunningExecutor
from switchyard.gen.inference import grpc_service_pb2 as oip
from switchyard.gen.inference import grpc_service_pb2_grpc as oip_grpc
from switchyard.gen.switchyard.v1 import executor_pb2 as ctl
from switchyard.gen.switchyard.v1 import executor_pb2_grpc as ctl_grpc
from switchyard.models.registry import ModelRegistry, load_module

SPEC = ModelRegistry.with_builtins().get("mlp", "perturbed")
X = np.random.default_rng(2).standard_normal((2, 64)).astype(np.float32)


@pytest_asyncio.fixture(loop_scope="session")
async def channel(executor: RunningExecutor) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(executor.address) as ch:
        yield ch


# Distance from fp64 a format allows here: its epsilon x sqrt(96) (mlp's residual blocks each
# add rounding) x the outputs' scale (|y| <= ~2): fp16 2^-10, bf16 2^-7.
@pytest.mark.parametrize(
    ("precision", "datatype", "dtype", "tolerance"),
    [
        ("fp64", "FP64", torch.float64, 0.0),
        ("bf16", "BF16", torch.bfloat16, 2**-7 * 10 * 2),
        ("fp16", "FP16", torch.float16, 2**-10 * 10 * 2),
    ],
)
async def test_precision_changes_compute_and_output_datatype(
    channel: grpc.aio.Channel, precision: str, datatype: str, dtype: torch.dtype, tolerance: float
) -> None:
    control = ctl_grpc.ExecutorControlStub(channel)
    stub = oip_grpc.GRPCInferenceServiceStub(channel)
    await control.LoadModel(
        ctl.LoadModelRequest(model_name="mlp", version="perturbed", precision=precision, batch_buckets=[1, 2])
    )
    meta = await stub.ModelMetadata(oip.ModelMetadataRequest(name="mlp", version="perturbed"))
    assert (meta.inputs[0].datatype, meta.outputs[0].datatype) == (datatype, datatype)
    response = await stub.ModelInfer(build_infer_request("mlp", {"x": X}, version="perturbed"))
    assert response.outputs[0].datatype == datatype
    assert response.parameters["precision"].string_param == precision
    got = parse_infer_response(response).outputs["y"]
    with torch.inference_mode():
        module = load_module(SPEC).to(dtype)
        expected = module(torch.from_numpy(X).to(dtype)).double().numpy()
        golden = load_module(SPEC).double()(torch.from_numpy(X).double()).numpy()
    np.testing.assert_array_equal(got.astype(np.float64), expected)  # exactly the in-process run
    assert np.abs(got - golden).max() <= tolerance  # and as far from fp64 as the format allows
    if precision == "fp64":
        # an fp64 model also takes its own datatype
        same = await stub.ModelInfer(
            build_infer_request("mlp", {"x": X.astype(np.float64)}, version="perturbed")
        )
        np.testing.assert_array_equal(parse_infer_response(same).outputs["y"], golden)


async def test_train_returns_a_falling_deterministic_loss_and_leaves_serving_alone(
    channel: grpc.aio.Channel,
) -> None:
    control = ctl_grpc.ExecutorControlStub(channel)
    stub = oip_grpc.GRPCInferenceServiceStub(channel)
    ids = np.random.default_rng(0).integers(0, 512, (1, 16)).astype(np.int64)
    before = parse_infer_response(await stub.ModelInfer(build_infer_request("tiny-lm", {"input_ids": ids})))
    request = ctl.TrainRequest(model_name="tiny-lm", steps=12, lr=0.05, seed=3, batch_size=4)
    first = await control.Train(request)
    second = await control.Train(request)
    assert len(first.loss) == 12 and len(first.step_seconds) == 12 and first.total_s > 0
    assert list(first.loss) == list(second.loss)  # seeded data and weights: reproducible
    assert first.loss[-1] < 0.8 * first.loss[0]  # it learns
    after = parse_infer_response(await stub.ModelInfer(build_infer_request("tiny-lm", {"input_ids": ids})))
    np.testing.assert_array_equal(before.outputs["logits"], after.outputs["logits"])

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await control.Train(ctl.TrainRequest(model_name="tiny-lm", steps=-1))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await control.Train(ctl.TrainRequest(model_name="gpt-9", steps=1))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
