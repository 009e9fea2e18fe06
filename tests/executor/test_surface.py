"""The rest of the executor's surface: reflection, statistics for perf_analyzer, server
metadata, and the cuda backend refusing with its reason where no GPU exists (where one does,
tests/executor/test_cuda.py runs the path)."""

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
