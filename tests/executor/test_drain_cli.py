"""Graceful drain (in process and on SIGTERM) and the CLI: `executor serve`, `infer`, `executor describe`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.executor_client import build_infer_request
from services.executor.executor_config import ExecutorConfig
from services.executor.executor_server import start_executor
from switchyard.gen.inference import grpc_service_pb2 as oip
from switchyard.gen.inference import grpc_service_pb2_grpc as oip_grpc
from switchyard.gen.switchyard.v1 import executor_pb2 as ctl
from switchyard.gen.switchyard.v1 import executor_pb2_grpc as ctl_grpc

ROOT = Path(__file__).resolve().parents[2]
X = np.ones((1, 64), np.float32)
DEADLINE_S = 30.0  # generous: the host may be loaded


async def _inside(channel: grpc.aio.Channel, pending: asyncio.Future[oip.ModelInferResponse]) -> None:
    """Returns once the executor counts `pending` in flight (it arrived and waits in the queue)."""
    control = ctl_grpc.ExecutorControlStub(channel)
    loop = asyncio.get_running_loop()
    until = loop.time() + DEADLINE_S
    while (await control.GetLoad(ctl.GetLoadRequest(), timeout=DEADLINE_S)).in_flight < 1:
        assert not pending.done(), "the request finished before it was seen in flight"
        assert loop.time() < until, f"the request did not arrive within {DEADLINE_S:.0f} s"
        await asyncio.sleep(0.01)


async def test_stop_drains_finishing_in_flight_work_and_refusing_new() -> None:
    running = await start_executor(  # inline 0: a lone request queues rather than runs at once
        ExecutorConfig(
            models=("mlp",), batch_buckets=(1, 2), max_queue_delay_us=2_000_000, inline_compute_us=0
        )
    )
    async with grpc.aio.insecure_channel(running.address) as channel:
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        queued = asyncio.ensure_future(stub.ModelInfer(build_infer_request("mlp", {"x": X}), timeout=10))
        await _inside(channel, queued)  # it waits in the batching queue
        stopping = asyncio.ensure_future(running.stop(grace_s=5))
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        for _ in range(int(DEADLINE_S / 0.01)):  # stop() turns health NOT_SERVING first
            if (await health.Check(health_pb2.HealthCheckRequest(service=""))).status == not_serving:
                break
            await asyncio.sleep(0.01)
        assert not (await stub.ServerReady(oip.ServerReadyRequest())).ready
        status = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert status.status == not_serving
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ModelInfer(build_infer_request("mlp", {"x": X}), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in (info.value.details() or "")
        response = await queued  # the in-flight request still completes
        assert response.outputs[0].shape == [1, 16]
        await stopping


async def _run(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "clients.cli", *args, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode()


@pytest.mark.slow
async def test_cli_serve_infer_describe_and_sigterm(tmp_path: Path) -> None:
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "clients.cli", "executor", "serve", "--port", "0", "--models", "mlp",
        "--buckets", "1", "--inline-compute-us", "0", cwd=ROOT, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert server.stdout is not None
    try:
        address = ""
        while not address:
            line = (await asyncio.wait_for(server.stdout.readline(), 120)).decode()
            assert line, "executor exited before serving"
            if "serving on " in line and line.startswith("executor"):
                address = line.rsplit("serving on ", 1)[1].strip()
        np.save(tmp_path / "x.npy", X)
        code, out = await _run(
            "infer", "--model", "mlp", "--input", str(tmp_path / "x.npy"), "--address", address
        )
        assert code == 0, out
        summary = json.loads(out[out.index("{") :])
        assert summary["outputs"]["y"]["shape"] == [1, 16] and summary["parameters"]["backend"] == "cpu"
        code, out = await _run("executor", "describe", "--address", address)
        assert code == 0, out
        described = json.loads(out[out.index("{") :])
        assert described["device"]["backend"] == "cpu" and described["models"][0]["state"] == "READY"

        async with grpc.aio.insecure_channel(address) as channel:
            # a slow request in flight when SIGTERM arrives must still be answered
            await ctl_grpc.ExecutorControlStub(channel).LoadModel(
                ctl.LoadModelRequest(
                    model_name="mlp",
                    batch_buckets=[1, 2],
                    dynamic_batching=True,
                    max_queue_delay_us=2_000_000,
                )
            )
            stub = oip_grpc.GRPCInferenceServiceStub(channel)
            pending = asyncio.ensure_future(stub.ModelInfer(build_infer_request("mlp", {"x": X}), timeout=10))
            await _inside(channel, pending)  # SIGTERM only once the request is in the executor
            server.send_signal(signal.SIGTERM)
            response = await pending
            assert response.outputs[0].shape == [1, 16]
        assert await asyncio.wait_for(server.wait(), 30) == 0
        rest = (await server.stdout.read()).decode()
        assert "draining" in rest
    finally:
        if server.returncode is None:
            server.kill()
            await server.wait()
