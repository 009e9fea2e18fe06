"""The router's active health checks against a real gRPC server whose health answers are scripted.

A probe that times out (a busy executor: a long compile, a big batch) ejects only after
`health_timeouts_to_eject` in a row, and a passing probe resets the count; a definite failure
(NOT_SERVING, a refused connection) ejects at once. The server runs on this test's event loop,
so each Check records whether the pool still admitted the deployment when it arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.router.executor_pool import ExecutorPool
from services.router.router_config import Deployment, Settings
from switchyard.grpcio import ServicerContext

SLOW = 1.5  # well past the probe timeout below
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SETTINGS = Settings(
    health_interval_s=0.05,
    health_timeout_s=0.5,  # a fast answer on a loaded host stays well within it
    health_timeouts_to_eject=3,
    eject_base_s=0.1,
    executor_transport="grpc",  # the scripted server offers no frames
)


@dataclass
class ScriptedHealth(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """Answers the n-th Check after script[n] = (delay, status); past the script, at once, SERVING."""

    script: list[tuple[float, int]]
    admitted_at_call: list[bool] = field(default_factory=list)
    pool: ExecutorPool | None = None

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        n = len(self.admitted_at_call)
        self.admitted_at_call.append(self.pool is None or self.pool.states["x"].admitted())
        delay, status = self.script[n] if n < len(self.script) else (0.0, SERVING)
        await asyncio.sleep(delay)
        return health_pb2.HealthCheckResponse(status=status)


@dataclass
class Probed:
    server: grpc.aio.Server
    health: ScriptedHealth
    pool: ExecutorPool

    async def calls(self, n: int) -> list[bool]:
        """Waits until the server has had `n` probes; whether the pool admitted at each."""
        async with asyncio.timeout(60):
            while len(self.health.admitted_at_call) < n:  # noqa: ASYNC110  (the server's calls)
                await asyncio.sleep(0.01)
        return self.health.admitted_at_call[:n]


@contextlib.asynccontextmanager
async def _probed(script: list[tuple[float, int]]) -> AsyncIterator[Probed]:
    health = ScriptedHealth(script)
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pool = ExecutorPool([Deployment("x", f"127.0.0.1:{port}", "cpu-x")], SETTINGS)
    health.pool = pool
    try:
        await pool.start()
        yield Probed(server, health, pool)
    finally:
        await pool.close()
        await server.stop(0)


def _timed_out(n: int) -> list[tuple[float, int]]:
    return [(SLOW, SERVING)] * n


async def test_two_timed_out_probes_do_not_eject() -> None:
    # the first probe is start()'s; then two late answers, then prompt ones
    async with _probed([(0.0, SERVING), *_timed_out(2)]) as probed:
        assert await probed.calls(5) == [True] * 5
        assert probed.pool.states["x"].admitted() and probed.pool.states["x"].probe_timeouts == 0


async def test_three_timed_out_probes_in_a_row_eject_with_the_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="services.router.executor_pool")
    async with _probed([(0.0, SERVING), *_timed_out(5)]) as probed:
        admitted = await probed.calls(5)
        assert admitted == [True, True, True, True, False]  # out after the third late answer
        state = probed.pool.states["x"]
        assert state.last_error == "health check failed: DEADLINE_EXCEEDED (3 probes in a row)"
    messages = [r.getMessage() for r in caplog.records]
    assert "deployment x: health check failed: DEADLINE_EXCEEDED, 2 of 3 in a row" in messages
    assert "ejected deployment x: health check failed: DEADLINE_EXCEEDED (3 probes in a row)" in messages


async def test_a_passing_probe_resets_the_count() -> None:
    script = [(0.0, SERVING), *_timed_out(2), (0.0, SERVING), *_timed_out(2), (0.0, SERVING)]
    async with _probed(script) as probed:
        assert await probed.calls(len(script) + 1) == [True] * (len(script) + 1)


async def test_not_serving_ejects_at_once() -> None:
    async with _probed([(0.0, SERVING), (0.0, NOT_SERVING)]) as probed:
        assert await probed.calls(3) == [True, True, False]
        assert probed.pool.states["x"].last_error == "health status NOT_SERVING"


async def test_a_refused_connection_ejects_at_once() -> None:
    async with _probed([]) as probed:
        state = probed.pool.states["x"]
        await probed.calls(2)
        await probed.server.stop(0)  # nothing listens on the port any more: connections are refused
        async with asyncio.timeout(SETTINGS.health_timeout_s * 2):  # one probe, not three timeouts
            while state.admitted():  # noqa: ASYNC110  (the pool's watcher ejects)
                await asyncio.sleep(0.01)
        assert state.last_error == "health check failed: UNAVAILABLE" and state.probe_timeouts == 0


def test_health_timeouts_to_eject_must_be_at_least_one() -> None:
    from services.router import router_config
    from switchyard.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="health_timeouts_to_eject must be >= 1"):
        router_config.parse({"router": {"health_timeouts_to_eject": 0}})
