"""Executor fixtures: a real executor (grpc.aio, port 0) with mlp and tiny-lm on CPU eager,
loading from its own model repository (the built-ins, plus what tests add to it); factories
from the `tests` package are allowed, as an operator would allow a team's package."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from services.executor.executor_config import ExecutorConfig
from services.executor.executor_server import RunningExecutor, start_executor
from switchyard.models.repository import seed_builtins


@pytest_asyncio.fixture(loop_scope="session", scope="session")
async def executor(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunningExecutor]:
    repository = tmp_path_factory.mktemp("models")
    seed_builtins(repository)
    config = ExecutorConfig(
        models=("mlp", "tiny-lm"),
        batch_buckets=(1, 2, 4, 8),
        model_repository=str(repository),
        allowed_factories=("tests",),
    )
    running = await start_executor(config)
    yield running
    await running.stop(1)
