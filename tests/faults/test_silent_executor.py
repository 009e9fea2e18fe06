"""An executor whose link goes silent under load is ejected within the bound, requests fail
over, and the ledger equals the answers the clients received (issue 33).

Runs without root: the silent link is a relay (tests/faults/link_proxy.py) in front of one
executor, on its gRPC and frame ports, that stops forwarding while every connection stays
open: no RST, no FIN, exactly what a blackholed host's callers see. The namespace version of
the same fault (a veth taken down) is in test_cluster_faults.py.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from services.executor.executor_config import ExecutorConfig
from services.executor.executor_server import start_executor
from services.metering.schema import JOBS
from services.router.router_server import start_router
from switchyard.grpcio import ServerOptions
from tests.faults.link_proxy import LinkProxy
from tests.router.conftest import prepared_ledger_key, routes_config, start_metering_at
from tests.router.counted_clients import CountedClients

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.slow]

CLIENTS = 6
BOUND_S = 2.0  # the route's default eject_unanswered_s
MARGIN_S = 0.5  # a probe's scheduling on a loaded 2-core host


async def test_silent_executor_is_ejected_within_the_bound_and_traffic_fails_over(tmp_path: Path) -> None:
    healthy = await start_executor(ExecutorConfig(models=("mlp",), max_queue_size=256))
    silent = await start_executor(ExecutorConfig(models=("mlp",), max_queue_size=256))
    assert silent.frames is not None
    proxy = await LinkProxy("127.0.0.2", "127.0.0.1", (silent.port, silent.executor.frames_port)).start()
    metering = await start_metering_at(f"sqlite:///{tmp_path / 'ledger.db'}")
    router = None
    try:
        key = await prepared_ledger_key(metering.address, "svc-silent", team="silent")
        cfg = routes_config(
            {"a": healthy.address, "b": f"127.0.0.2:{silent.port}"},
            {"mlp": {"policy": "least_loaded", "targets": ["a", "b"]}},
            usage_flush_s=0.2,
        )
        router = await start_router(cfg, metering.address, ServerOptions(), tmp_path / "spool")
        state = router.router.pool.states["b"]
        clients = CountedClients(router.address, key, CLIENTS, call_timeout_s=10)
        traffic = asyncio.create_task(clients.run(50_000, 90))
        deadline = time.monotonic() + 30
        while len(clients.answers) < 200 or router.router.pool.transport("b") != "frames":
            assert time.monotonic() < deadline, "no steady traffic over frames to b"
            await asyncio.sleep(0.05)
        proxy.set(blackhole=True)
        at = time.monotonic()
        while state.admitted():
            assert time.monotonic() - at < 10, "b was never ejected"
            await asyncio.sleep(0.01)
        ejected_after = time.monotonic() - at
        answered_before = len(clients.answers)
        await asyncio.sleep(1.5)  # traffic goes on, on a alone
        assert len(clients.answers) > answered_before + 50
        proxy.heal()
        clients.stop.set()
        await traffic
        counted = {rid for _, rid in clients.answers}
        jobs = await _settled_jobs(metering, "silent", counted)
    finally:
        if router is not None:
            await router.stop(0)
        await proxy.close()
        await asyncio.gather(metering.stop(0), healthy.stop(0), silent.stop(0))
    assert ejected_after <= BOUND_S + MARGIN_S, ejected_after
    # at most the requests in flight on b when it went silent fail; the others were never sent there
    assert len(clients.errors) <= CLIENTS, clients.errors
    assert len(counted) == len(clients.answers)
    assert set(jobs) == counted and set(jobs.values()) == {1}, (len(jobs), len(counted))


async def _settled_jobs(metering: object, team: str, answered: set[str]) -> dict[str, int]:
    """The ledger's completed jobs for `team` once every answered one has arrived (bounded)."""
    engine = metering.ledger.engines.write  # type: ignore[attr-defined]
    deadline = time.monotonic() + 20
    while True:
        with engine.connect() as conn:
            rows = conn.execute(
                select(JOBS.c.job_id, func.count())
                .where(JOBS.c.team == team, JOBS.c.arm == "primary", JOBS.c.status == "completed")
                .group_by(JOBS.c.job_id)
            ).all()
        jobs = {str(k): int(n) for k, n in rows}
        if answered <= set(jobs) or time.monotonic() > deadline:
            return jobs
        await asyncio.sleep(0.1)
