"""Executor fixtures: a real executor (grpc.aio, port 0) with mlp and tiny-lm on CPU eager."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from services.executor.config import ExecutorConfig
from services.executor.server import RunningExecutor, start_executor


@pytest_asyncio.fixture(loop_scope="session", scope="session")
async def executor() -> AsyncIterator[RunningExecutor]:
    running = await start_executor(ExecutorConfig(models=("mlp", "tiny-lm"), batch_buckets=(1, 2, 4, 8)))
    yield running
    await running.stop(1)
