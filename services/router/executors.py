"""Channels to the executors, the raw-bytes inference call, and health watching.

Each deployment gets one channel with short reconnect back-off (so a restarted executor is
found again within a second or two) and a watcher task that asks `grpc.health.v1` every
`health_interval_s`: a failing executor is ejected with a cooldown that doubles per
consecutive ejection, and re-admitted by the first passing probe after the cooldown. A
call that meets UNAVAILABLE ejects its deployment at once (passive health). The watcher also
asks ExecutorControl.GetLoad, so least-loaded routing has fresh numbers for deployments
that have not answered a request lately.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.router.config import Deployment, Settings
from services.router.policies import DeploymentState
from switchyard.gen.switchyard.v1 import executor_pb2, executor_pb2_grpc

log = logging.getLogger(__name__)

INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    # Find a restarted peer quickly instead of after the default back-off (up to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class ExecutorPool:
    def __init__(self, deployments: Sequence[Deployment], settings: Settings) -> None:
        self._settings = settings
        self.states: dict[str, DeploymentState] = {d.name: DeploymentState(d) for d in deployments}
        self.channels: dict[str, grpc.aio.Channel] = {
            d.name: grpc.aio.insecure_channel(d.address, options=CHANNEL_OPTIONS) for d in deployments
        }
        # Identity (de)serialisers: request and response stay bytes end to end.
        self._infer: dict[str, Any] = {
            name: ch.unary_unary(INFER_METHOD) for name, ch in self.channels.items()
        }
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        for name in self.states:
            self._tasks.append(asyncio.create_task(self._watch(name), name=f"health-{name}"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for channel in self.channels.values():
            await channel.close()

    async def infer(
        self, deployment: str, body: bytes, timeout_s: float, metadata: Sequence[tuple[str, str]]
    ) -> bytes:
        reply: bytes = await self._infer[deployment](body, timeout=timeout_s, metadata=metadata)
        return reply

    def eject(self, deployment: str, reason: str) -> None:
        state = self.states[deployment]
        was_admitted = state.admitted()
        state.eject(reason, self._settings)
        if was_admitted:
            log.warning("ejected deployment %s: %s", deployment, reason)

    async def _probe(self, name: str) -> str:
        """'' when healthy, else why not."""
        channel = self.channels[name]
        timeout = self._settings.health_timeout_s
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
        except grpc.aio.AioRpcError as exc:
            return f"health check failed: {exc.code().name}"
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return f"health status {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
        return ""

    async def _refresh_load(self, name: str, supported: list[bool]) -> None:
        if not supported[0]:
            return
        try:
            load = await executor_pb2_grpc.ExecutorControlStub(self.channels[name]).GetLoad(
                executor_pb2.GetLoadRequest(), timeout=self._settings.health_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                supported[0] = False
            return
        self.states[name].report_load(load.in_flight, load.queue_depth)

    async def _watch(self, name: str) -> None:
        state = self.states[name]
        load_supported = [True]
        while True:
            problem = await self._probe(name)
            if problem:
                self.eject(name, problem)
            else:
                if state.probe_succeeded():
                    log.info("re-admitted deployment %s after its cooldown", name)
                await self._refresh_load(name, load_supported)
            await asyncio.sleep(self._settings.health_interval_s)
