"""The router's spool on a small disk of its own that fills under load (issue 33 point 3, issue
31 point 7): a real router and real metering, the spool on a tmpfs, real gRPC clients that
count every answer.

When the disk refuses writes, the router refuses new metered requests with RESOURCE_EXHAUSTED
naming the spool, answers nothing it cannot bill, keeps what it accepted (also across a stop
with metering down: the journal holds it for the next start), and serves again once the disk
has room. The ledger then equals the answers the clients received, exactly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import sqlalchemy as sa
from sqlalchemy import func, select

from services.executor.executor_server import RunningExecutor
from services.metering.schema import JOBS
from services.router.router_server import RunningRouter, start_router
from switchyard.gen.inference import grpc_service_pb2_grpc as pbgrpc
from switchyard.grpcio import ServerOptions
from switchyard.net import free_port
from tests.router.conftest import Metering, prepared_ledger_key, routes_config, start_metering_at
from tests.router.counted_clients import CountedClients
from tests.router.small_disk import fill, free_kb, small_disk, unavailable
from tests.router.test_router_faults import _request

WHY = unavailable()
# refused within 10 s of the fill, nothing answered in the 1 s after: the host to itself (tests/conftest.py)
pytestmark = [
    pytest.mark.asyncio(loop_scope="session"),
    pytest.mark.skipif(bool(WHY), reason=WHY or "runs"),
    pytest.mark.alone,
]

DISK_KB = 512
RESERVE_KB = 64
ROUTES = {"mlp": {"policy": "pinned", "targets": ["a"]}}


def _completed(url: str, team: str) -> dict[str, int]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                select(JOBS.c.job_id, func.count())
                .where(JOBS.c.team == team, JOBS.c.arm == "primary", JOBS.c.status == "completed")
                .group_by(JOBS.c.job_id)
            ).all()
    finally:
        engine.dispose()
    return {str(k): int(n) for k, n in rows}


async def _router(address: str, metering: str, spool: Path) -> RunningRouter:
    cfg = routes_config({"a": address}, ROUTES, usage_flush_s=0.1, spool_reserve_kb=RESERVE_KB)
    return await start_router(cfg, metering, ServerOptions(), spool)


async def _until(what: str, check: Callable[[], object], timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)
    return time.monotonic()


async def _fill_until_refused(spool_dir: Path, clients: CountedClients, timeout_s: float) -> Path:
    """Fills the disk and takes back whatever room it gets (the spool deletes journal files
    metering acknowledged), as another writer would, until the router refuses a request; a
    single fill can leave the disk room again a moment later, and the router rightly serves."""
    filler = fill(spool_dir)

    def refused() -> bool:
        if clients.errors:
            return True
        fill(spool_dir)
        return False

    await _until("never refused", refused, timeout_s)
    return filler


async def _refused_details(router: RunningRouter, key: str) -> str:
    async with grpc.aio.insecure_channel(router.address) as channel:
        stub = pbgrpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ModelInfer(_request(), metadata=[("authorization", f"Bearer {key}")], timeout=5)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
    return refused.value.details() or ""


async def test_full_spool_disk_refuses_new_requests_bills_every_answer_and_recovers(
    metering: Metering, executors: list[RunningExecutor], tmp_path: Path
) -> None:
    key, _ = await metering.key("svc-disk-full", "disk-full")
    with small_disk(tmp_path / "spool", DISK_KB) as spool_dir:
        router = await _router(executors[0].address, metering.running.address, spool_dir)
        spool = router.router.spool
        assert spool is not None
        clients = CountedClients(router.address, key, 4, call_timeout_s=5)
        traffic = asyncio.create_task(clients.run(50_000, 120))
        try:
            await clients.until(100, 30)
            filler = await _fill_until_refused(spool_dir, clients, 10)
            details = await _refused_details(router, key)
            assert "usage spool" in details and str(spool_dir) in details, details
            await asyncio.sleep(0.5)  # the requests in flight at the refusal are answered (journaled)
            answered = len(clients.answers)
            await asyncio.sleep(1.0)  # refusing: nothing new is answered, nothing piles up in memory
            assert len(clients.answers) == answered, "answered while the disk had no room"
            assert spool.pending_in_memory <= 8, spool.pending_in_memory
            assert spool.under_pressure  # readiness NOT_SERVING meanwhile
            filler.unlink()  # space returns
            back = len(clients.answers)
            await clients.until(back + 100, 30)
            clients.stop.set()
            await traffic
            assert await spool.drain(20)
            dead = spool.stats.dead_events
        finally:
            clients.stop.set()
            await router.stop(0)
        assert not (spool_dir / "reserve.bin").exists()  # a stop hands its room to the last flush
    answers = set(clients.answered)
    jobs = _completed(metering.url, "disk-full")
    assert {code for _, code in clients.errors} == {"RESOURCE_EXHAUSTED"}, clients.errors[:5]
    assert len(answers) == len(clients.answered) and set(jobs) == answers, (len(jobs), len(answers))
    assert set(jobs.values()) == {1} and dead == 0
    assert spool.stats.refused_requests >= len(clients.errors)


async def test_a_stop_with_the_disk_full_and_metering_down_keeps_what_was_answered(
    executors: list[RunningExecutor], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url, port = f"sqlite:///{tmp_path / 'ledger.db'}", free_port()
    metering = await start_metering_at(url, port)
    key = await prepared_ledger_key(metering.address, "svc-disk-stop", team="disk-stop")
    with small_disk(tmp_path / "spool", DISK_KB) as spool_dir:
        router = await _router(executors[0].address, metering.address, spool_dir)
        spool = router.router.spool
        assert spool is not None
        clients = CountedClients(router.address, key, 3, call_timeout_s=5)
        traffic = asyncio.create_task(clients.run(50_000, 120))
        try:
            await clients.until(50, 30)
            await metering.stop(0)  # usage now goes to segments and the journal only
            await clients.until(len(clients.answers) + 100, 30)
            await _until("nothing spooled", lambda: spool.backlog > 0, 10)
            filler = await _fill_until_refused(spool_dir, clients, 10)
            await asyncio.sleep(0.5)
            held = spool.pending_in_memory
            await asyncio.sleep(0.5)
            assert spool.pending_in_memory <= max(held, 8), (held, spool.pending_in_memory)  # bounded
            clients.stop.set()
            await traffic
        finally:
            clients.stop.set()
            await router.stop(0)  # metering down, disk full: nothing may be lost
        assert free_kb(spool_dir) < 2 * RESERVE_KB
        filler.unlink()
        metering = await start_metering_at(url, port)
        try:
            again = await _router(executors[0].address, metering.address, spool_dir)
            try:
                assert again.router.spool is not None and await again.router.spool.drain(30)
            finally:
                await again.stop(0)
        finally:
            await metering.stop(0)
    left = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stopping with")]
    assert all(", 0 were not written" in m for m in left), left  # what it had is in the journal
    answers = set(clients.answered)
    jobs = _completed(url, "disk-stop")
    assert {code for _, code in clients.errors} <= {"RESOURCE_EXHAUSTED"}, clients.errors[:5]
    assert set(jobs) == answers and set(jobs.values()) == {1}, (len(jobs), len(answers))
