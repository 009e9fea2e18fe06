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
import subprocess
import sys
from pathlib import Path

import pytest

from services.metering import audit
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as mgrpc
from tests.security.ledger_attack import (
    ROOT,
    Metering,
    anchored,
    append,
    assert_broken,
    assert_writes_refused,
    read,
    tamper_anchor,
    truncate_tail,
)


async def _two_anchorings(metering: Metering, anchor: Path) -> tuple[mgrpc.MeteringAsyncStub, int, bytes]:
    """Metering started, anchored after 4 rows and again after 8: its stub, the sequence of the
    first anchoring (where an insider cuts the tail back to) and that first anchor's bytes."""
    stub = await metering.start()
    await append(stub, 4)
    assert metering.running is not None
    keep = await anchored(anchor, metering.running)
    older = read(anchor)
    await append(stub, 4)
    await anchored(anchor, metering.running)
    return stub, keep, older


@pytest.mark.parametrize("how", ["deleted", "corrupted", "rolled-back"])
async def test_truncation_fails_closed_across_restarts(
    metering: Metering,
    anchor: Path,
    db_url: str,
    how: str,
) -> None:
    stub, keep, older = await _two_anchorings(metering, anchor)
    assert metering.running is not None
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
    reanchor = [sys.executable, "-m", "clients.cli", "audit", "reanchor", "--db", db_url]
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
    stub, keep, _ = await _two_anchorings(metering, anchor)
    await metering.stop()
    truncate_tail(db_url, keep)
    tamper_anchor(anchor, how, b"")
    for _ in range(2):
        stub = await metering.start()
        await assert_broken(stub)
        await assert_writes_refused(stub)
        await metering.stop()
