"""The router registers its deployments' paths with metering from what each executor describes.

At start for every deployment, later for one whose executor came up after the router, and
again on a route change. Real metering, real executors, a real router; the ledger is read
through metering's ListPaths.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from services.executor.executor_config import ExecutorConfig
from services.executor.executor_server import RunningExecutor, start_executor
from services.router.router_config import Policy, Route, Target
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
from switchyard.net import free_port
from tests.router.conftest import Metering, RouterFactory
from tests.router.conftest import routes_config as base_routes_config

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def _paths(metering: Metering) -> dict[str, mpb.PathInfo]:
    reply = await metering.stub.ListPaths(mpb.ListPathsRequest())
    return {p.path: p for p in reply.paths}


async def test_paths_are_registered_at_start_late_and_on_route_change(
    metering: Metering, executors: list[RunningExecutor], make_router: RouterFactory
) -> None:
    live = executors[0]
    late_port = free_port()
    run = uuid.uuid4().hex[:8]
    cfg = base_routes_config(
        {"live": live.address, "late": f"127.0.0.1:{late_port}"},
        {"mlp": {"policy": "failover", "targets": ["live", "late"]}},
    )
    # own path ids, never registered before (the module's fixture registered cpu-a.. by hand)
    deployments = tuple(
        type(d)(d.name, d.address, f"{d.name}-{run}@h", d.price_micros_per_hour) for d in cfg.deployments
    )
    cfg = type(cfg)(cfg.settings, deployments, cfg.routes)
    router = await make_router(cfg, metering.running.address)
    registrar = router.router.table.registrar
    assert registrar is not None
    for _ in range(100):
        if "live" in registrar.registered:
            break
        await asyncio.sleep(0.05)
    described = live.executor.describe()
    path = (await _paths(metering))[f"live-{run}@h"]
    assert (path.backend, path.resource_class, path.price_key, path.host) == (
        "cpu",
        described.resource_class,
        described.price_key,
        described.host,
    )
    assert not path.priced  # no price for the executor's key in this ledger: usage is unpriced
    assert registrar.pending == {"late"} and f"late-{run}@h" not in await _paths(metering)

    # The late executor comes up on its address: retried with back-off, registered.
    late = await start_executor(ExecutorConfig(port=late_port, models=("mlp",)))
    try:
        assert await registrar.wait_registered(30), registrar.pending
        assert f"late-{run}@h" in await _paths(metering)

        # A route change queues the paths it routes to again (idempotent re-registration).
        before = registrar.attempts
        await router.router.table.set_route(Route("mlp", Policy.PINNED, (Target("late"),)))
        assert await registrar.wait_registered(10)
        assert registrar.attempts > before
    finally:
        await late.stop(0)
