"""The hash-chained audit trail: append inside the caller's transaction, query, verify.

Each row's hash covers its own fields and the previous row's hash, and `audit_head` holds
the last seq and hash. Appends lock the head row (FOR UPDATE on PostgreSQL; SQLite write
transactions are already exclusive), so concurrent writers extend one chain. `verify`
recomputes the chain and names the first row that was altered, inserted or deleted.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, select, update

from services.metering.records import Actor
from services.metering.schema import AUDIT, HEAD

GENESIS = "0" * 64


@dataclass(frozen=True)
class AuditRecord:
    seq: int
    at_us: int
    actor: Actor
    action: str
    resource: str
    outcome: str
    detail_json: str
    prev_hash: str
    hash: str


@dataclass(frozen=True)
class Verification:
    ok: bool
    rows_checked: int
    first_broken_seq: int = 0
    problem: str = ""  # altered | inserted | deleted


def row_hash(
    seq: int,
    at_us: int,
    actor: Actor,
    action: str,
    resource: str,
    outcome: str,
    detail_json: str,
    prev_hash: str,
) -> str:
    fields = [seq, at_us, actor.principal, actor.source, actor.request_id, actor.trace_id]
    fields += [action, resource, outcome, detail_json, prev_hash]
    return hashlib.sha256(json.dumps(fields, separators=(",", ":")).encode()).hexdigest()


def append(
    conn: Connection,
    actor: Actor,
    action: str,
    resource: str,
    outcome: str,
    now_us: int,
    detail: dict[str, Any] | None = None,
) -> AuditRecord:
    """Append one row in the caller's transaction (so it commits or rolls back with the action)."""
    head = conn.execute(select(HEAD.c.seq, HEAD.c.hash).where(HEAD.c.id == 1).with_for_update()).one()
    seq, prev = int(head.seq) + 1, str(head.hash)
    detail_json = json.dumps(detail or {}, sort_keys=True, separators=(",", ":"))
    digest = row_hash(seq, now_us, actor, action, resource, outcome, detail_json, prev)
    conn.execute(
        AUDIT.insert().values(
            seq=seq,
            at_us=now_us,
            principal=actor.principal,
            source=actor.source,
            request_id=actor.request_id,
            trace_id=actor.trace_id,
            action=action,
            resource=resource,
            outcome=outcome,
            detail_json=detail_json,
            prev_hash=prev,
            hash=digest,
        )
    )
    conn.execute(update(HEAD).where(HEAD.c.id == 1).values(seq=seq, hash=digest))
    return AuditRecord(seq, now_us, actor, action, resource, outcome, detail_json, prev, digest)


def _record(row: Any) -> AuditRecord:
    actor = Actor(row.principal, row.source, row.request_id, row.trace_id)
    return AuditRecord(
        int(row.seq),
        int(row.at_us),
        actor,
        row.action,
        row.resource,
        row.outcome,
        row.detail_json,
        row.prev_hash,
        row.hash,
    )


def query(
    engine: Engine,
    action: str = "",
    principal: str = "",
    since_us: int = 0,
    until_us: int = 0,
    limit: int = 100,
) -> list[AuditRecord]:
    stmt = select(AUDIT).order_by(AUDIT.c.seq.desc()).limit(limit)
    if action:
        stmt = stmt.where(AUDIT.c.action == action)
    if principal:
        stmt = stmt.where(AUDIT.c.principal == principal)
    if since_us:
        stmt = stmt.where(AUDIT.c.at_us >= since_us)
    if until_us:
        stmt = stmt.where(AUDIT.c.at_us < until_us)
    with engine.connect() as conn:
        return [_record(r) for r in conn.execute(stmt)]


def verify(engine: Engine) -> Verification:
    """Walk the chain in seq order; the first inconsistency decides the verdict."""
    checked = 0
    prev: AuditRecord | None = None
    before_prev_hash = GENESIS
    with engine.connect() as conn:
        head = conn.execute(select(HEAD.c.seq, HEAD.c.hash).where(HEAD.c.id == 1)).one()
        for row in conn.execute(select(AUDIT).order_by(AUDIT.c.seq)).yield_per(2000):
            rec = _record(row)
            checked += 1
            expected_prev = prev.hash if prev else GENESIS
            expected_seq = prev.seq + 1 if prev else 1
            recomputed = row_hash(
                rec.seq,
                rec.at_us,
                rec.actor,
                rec.action,
                rec.resource,
                rec.outcome,
                rec.detail_json,
                rec.prev_hash,
            )
            if rec.seq > int(head.seq):
                # Beyond the head the service last wrote: not written through the service.
                return Verification(False, checked, rec.seq, "inserted")
            if recomputed != rec.hash:
                return Verification(False, checked, rec.seq, "altered")
            if rec.prev_hash != expected_prev:
                if prev is not None and rec.prev_hash == before_prev_hash:
                    # This row links past `prev`: `prev` was put in between afterwards.
                    return Verification(False, checked, prev.seq, "inserted")
                if rec.seq != expected_seq:
                    return Verification(False, checked, expected_seq, "deleted")
                # Self-consistent row whose successor no longer links to it: rewritten and rehashed.
                return Verification(False, checked, prev.seq if prev else rec.seq, "altered")
            if rec.seq != expected_seq:
                # Links fine but seqs jump: rows were removed and the chain re-stitched.
                return Verification(False, checked, expected_seq, "deleted")
            before_prev_hash = expected_prev
            prev = rec
    last_seq, last_hash = (prev.seq, prev.hash) if prev else (0, GENESIS)
    if int(head.seq) > last_seq:
        return Verification(False, checked, last_seq + 1, "deleted")
    if int(head.seq) < last_seq:
        return Verification(False, checked, int(head.seq) + 1, "inserted")
    if head.hash != last_hash:
        return Verification(False, checked, last_seq, "altered")
    return Verification(True, checked)
