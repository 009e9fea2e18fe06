"""Compile mode (inductor) on CPU: per-bucket compilation at load, findings, padding to
buckets, nothing compiled while serving, outputs within tolerance of eager."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from clients.executor_client import build_infer_request, parse_infer_response
from services.executor.executor_server import RunningExecutor
from switchyard.gen.inference import grpc_service_pb2_grpc as oip_grpc
from switchyard.gen.switchyard.v1 import executor_pb2 as ctl
from switchyard.gen.switchyard.v1 import executor_pb2_grpc as ctl_grpc
from switchyard.models.registry import ModelRegistry, load_module
from tests.executor.user_model import Breaking, add_user_model

pytestmark = pytest.mark.slow


async def test_compiled_mlp_pads_to_buckets_and_never_recompiles_while_serving(
    executor: RunningExecutor,
) -> None:
    x = np.random.default_rng(6).standard_normal((3, 64)).astype(np.float32)
    async with grpc.aio.insecure_channel(executor.address) as channel:
        control = ctl_grpc.ExecutorControlStub(channel)
        loaded = (
            await control.LoadModel(
                ctl.LoadModelRequest(
                    model_name="mlp", version="perturbed", mode="compile", batch_buckets=[1, 4]
                )
            )
        ).model
        assert loaded.state == "READY" and loaded.mode == "compile"
        compat = loaded.compatibility
        assert compat.compilations == 2  # one graph per bucket (static shapes)
        assert compat.recompiles == 1  # the second bucket is a shape recompile, reported as such
        assert compat.graph_breaks == 0 and compat.compile_time_s > 0
        assert loaded.timings.compile_s >= compat.compile_time_s
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        response = await stub.ModelInfer(build_infer_request("mlp", {"x": x}, version="perturbed"))
        params = response.parameters
        assert params["mode"].string_param == "compile"
        assert (params["batch_size"].int64_param, params["padded_batch_size"].int64_param) == (3, 4)
        assert params["compilations_after_warmup"].int64_param == 0
        status = (
            await control.ModelStatus(ctl.ModelStatusRequest(model_name="mlp", version="perturbed"))
        ).models[0]
        assert status.compatibility.compilations_after_warmup == 0
    with torch.inference_mode():
        expected = load_module(ModelRegistry.with_builtins().get("mlp", "perturbed"))(
            torch.from_numpy(x)
        ).numpy()
    # inductor fuses and reorders float ops: fp32 rounding differences only
    np.testing.assert_allclose(parse_infer_response(response).outputs["y"], expected, rtol=1e-4, atol=1e-5)


async def test_graph_breaks_are_reported_with_reasons(executor: RunningExecutor, tmp_path: Path) -> None:
    root = executor.executor.registry.root
    add_user_model(root, "breaking", "tests.executor.user_model:build_breaking", Breaking())
    async with grpc.aio.insecure_channel(executor.address) as channel:
        loaded = (
            await ctl_grpc.ExecutorControlStub(channel).LoadModel(
                ctl.LoadModelRequest(model_name="breaking", mode="compile", batch_buckets=[2])
            )
        ).model
    assert loaded.compatibility.graph_breaks >= 1
    assert loaded.compatibility.graph_break_reasons
    assert loaded.compatibility.compilations >= 2  # the graph is split in two
