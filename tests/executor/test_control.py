"""ExecutorControl on a real executor: Describe, LoadModel phases, ModelStatus, GetLoad, Unload."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
import torch

from services.executor.executor_server import RunningExecutor
from switchyard.gen.switchyard.v1 import executor_pb2 as ctl
from switchyard.gen.switchyard.v1 import executor_pb2_grpc as ctl_grpc
from switchyard.models.registry import ModelRegistry


@pytest_asyncio.fixture(loop_scope="session")
async def control(executor: RunningExecutor) -> AsyncIterator[ctl_grpc.ExecutorControlAsyncStub]:
    async with grpc.aio.insecure_channel(executor.address) as channel:
        yield ctl_grpc.ExecutorControlStub(channel)


async def test_describe_reports_device_versions_and_pricing(
    executor: RunningExecutor, control: ctl_grpc.ExecutorControlAsyncStub
) -> None:
    d = await control.Describe(ctl.DescribeRequest())
    assert d.device.backend == "cpu" and d.device.device_type == "cpu" and d.device.available
    assert d.device.device_count == 1 and d.device.memory_total_bytes > d.device.memory_available_bytes > 0
    assert d.torch_version == torch.__version__ and d.versions["torch"] == torch.__version__
    assert "python" in d.versions
    assert d.resource_class.startswith("cpu-") and d.price_key == f"cpu/{d.resource_class}"
    assert d.host and d.executor_id.endswith(f":{executor.port}")
    assert list(d.modes) == ["eager", "compile"]
    assert {"mlp:1", "tiny-lm:1", "minilm-l6:1", "mlp:perturbed"} <= set(d.registered_models)
    assert {(m.name, m.state) for m in d.models} >= {("mlp", "READY"), ("tiny-lm", "READY")}
    assert d.memory.rss_bytes > 0 and not d.memory.device_reported


async def test_describe_reports_the_process_memory_as_it_grows(
    control: ctl_grpc.ExecutorControlAsyncStub,
) -> None:
    # the executor runs in this process: 64 MiB kept alive here is the executor's growth
    before = (await control.Describe(ctl.DescribeRequest())).memory.rss_bytes
    kept = b"\x01" * (64 << 20)
    after = (await control.Describe(ctl.DescribeRequest())).memory.rss_bytes
    assert after - before >= 60 << 20, (before, after)
    del kept


async def test_load_model_times_each_phase_and_verifies_the_hash(
    control: ctl_grpc.ExecutorControlAsyncStub,
) -> None:
    response = await control.LoadModel(
        ctl.LoadModelRequest(
            model_name="tiny-lm", version="perturbed", batch_buckets=[1, 2], precision="fp64"
        )
    )
    m = response.model
    assert (m.state, m.mode, m.precision, list(m.batch_buckets)) == ("READY", "eager", "fp64", [1, 2])
    assert m.checkpoint_sha256 == ModelRegistry.with_builtins().get("tiny-lm").sha256
    t = m.timings
    assert t.checkpoint_load_s > 0 and t.to_device_s > 0 and t.compile_s > 0
    assert t.total_s == pytest.approx(t.checkpoint_load_s + t.to_device_s + t.compile_s)
    assert m.compatibility.compilations == 0 and m.compatibility.compilations_after_warmup == 0

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await control.LoadModel(ctl.LoadModelRequest(model_name="mlp", checkpoint_sha256="0" * 64))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "but the request expects 000" in (info.value.details() or "")
    for bad, text in (
        (ctl.LoadModelRequest(model_name="mlp", mode="lazy"), "mode 'lazy' is not offered"),
        (ctl.LoadModelRequest(model_name="mlp", precision="int4"), "precision 'int4'"),
        (ctl.LoadModelRequest(model_name="mlp", batch_buckets=[0, 4]), "batch buckets"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await control.LoadModel(bad)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text in (info.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await control.LoadModel(ctl.LoadModelRequest(model_name="gpt-9"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_status_load_and_unload(control: ctl_grpc.ExecutorControlAsyncStub) -> None:
    status = await control.ModelStatus(ctl.ModelStatusRequest(model_name="mlp"))
    assert [(m.name, m.version) for m in status.models] == [("mlp", "1")]
    assert status.models[0].max_batch_size == 8
    load = await control.GetLoad(ctl.GetLoadRequest())
    assert (load.in_flight, load.queue_depth, load.draining) == (0, 0, False)
    await control.LoadModel(ctl.LoadModelRequest(model_name="mlp", version="perturbed", batch_buckets=[1]))
    await control.Unload(ctl.UnloadRequest(model_name="mlp", version="perturbed"))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await control.ModelStatus(ctl.ModelStatusRequest(model_name="mlp", version="perturbed"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "not loaded" in (info.value.details() or "")


async def test_a_model_is_loading_and_not_ready_until_every_bucket_is_warm(
    executor: RunningExecutor, control: ctl_grpc.ExecutorControlAsyncStub
) -> None:
    from switchyard.gen.inference import grpc_service_pb2 as oip
    from switchyard.gen.inference import grpc_service_pb2_grpc as oip_grpc

    async with grpc.aio.insecure_channel(executor.address) as channel:
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        loading = asyncio.ensure_future(
            control.LoadModel(
                ctl.LoadModelRequest(model_name="minilm-l6", version="perturbed", batch_buckets=[1, 2, 4, 8])
            )
        )
        while not executor.executor.loading:  # noqa: ASYNC110  (waits for the load to start)
            await asyncio.sleep(0.005)
        ready = await stub.ModelReady(oip.ModelReadyRequest(name="minilm-l6", version="perturbed"))
        status = await control.ModelStatus(
            ctl.ModelStatusRequest(model_name="minilm-l6", version="perturbed")
        )
        server = await stub.ServerReady(oip.ServerReadyRequest())
        assert (ready.ready, status.models[0].state, server.ready) == (False, "LOADING", False)
        assert (await loading).model.state == "READY"
        assert (await stub.ModelReady(oip.ModelReadyRequest(name="minilm-l6", version="perturbed"))).ready
        await control.Unload(ctl.UnloadRequest(model_name="minilm-l6", version="perturbed"))
        assert (await stub.ServerReady(oip.ServerReadyRequest())).ready
