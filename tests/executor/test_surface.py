"""The rest of the executor's surface: reflection, statistics for perf_analyzer, server
metadata, and the cuda backend refusing with its reason where no GPU exists."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc.aio as triton
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from services.executor.device import BACKENDS, BackendUnavailable, probe, select_backend
from services.executor.executor_config import ExecutorConfig
from services.executor.executor_server import RunningExecutor, start_executor


async def test_reflection_lists_the_services(executor: RunningExecutor) -> None:
    def services() -> list[str]:
        with grpc.insecure_channel(executor.address) as channel:
            return list(ProtoReflectionDescriptorDatabase(channel).get_services())

    names = await asyncio.to_thread(services)
    assert {
        "inference.GRPCInferenceService",
        "switchyard.v1.ExecutorControl",
        "grpc.health.v1.Health",
    } <= set(names)


async def test_statistics_and_server_metadata_for_triton_tools(executor: RunningExecutor) -> None:
    client = triton.InferenceServerClient(executor.address)
    try:
        meta = await client.get_server_metadata(as_json=True)
        assert meta["name"] == "switchyard-executor"
        before = (await client.get_inference_statistics("tiny-lm", as_json=True))["model_stats"][0]
        inp = triton.InferInput("input_ids", [1, 8], "INT64")
        inp.set_data_from_numpy(np.arange(8, dtype=np.int64)[None])
        await client.infer("tiny-lm", [inp])
        after = (await client.get_inference_statistics("tiny-lm", as_json=True))["model_stats"][0]
        assert int(after["inference_count"]) == int(before.get("inference_count", 0)) + 1
        assert int(after["execution_count"]) == int(before.get("execution_count", 0)) + 1
        assert int(after["inference_stats"]["compute_infer"]["ns"]) > 0
    finally:
        await client.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the cuda path runs instead")
async def test_cuda_backend_refuses_with_its_reason_without_a_gpu() -> None:
    choice = probe("cuda")
    assert not choice.availability.available and "CUDA" in choice.availability.reason
    with pytest.raises(BackendUnavailable, match="backend 'cuda' is unavailable"):
        select_backend("cuda")
    with pytest.raises(BackendUnavailable):
        await start_executor(ExecutorConfig(backend="cuda", models=("mlp",)))
    assert set(BACKENDS) == {"cpu", "cuda", "xla", "tpu"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU on this machine: cuda path unverified here")
async def test_cuda_executor_matches_cpu_reference() -> None:
    from clients.executor_client import build_infer_request, parse_infer_response
    from switchyard.gen.inference import grpc_service_pb2_grpc as oip_grpc
    from switchyard.models.registry import ModelRegistry, load_module

    running = await start_executor(ExecutorConfig(backend="cuda", models=("mlp",), batch_buckets=(1, 4)))
    try:
        x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
        async with grpc.aio.insecure_channel(running.address) as channel:
            response = await oip_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                build_infer_request("mlp", {"x": x})
            )
        assert response.parameters["backend"].string_param == "cuda"
        with torch.inference_mode():
            expected = load_module(ModelRegistry.with_builtins().get("mlp"))(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(
            parse_infer_response(response).outputs["y"], expected, rtol=1e-4, atol=1e-5
        )
    finally:
        await running.stop(1)
