"""An insider truncates the audit tail and deals with the anchor; metering must fail closed.

The insider can write the database (drops the append-only triggers, deletes the newest rows,
resets `audit_head` to match) and the anchor's folder (deletes the anchor, corrupts it, or
puts back an older copy). Against the real metering service on SQLite and PostgreSQL, with
the service restarted between: `VerifyAudit` must fail every time, metering must never
re-sign the tampered head, and it must refuse ledger writes until the operator re-anchors
(`switchyard audit reanchor`).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from sqlalchemy import create_engine, text

from services.metering import audit
from services.metering.db import resolve_url
from services.metering.metering_server import RunningMetering, start_metering
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as mgrpc
from switchyard.grpcio import ServerOptions
from tests.metering.test_integrity import drop_guards, plain_sql, set_head

KEY = "a" * 48
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def anchor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "anchor"
    folder.mkdir(mode=0o700)
    path = folder / "audit-head.json"
    monkeypatch.setenv("SWITCHYARD_AUDIT_KEY", KEY)
    monkeypatch.setenv("SWITCHYARD_AUDIT_ANCHOR", str(path))
    monkeypatch.setenv("SWITCHYARD_AUDIT_ANCHOR_S", "0.1")
    return path


class Metering:
    """The metering service, stopped and started again as an operator (or a crash) would."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.running: RunningMetering | None = None
        self.channel: grpc.aio.Channel | None = None

    async def start(self) -> mgrpc.MeteringAsyncStub:
        self.running = await start_metering(self.url, ServerOptions(port=0))
        self.channel = grpc.aio.insecure_channel(self.running.address)
        return mgrpc.MeteringStub(self.channel)

    async def stop(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        if self.running is not None:
            await self.running.stop(0.5)
        self.running = self.channel = None


@pytest.fixture
async def metering(db_url: str, anchor: Path) -> AsyncIterator[Metering]:
    svc = Metering(db_url)
    try:
        yield svc
    finally:
        await svc.stop()


async def append(stub: mgrpc.MeteringAsyncStub, n: int) -> None:
    for i in range(n):
        req = mpb.AppendAuditRequest(action="test.action", resource=f"thing/{i}", outcome="ok")
        await stub.AppendAudit(req)


def read(path: Path) -> bytes:
    """The file's bytes, b"" when it is gone (tests read small files; no need for a thread)."""
    return path.read_bytes() if path.exists() else b""


async def anchored(path: Path, running: RunningMetering, timeout_s: float = 5.0) -> int:
    """Wait until the anchor names the head the service last wrote; its seq."""
    deadline = time.monotonic() + timeout_s
    while True:
        seq = audit.head(running.ledger.engines.read)[0]
        if read(path) and json.loads(read(path))["seq"] == seq:
            return seq
        assert time.monotonic() < deadline, "the service never anchored its head"
        await asyncio.sleep(0.05)


def truncate_tail(url: str, keep: int) -> None:
    """Delete every row after `keep` and put the head row back to match, as a DBA would."""
    engine = create_engine(resolve_url(url))
    try:
        with engine.connect() as conn:
            kept = conn.execute(text(f"SELECT hash FROM audit_log WHERE seq = {keep}")).scalar_one()
    finally:
        engine.dispose()
    drop_guards(url)
    plain_sql(url, f"DELETE FROM audit_log WHERE seq > {keep}")
    set_head(url, keep, str(kept))


def tamper_anchor(path: Path, how: str, older: bytes) -> None:
    if how == "deleted":
        path.unlink()
    elif how == "corrupted":
        body = json.loads(path.read_text()) | {"seq": 1}
        path.write_text(json.dumps(body))  # its MAC no longer matches
    else:
        path.write_bytes(older)  # the older, genuinely signed copy


async def assert_broken(stub: mgrpc.MeteringAsyncStub) -> mpb.VerifyAuditResponse:
    verdict = await stub.VerifyAudit(mpb.VerifyAuditRequest())
    assert not verdict.ok, "audit verify accepted a truncated trail"
    assert verdict.problem in ("anchor", "deleted"), verdict
    return verdict


async def assert_writes_refused(stub: mgrpc.MeteringAsyncStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await append(stub, 1)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "audit reanchor" in (err.value.details() or "")


@pytest.mark.parametrize("how", ["deleted", "corrupted", "rolled-back"])
async def test_truncation_fails_closed_across_restarts(
    metering: Metering,
    anchor: Path,
    db_url: str,
    how: str,
) -> None:
    stub = await metering.start()
    await append(stub, 4)
    assert metering.running is not None
    keep = await anchored(anchor, metering.running)
    older = read(anchor)
    await append(stub, 4)
    await anchored(anchor, metering.running)
    # The insider cuts the tail while the service runs, then deals with the anchor.
    truncate_tail(db_url, keep)
    tamper_anchor(anchor, how, older)
    tampered = read(anchor)
    await asyncio.sleep(0.5)  # several anchor rounds: none may re-sign the tampered head
    await assert_broken(stub)
    await assert_writes_refused(stub)
    for _ in range(2):  # restarted (by the insider, or by a crash): still failing, still halted
        await metering.stop()
        stub = await metering.start()
        await asyncio.sleep(0.3)
        await assert_broken(stub)
        await assert_writes_refused(stub)
        assert read(anchor) == tampered
    rows = audit.query(metering.running.ledger.engines.read, action="audit.integrity", limit=10)
    assert len(rows) == 1 and rows[0].outcome == "failed", rows

    # The operator investigates, then re-anchors the chain as it is and restarts metering.
    await metering.stop()
    reanchor = [sys.executable, "-m", "switchyard", "audit", "reanchor", "--db", db_url]
    done = await asyncio.to_thread(
        subprocess.run, [*reanchor, "--reason", "tail cut"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    stub = await metering.start()
    assert (await stub.VerifyAudit(mpb.VerifyAuditRequest())).ok
    await append(stub, 1)


@pytest.mark.parametrize("how", ["deleted", "corrupted"])
async def test_truncation_while_stopped_is_caught_at_start(
    metering: Metering,
    anchor: Path,
    db_url: str,
    how: str,
) -> None:
    stub = await metering.start()
    await append(stub, 4)
    assert metering.running is not None
    keep = await anchored(anchor, metering.running)
    await append(stub, 4)
    await anchored(anchor, metering.running)
    await metering.stop()
    truncate_tail(db_url, keep)
    tamper_anchor(anchor, how, b"")
    for _ in range(2):
        stub = await metering.start()
        await assert_broken(stub)
        await assert_writes_refused(stub)
        await metering.stop()
