"""Compile mode (inductor) on CPU: per-bucket compilation at load, findings, padding to
buckets, nothing compiled while serving, outputs within tolerance of eager."""

from __future__ import annotations

import asyncio
import dataclasses
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


async def test_a_shape_that_would_compile_goes_to_the_device_thread_not_inline(
    executor: RunningExecutor,
) -> None:
    """A lone request on a quiet executor computes inline on the event loop, but not one whose
    shape was never run: with padding on (compile mode here, every XLA model) it compiles first,
    seconds that would hold the loop, so health checks and other calls would go unanswered."""
    runtime = executor.executor
    config = runtime.config
    # the inline limit is compared with warm-up timings; a loaded host must not decide the test
    runtime.config = dataclasses.replace(config, inline_compute_us=10_000_000)
    try:
        async with grpc.aio.insecure_channel(executor.address) as channel:
            control = ctl_grpc.ExecutorControlStub(channel)
            request = ctl.LoadModelRequest(model_name="tiny-lm", mode="compile", batch_buckets=[1])
            assert (await control.LoadModel(request)).model.state == "READY"  # warmed at seq 32
            stub = oip_grpc.GRPCInferenceServiceStub(channel)
            counters = runtime.find("tiny-lm", "").batcher.counters  # type: ignore[union-attr]
            ids = np.random.default_rng(2).integers(0, 256, (1, 12)).astype(np.int64)
            ran: list[tuple[int, int]] = []
            for _ in range(2):
                await asyncio.sleep(0.01)  # quiet
                before = counters.ran_inline
                reply = await stub.ModelInfer(build_infer_request("tiny-lm", {"input_ids": ids}))
                ran.append(
                    (counters.ran_inline - before, reply.parameters["compilations_after_warmup"].int64_param)
                )
        # seq 12 compiled on the device thread; once compiled, the same shape may run inline
        assert ran == [(0, 1), (1, 1)], ran
    finally:
        runtime.config = config
        await runtime.load_model("tiny-lm", "", runtime.default_options("tiny-lm"))
