"""What the ledger attacks share: the metering service restarted at will, the insider's moves
(cut the tail, reset the head, tamper with the anchor), and what a fail-closed ledger answers."""

from __future__ import annotations

import asyncio
import json
import time
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
