"""An executor reports SERVING only once every configured model is loaded and warm, so a
Kubernetes readiness probe (grpc health) or a router never sends work to a replica that is
still compiling its batch buckets."""

from __future__ import annotations

import asyncio
import socket

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.executor.executor_config import ExecutorConfig
from services.executor.executor_server import start_executor
from switchyard.gen.switchyard.v1 import executor_pb2 as ctl
from switchyard.gen.switchyard.v1 import executor_pb2_grpc as ctl_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_health_turns_serving_only_after_the_models_are_warm() -> None:
    port = _free_port()
    starting = asyncio.ensure_future(start_executor(ExecutorConfig(port=port, models=("mlp", "tiny-lm"))))
    statuses: list[str] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        control = ctl_grpc.ExecutorControlStub(channel)
        while not starting.done():
            try:
                reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
            except grpc.aio.AioRpcError:
                statuses.append("UNREACHABLE")  # not bound yet
            else:
                statuses.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
                if reply.status == SERVING:
                    models = (await control.ModelStatus(ctl.ModelStatusRequest(), timeout=2)).models
                    assert {m.name: m.state for m in models} == {"mlp": "READY", "tiny-lm": "READY"}
            await asyncio.sleep(0.02)
        running = await starting
        try:
            assert "NOT_SERVING" in statuses, statuses  # probed while it was loading
            reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
            assert reply.status == SERVING
        finally:
            await running.stop(0)
