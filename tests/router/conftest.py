"""Real services for the router tests: metering on SQLite, CPU executors, routers on port 0.

Executors load `mlp` once per module (start-up is seconds on a shared CPU); the router under
test is started per test with the config that test needs. Keys, roles, prices and paths are
created through metering's own gRPC API, as an operator would.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from sqlalchemy import func, select

from services.executor.executor_config import ExecutorConfig
from services.executor.executor_server import RunningExecutor, start_executor
from services.metering.metering_server import RunningMetering, start_metering
from services.metering.schema import LINES
from services.router import router_config
from services.router.router_server import RunningRouter, start_router
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as mgrpc
from switchyard.grpcio import ServerOptions
from switchyard.net import free_port
from tests.metering.metering_helpers import price_paths

ROOT = Path(__file__).resolve().parents[2]
PRICE_KEY = "cpu-test"
PATHS = ("cpu-a", "cpu-b", "cpu-c")


async def until(check: Callable[[], bool], timeout_s: float = 15.0) -> None:
    """Returns once `check()` holds (polled every 20 ms); fails after `timeout_s`."""
    for _ in range(int(timeout_s / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached in time")


@dataclass
class Metering:
    running: RunningMetering
    url: str
    stub: mgrpc.MeteringAsyncStub
    channel: grpc.aio.Channel

    async def key(self, name: str, team: str, role: str = "infer", scope: str = "*") -> tuple[str, str]:
        """A new principal with one role; returns (full key, key id)."""
        await self.stub.CreatePrincipal(mpb.CreatePrincipalRequest(name=name, kind="service", team=team))
        if role:
            await self.stub.GrantRole(mpb.RoleRequest(principal=name, role=role, scope=scope))
        created = await self.stub.CreateKey(mpb.CreateKeyRequest(principal=name))
        return created.key, created.key_id

    def usage_counts(self, keys: set[str] | None = None) -> dict[str, int]:
        """idempotency key -> number of ledger lines with that key (read straight from SQL)."""
        with self.running.ledger.engines.write.connect() as conn:
            rows = conn.execute(
                select(LINES.c.idempotency_key, func.count()).group_by(LINES.c.idempotency_key)
            ).all()
        counts = {str(k): int(n) for k, n in rows if k is not None}
        return counts if keys is None else {k: v for k, v in counts.items() if k in keys}


async def prepare_ledger(stub: mgrpc.MeteringAsyncStub) -> None:
    await price_paths(stub, PRICE_KEY, PATHS, resource_class="cpu-test", since_us=0)


async def prepared_ledger_key(
    address: str, name: str, kind: str = "service", team: str = "t", roles: tuple[str, ...] = ("infer",)
) -> str:
    """Prices and paths (prepare_ledger), then a principal holding `roles` on every scope, and
    its API key."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = mgrpc.MeteringStub(channel)
        await prepare_ledger(stub)
        await stub.CreatePrincipal(mpb.CreatePrincipalRequest(name=name, kind=kind, team=team))
        for role in roles:
            await stub.GrantRole(mpb.RoleRequest(principal=name, role=role, scope="*"))
        return (await stub.CreateKey(mpb.CreateKeyRequest(principal=name))).key


async def start_metering_at(url: str, port: int = 0) -> RunningMetering:
    return await start_metering(url, ServerOptions(port=port))


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def metering(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Metering]:
    url = f"sqlite:///{tmp_path_factory.mktemp('ledger') / 'ledger.db'}"
    running = await start_metering_at(url)
    channel = grpc.aio.insecure_channel(running.address)
    stub = mgrpc.MeteringStub(channel)
    await prepare_ledger(stub)
    yield Metering(running, url, stub, channel)
    await channel.close()
    await running.stop(0)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def executors() -> AsyncIterator[list[RunningExecutor]]:
    """Two CPU executors serving mlp; the second also serves the perturbed variant."""
    first = await start_executor(ExecutorConfig(models=("mlp",), max_queue_size=256))
    second = await start_executor(ExecutorConfig(models=("mlp",), max_queue_size=256))
    await second.executor.load_model("mlp", "perturbed", second.executor.default_options())
    yield [first, second]
    await asyncio.gather(first.stop(0), second.stop(0))


def routes_config(
    addresses: dict[str, str], routes: dict[str, Any], **settings: Any
) -> router_config.RouterConfig:
    """A RouterConfig from deployment name -> address (paths cpu-a, cpu-b, ... in order).
    Each config is its own fleet, so route changes made by one test (one module's metering
    serves several) never reach another's routers; routers started from one config share them."""
    settings.setdefault("fleet", f"test-{uuid.uuid4().hex[:12]}")
    deployments = {
        name: {"address": address, "path": PATHS[i], "price_micros_per_hour": 100 * (i + 1)}
        for i, (name, address) in enumerate(addresses.items())
    }
    return router_config.parse({"router": settings, "deployments": deployments, "routes": routes})


def shadow_routes(model: str, control: str) -> dict[str, Any]:
    """Routes pinning `model` to deployment a and mirroring all of it to b's `perturbed`
    version, and `control`: the same model mirrored to b's same weights (it diverges nowhere)."""
    return {
        model: {
            "policy": "pinned",
            "targets": ["a"],
            "shadow": {"share": 1.0, "candidates": [{"deployment": "b", "version": "perturbed"}]},
        },
        control: {
            "policy": "pinned",
            "targets": [{"deployment": "a", "model": model}],
            "shadow": {"share": 1.0, "candidates": [{"deployment": "b", "model": model}]},
        },
    }


RouterFactory = Callable[..., Any]


@pytest_asyncio.fixture(loop_scope="session")
async def make_router(tmp_path: Path) -> AsyncIterator[RouterFactory]:
    started: list[RunningRouter] = []

    async def make(cfg: router_config.RouterConfig, metering_address: str = "") -> RunningRouter:
        running = await start_router(
            cfg, metering_address, ServerOptions(), tmp_path / f"spool{len(started)}"
        )
        started.append(running)
        return running

    yield make
    for running in started:
        await running.stop(0)


CHILD = """
import asyncio, sys
from services.executor.executor_config import ExecutorConfig
from services.executor.executor_server import start_executor

async def main() -> None:
    running = await start_executor(ExecutorConfig(port=int(sys.argv[1]), models=("mlp",), max_queue_size=256))
    print("READY", running.port, flush=True)
    await running.serve_until_signal()

asyncio.run(main())
"""


async def spawn_executor(port: int = 0) -> tuple[asyncio.subprocess.Process, str]:
    """A real executor in its own process (so a test can SIGKILL it); returns (process, address)."""
    port = port or free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, str(port), stdout=asyncio.subprocess.PIPE, env=env, cwd=ROOT
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 120)
    assert line.startswith(b"READY"), line
    return proc, f"127.0.0.1:{port}"
