"""The spool under faults, against a real metering service: a full disk, a poisoned audit.

The full disk is a file-size limit (RLIMIT_FSIZE, 64 bytes) in a subprocess that runs the
router's spool and metering client: every segment write fails part-way, as on a full disk,
until the limit is lifted ("space returns"). Metering itself runs here, unaffected.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from sqlalchemy import select

from services.metering.db import migrate
from services.metering.metering_server import RunningMetering, start_metering
from services.metering.schema import AUDIT, LINES
from services.router.metering_client import MeteringClient
from services.router.spool import Spool
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as pb_grpc
from switchyard.grpcio import ServerOptions
from tests.metering.metering_helpers import T0, event, setup_path
from tests.router.conftest import until

SPOOL_CHILD = r"""
import asyncio, json, resource, signal, sys
from pathlib import Path

from services.router.metering_client import MeteringClient
from services.router.spool import Spool
from tests.metering.metering_helpers import T0, event

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead


def report(stage, spool, ready, folder):
    facts = dict(stage=stage, memory=spool.pending_in_memory, backlog=spool.backlog,
                 failures=spool.stats.write_failures, ready=ready,
                 leftovers=sorted(p.name for p in folder.iterdir() if p.suffix == ".tmp"),
                 sent=spool.stats.sent_events, replayed=spool.stats.replayed_events,
                 dead=spool.stats.dead_events)
    print(json.dumps(facts), flush=True)


async def main():
    address, folder = sys.argv[1], Path(sys.argv[2])
    ready = []

    async def set_ready(serving):
        ready.append(serving)

    spool = Spool(MeteringClient(address, timeout_s=0.5), folder, flush_s=0.05, batch=4, set_ready=set_ready)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))  # the disk is full
    spool.start()
    for i in range(10):
        spool.usage(event(f"full-{i}", T0 + i * 1000, 300))
    while spool.stats.write_failures < 3:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.1)
    report("full", spool, ready, folder)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # space returns
    while spool.pending_in_memory or not spool.backlog:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.1)
    report("spooled", spool, ready, folder)
    await asyncio.to_thread(sys.stdin.readline)  # metering is back
    drained = await spool.drain(20)
    await spool.close()
    report("done" if drained else "stuck", spool, ready, folder)


asyncio.run(main())
"""


def spooled_events(folder: Path) -> int:
    return sum(len(mpb.RecordUsageRequest.FromString(p.read_bytes()).events) for p in folder.glob("*.pb"))


@pytest.fixture
async def down_metering(tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:
    """A ledger with a priced path, and the address of its metering service, now stopped."""
    db = tmp_path / "ledger.db"
    migrate(f"sqlite:///{db}")
    first = await start_metering(f"sqlite:///{db}", ServerOptions(port=0))
    async with grpc.aio.insecure_channel(first.address) as channel:
        await setup_path(pb_grpc.MeteringStub(channel))
    await first.stop(0.2)
    yield f"127.0.0.1:{first.port}", db


async def start_again(address: str, db: Path) -> RunningMetering:
    port = int(address.rsplit(":", 1)[1])
    return await start_metering(f"sqlite:///{db}", ServerOptions(host="127.0.0.1", port=port))


def stored(running: RunningMetering) -> tuple[list[str], list[Any]]:
    keys = running.ledger.tx.read(lambda c: list(c.execute(select(LINES.c.idempotency_key)).scalars()))
    audits = running.ledger.tx.read(lambda c: list(c.execute(select(AUDIT)).all()))
    return keys, audits


async def test_full_disk_under_the_spool_loses_nothing_and_doubles_nothing(
    down_metering: tuple[str, Path], tmp_path: Path
) -> None:
    address, db = down_metering
    folder = tmp_path / "spool"
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        SPOOL_CHILD,
        address,
        str(folder),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert child.stdin is not None and child.stdout is not None

    async def line() -> dict[str, Any]:
        assert child.stdout is not None
        text = await asyncio.wait_for(child.stdout.readline(), 30)
        assert text, f"spool process ended early (code {child.returncode})"
        return dict(json.loads(text))

    running = None
    try:
        full = await line()
        # Every write failed part-way: the batches are back in memory, nothing half-written
        # is left, and the router stopped reporting ready.
        assert full["stage"] == "full" and full["failures"] >= 3
        assert (full["memory"], full["backlog"], full["leftovers"], full["ready"]) == (10, 0, [], [False])
        spooled = await line()
        assert (spooled["memory"], spooled["leftovers"]) == (0, [])
        assert spooled["backlog"] == 3 and spooled["ready"] == [False, True]  # 10 events, 4 per chunk
        running = await start_again(address, db)
        child.stdin.write(b"go\n")
        await child.stdin.drain()
        done = await line()
        assert done["stage"] == "done", done
        assert (done["replayed"], done["dead"], done["backlog"]) == (10, 0, 0)
        keys, _ = stored(running)
        assert sorted(keys) == sorted(f"full-{i}" for i in range(10))  # each once
        assert not (folder / "dead-letter.jsonl").exists()
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()
        if running is not None:
            await running.stop(0.2)


async def test_one_poisoned_audit_does_not_block_usage(
    down_metering: tuple[str, Path], tmp_path: Path
) -> None:
    address, db = down_metering
    folder = tmp_path / "spool"
    client = MeteringClient(address, timeout_s=0.5)
    spool = Spool(client, folder, flush_s=0.05, batch=8)
    spool.start()
    running = None
    try:
        # While metering is down, a poisoned audit (an outcome metering refuses) is spooled
        # first, then usage after it.
        spool.audit(mpb.AppendAuditRequest(action="request.denied", resource="model/x", outcome="maybe"))
        await until(lambda: spool.backlog == 1)
        for i in range(20):
            spool.usage(event(f"after-{i}", T0 + i * 1000, 300))
        spool.audit(mpb.AppendAuditRequest(action="request.denied", resource="model/y", outcome="denied"))
        await until(lambda: spool.backlog == 5)  # the audit, 3 usage chunks (8 + 8 + 4), the audit
        running = await start_again(address, db)
        assert await spool.drain(15)
        keys, audits = stored(running)
        assert sorted(keys) == sorted(f"after-{i}" for i in range(20))
        assert [a.resource for a in audits if a.action == "request.denied"] == ["model/y"]
        dead = [json.loads(x) for x in (folder / "dead-letter.jsonl").read_text().splitlines()]
        assert len(dead) == 1 and dead[0]["event"]["resource"] == "model/x"
        assert "outcome" in dead[0]["reason"]
    finally:
        await spool.close()
        await client.close()
        if running is not None:
            await running.stop(0.2)


async def test_a_spool_near_its_bound_alarms_and_turns_not_ready(tmp_path: Path, caplog: Any) -> None:
    address = "127.0.0.1:9"  # nothing listens: metering is down for this whole test
    ready: list[bool] = []

    async def set_ready(serving: bool) -> None:
        ready.append(serving)

    client = MeteringClient(address, timeout_s=0.3)
    spool = Spool(
        client, tmp_path, flush_s=0.02, batch=5, max_bytes=2000, alarm_fraction=0.5, set_ready=set_ready
    )
    spool.start()
    try:
        with caplog.at_level("ERROR", logger="services.router.spool"):
            for i in range(100):
                spool.usage(event(f"b-{i}", T0 + i * 1000, 300))
            for _ in range(300):
                if spool.stats.write_failures:
                    break
                await asyncio.sleep(0.02)
        # Before the bound: the alarm and NOT_SERVING; at the bound: writes refused, nothing lost.
        assert ready and ready[0] is False
        assert any("ALARM" in r.message and "pressure" in r.message for r in caplog.records)
        await spool.close()  # the final flush cannot write either: it says so, keeps the rest in memory
        assert spool.bytes_on_disk <= 2000
        spooled = await asyncio.to_thread(spooled_events, tmp_path)
        assert spooled + spool.pending_in_memory == 100
    finally:
        await spool.close()  # the final flush cannot write either: it says so and stops
        await client.close()
