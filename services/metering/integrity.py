"""Failing closed on the audit anchor: the checks behind every anchor write, the halt, re-anchoring.

Once a chain has been anchored (its first anchoring appends an `audit.anchor` row, so the
chain itself remembers it), the anchor file must be there, genuine, no older than the last
one this process wrote, and must name a row the chain still holds with the same hash, at or
below the head. Anything else is an integrity failure: the service appends an
`audit.integrity` row (when the database still takes one), counts it in
`switchyard_metering_audit_integrity_failures_total`, logs it, never rewrites the anchor, and
refuses every ledger write (FAILED_PRECONDITION) until an operator, after investigating,
runs `switchyard audit reanchor --db URL --reason TEXT` and restarts the service. `audit
verify` fails on an `audit.integrity` row that no later `audit.reanchor` row answers, so
the failure stays visible across restarts even if the anchor file is put back.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Connection, Engine, select

from services.metering import audit, auditkey
from services.metering.auditkey import Anchor, AnchorError
from services.metering.metering_errors import WrongState
from services.metering.records import Actor
from services.metering.schema import AUDIT, HEAD

log = logging.getLogger(__name__)

ANCHORED = "audit.anchor"  # the chain's first anchoring
FAILED = "audit.integrity"  # an integrity failure the service found
REANCHORED = "audit.reanchor"  # an operator's decision after investigating one
SERVICE = Actor("metering", "audit-anchor")
REANCHOR_HINT = "after investigating, run `switchyard audit reanchor --db URL --reason TEXT` and restart"


class IntegrityHalted(WrongState):
    """Ledger writes are stopped: the audit anchor failed a check (see the message)."""


@dataclass
class Watch:
    """What this process knows of its anchor: the last seq it signed, and a halt reason."""

    anchored_seq: int = 0
    marked: bool = False  # the chain holds its `audit.anchor` row
    witnessed_seq: int = 0  # the newest head the witness countersigned for this process
    halted: str = ""
    failures: int = 0

    def check_writable(self) -> None:
        if self.halted:
            raise IntegrityHalted(f"ledger writes are stopped: {self.halted}; {REANCHOR_HINT}")


def was_anchored(conn: Connection) -> bool:
    row = conn.execute(select(AUDIT.c.seq).where(AUDIT.c.action == ANCHORED).limit(1)).first()
    return row is not None


def unresolved_failure(conn: Connection) -> tuple[int, str] | None:
    """The newest `audit.integrity` row not followed by an `audit.reanchor` row: (seq, reason)."""
    stmt = (
        select(AUDIT.c.seq, AUDIT.c.action, AUDIT.c.detail_json)
        .where(AUDIT.c.action.in_((FAILED, REANCHORED)))
        .order_by(AUDIT.c.seq.desc())
        .limit(1)
    )
    row = conn.execute(stmt).first()
    if row is None or row.action != FAILED:
        return None
    reason = str(json.loads(row.detail_json).get("reason", ""))
    return int(row.seq), reason


def check_anchor(conn: Connection, path: Path, key: bytes, anchored_seq: int) -> Anchor | None:
    """The anchor at `path` if it is consistent with the chain (None: never anchored yet).

    AnchorError names what is wrong: unverifiable, missing after anchoring, rolled back,
    or naming a row the chain no longer holds (the tail was cut). The anchor is read before
    the chain, and the first anchoring writes the file before its `audit.anchor` row, so a
    replica anchoring meanwhile never looks like tampering.
    """
    anchor = auditkey.read_anchor(path, key)
    if anchor is None and (anchored_seq > 0 or was_anchored(conn)):
        anchor = auditkey.read_anchor(path, key)  # another replica's first anchoring, just written
        if anchor is None:
            raise AnchorError(f"anchor file {path} is missing, but this chain was anchored")
    if anchor is None:
        return None
    if anchor.seq < anchored_seq:
        raise AnchorError(
            f"anchor file {path} was rolled back: it names seq {anchor.seq}, "
            f"this service signed {anchored_seq}"
        )
    head_seq = int(conn.execute(select(HEAD.c.seq).where(HEAD.c.id == 1)).scalar_one())
    if anchor.seq > head_seq:
        raise AnchorError(f"the audit head is at seq {head_seq}, below the anchored seq {anchor.seq}")
    row = conn.execute(select(AUDIT.c.hash).where(AUDIT.c.seq == anchor.seq)).first()
    if row is None or row.hash != anchor.hash:
        raise AnchorError(f"audit row {anchor.seq} is gone or differs from the anchor")
    return anchor


def halt(engine: Engine, key: bytes, watch: Watch, reason: str) -> None:
    """Stop ledger writes, and say so in the trail (if the database still takes a row), the log
    and the metric. A halt already in force is not recorded again."""
    if watch.halted:
        return
    watch.halted = reason
    watch.failures += 1
    log.error("AUDIT INTEGRITY FAILURE: %s; ledger writes stopped; %s", reason, REANCHOR_HINT)
    try:
        with engine.begin() as conn:
            audit.bind_key(conn, key)
            if unresolved_failure(conn) is None:
                audit.append(conn, SERVICE, FAILED, "audit/anchor", "failed", _now(), {"reason": reason})
    except Exception as exc:  # the halt holds even when the row cannot be written
        log.error("could not record the audit integrity failure in the trail: %s", exc)


def _now() -> int:
    return time.time_ns() // 1000
