"""The keyed, hash-chained audit trail: append inside the caller's transaction, query, verify.

Each row's hash is an HMAC-SHA256, under a key the database does not hold (auditkey.py), of
its own fields and the previous row's hash; `audit_head` holds the last seq and hash. Appends
lock the head row (FOR UPDATE on PostgreSQL; SQLite write transactions are already
exclusive), so concurrent writers extend one chain. `verify` reads the chain in one snapshot
(REPEATABLE READ on PostgreSQL), so rows appended meanwhile are simply not in it, checks it
against the signed head digest kept outside the database, and names the first problem:

- altered: a row's content no longer matches its HMAC;
- unkeyed: a row carries a plain SHA-256 chain hash (the chain was recomputed without the key);
- inserted: a row that was not written through the service;
- deleted: rows missing in the middle or at the end (the tail);
- truncated: the trail is empty but the head digest says it had rows;
- anchor: the head digest file is unreadable or not signed with this key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, select, update

from services.metering.auditkey import Anchor, AnchorError, read_anchor
from services.metering.records import Actor
from services.metering.schema import AUDIT, HEAD

GENESIS = "0" * 64
KEY_INFO = "switchyard_audit_key"


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
    problem: str = ""  # altered | unkeyed | inserted | deleted | truncated | anchor
    message: str = ""


def _fields(seq: int, at_us: int, actor: Actor, *texts: str) -> bytes:
    """The hashed bytes of a row; `texts`: action, resource, outcome, detail_json, prev_hash."""
    fields = [seq, at_us, actor.principal, actor.source, actor.request_id, actor.trace_id, *texts]
    return json.dumps(fields, separators=(",", ":")).encode()


def row_hash(
    key: bytes,
    seq: int,
    at_us: int,
    actor: Actor,
    action: str,
    resource: str,
    outcome: str,
    detail_json: str,
    prev_hash: str,
) -> str:
    """The row's HMAC-SHA256 under the audit key."""
    body = _fields(seq, at_us, actor, action, resource, outcome, detail_json, prev_hash)
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def unkeyed_hash(rec: AuditRecord) -> str:
    """The plain SHA-256 a forger without the key would compute (how verify names that forgery)."""
    body = _fields(
        rec.seq, rec.at_us, rec.actor, rec.action, rec.resource, rec.outcome, rec.detail_json, rec.prev_hash
    )
    return hashlib.sha256(body).hexdigest()


def bind_key(conn: Connection, key: bytes) -> None:
    """Give this connection's transactions the audit key (the Ledger does so at each write)."""
    conn.info[KEY_INFO] = key


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
    key = conn.info.get(KEY_INFO)
    if not isinstance(key, bytes):
        raise RuntimeError("no audit key bound to this connection (audit.bind_key)")
    head = conn.execute(select(HEAD.c.seq, HEAD.c.hash).where(HEAD.c.id == 1).with_for_update()).one()
    seq, prev = int(head.seq) + 1, str(head.hash)
    if actor.on_behalf_of:
        detail = {**(detail or {}), "on_behalf_of": actor.on_behalf_of}
    detail_json = json.dumps(detail or {}, sort_keys=True, separators=(",", ":"))
    digest = row_hash(key, seq, now_us, actor, action, resource, outcome, detail_json, prev)
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


def head(engine: Engine) -> tuple[int, str]:
    """The committed head (last seq and hash), for the anchor writer."""
    with engine.connect() as conn:
        row = conn.execute(select(HEAD.c.seq, HEAD.c.hash).where(HEAD.c.id == 1)).one()
        return int(row.seq), str(row.hash)


def _broken(checked: int, seq: int, problem: str, message: str) -> Verification:
    return Verification(False, checked, seq, problem, message)


def verify(engine: Engine, key: bytes, anchor_path: Path | None = None) -> Verification:
    """Walk the chain in seq order in one snapshot; the first inconsistency decides the verdict.

    The anchor is read before the snapshot starts, so it never names a row the snapshot
    cannot see yet (an append committed meanwhile is outside both, not a deletion).
    """
    try:
        anchor = read_anchor(anchor_path, key)
    except AnchorError as exc:
        return _broken(0, 0, "anchor", str(exc))
    with engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            conn = conn.execution_options(isolation_level="REPEATABLE READ")
        with conn.begin():
            return _walk(conn, key, anchor)


def _walk(conn: Connection, key: bytes, anchor: Anchor | None) -> Verification:
    checked = 0
    prev: AuditRecord | None = None
    before_prev_hash = GENESIS
    anchored_hash: str | None = None
    head = conn.execute(select(HEAD.c.seq, HEAD.c.hash).where(HEAD.c.id == 1)).one()
    for row in conn.execute(select(AUDIT).order_by(AUDIT.c.seq)).yield_per(2000):
        rec = _record(row)
        checked += 1
        if rec.seq > int(head.seq) and (anchor is None or rec.seq > anchor.seq):
            # Beyond the head the service last wrote: not written through the service.
            return _broken(checked, rec.seq, "inserted", f"row {rec.seq} is beyond the head {head.seq}")
        broken = _row_break(key, rec, prev, before_prev_hash, checked)
        if broken is not None:
            return broken
        if anchor is not None and rec.seq == anchor.seq:
            anchored_hash = rec.hash
        before_prev_hash = prev.hash if prev else GENESIS
        prev = rec
    last_seq, last_hash = (prev.seq, prev.hash) if prev else (0, GENESIS)
    if anchor is not None:
        broken = _anchor_break(checked, last_seq, anchor, anchored_hash)
        if broken is not None:
            return broken
    return _head_break(checked, last_seq, last_hash, int(head.seq), head.hash) or Verification(True, checked)


def _row_break(
    key: bytes, rec: AuditRecord, prev: AuditRecord | None, before_prev_hash: str, checked: int
) -> Verification | None:
    """What is wrong with `rec` given the row before it (None: nothing)."""
    expected_prev = prev.hash if prev else GENESIS
    expected_seq = prev.seq + 1 if prev else 1
    recomputed = row_hash(
        key,
        rec.seq,
        rec.at_us,
        rec.actor,
        rec.action,
        rec.resource,
        rec.outcome,
        rec.detail_json,
        rec.prev_hash,
    )
    if not hmac.compare_digest(recomputed, rec.hash):
        if rec.hash == unkeyed_hash(rec):
            return _broken(checked, rec.seq, "unkeyed", f"row {rec.seq} was rehashed without the audit key")
        return _broken(checked, rec.seq, "altered", f"row {rec.seq} does not match its HMAC")
    if rec.prev_hash != expected_prev:
        if prev is not None and rec.prev_hash == before_prev_hash:
            # This row links past `prev`: `prev` was put in between afterwards.
            return _broken(checked, prev.seq, "inserted", f"row {prev.seq} was put in afterwards")
        if rec.seq != expected_seq:
            gone = f"rows {expected_seq}..{rec.seq - 1} are gone"
            return _broken(checked, expected_seq, "deleted", gone)
        # Self-consistent row whose successor no longer links to it: rewritten and rehashed.
        seq = prev.seq if prev else rec.seq
        return _broken(checked, seq, "altered", f"row {seq} was rewritten")
    if rec.seq != expected_seq:
        # Links fine but seqs jump: rows were removed and the chain re-stitched.
        return _broken(checked, expected_seq, "deleted", f"rows {expected_seq}..{rec.seq - 1} are gone")
    return None


def _anchor_break(
    checked: int, last_seq: int, anchor: Anchor, anchored_hash: str | None
) -> Verification | None:
    """The trail's end against the signed head digest."""
    if anchor.seq > last_seq:
        if last_seq == 0:
            return _broken(
                checked, 1, "truncated", f"the trail is empty; the head digest names {anchor.seq} rows"
            )
        return _broken(
            checked,
            last_seq + 1,
            "deleted",
            f"rows {last_seq + 1}..{anchor.seq} (the tail) are gone; the head digest names them",
        )
    if anchor.seq > 0 and anchored_hash != anchor.hash:
        return _broken(checked, anchor.seq, "altered", f"row {anchor.seq} differs from the head digest")
    return None


def _head_break(
    checked: int, last_seq: int, last_hash: str, head_seq: int, head_hash: str
) -> Verification | None:
    """The trail's end against the head row the service keeps."""
    if head_seq > last_seq:
        if last_seq == 0:
            return _broken(checked, 1, "truncated", f"the trail is empty; its head names {head_seq} rows")
        return _broken(checked, last_seq + 1, "deleted", f"rows {last_seq + 1}..{head_seq} are gone")
    if head_seq < last_seq:
        return _broken(checked, head_seq + 1, "inserted", f"rows after {head_seq} are beyond the head")
    if head_hash != last_hash:
        return _broken(checked, last_seq, "altered", f"the head row does not match row {last_seq}")
    return None
