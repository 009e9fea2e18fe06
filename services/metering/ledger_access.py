"""The ledger's access and audit operations: principals, API keys, role bindings, authentication,
and the audit trail (append, query, verify, the signed head digest). Each write is one
transaction with its audit row, as in services/metering/ledger.py.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from sqlalchemy import Connection

from services.metering import access, audit, auditkey, integrity, reports, rowmac, witness_client
from services.metering.auditkey import AnchorError
from services.metering.db import Engines
from services.metering.metering_errors import AuthFailed
from services.metering.records import Actor

T = TypeVar("T")


_KEY_ID = re.compile(r"sk_[0-9a-f]{16}")


def audited_key_id(key: str) -> str:
    """What an audit row may name of a refused key: its id when it has switchyard's form
    (`sk_<16 hex>.<secret>`), else a short hash, so no part of a mistaken secret (an OpenAI
    `sk-proj-...` key, say) is ever stored."""
    key_id, dot, _ = key.partition(".")
    if dot and _KEY_ID.fullmatch(key_id):
        return key_id
    return "malformed:" + hashlib.sha256(key.encode()).hexdigest()[:12]


class Transactions(Protocol):
    """What the access operations need of the Ledger they are mixed into."""

    engines: Engines
    clock: Callable[[], int]
    audit_key: bytes
    anchor_path: Path | None
    watch: integrity.Watch
    witness: witness_client.WitnessClient | None

    def write(self: Transactions, fn: Callable[[Connection, int], T]) -> T: ...

    def read(self: Transactions, fn: Callable[[Connection], T]) -> T: ...

    def append_audit(
        self: Transactions, actor: Actor, action: str, resource: str, outcome: str, detail: dict[str, Any]
    ) -> audit.AuditRecord: ...

    def _witness(self: Transactions, seq: int, digest: str) -> None: ...

    def _witness_break(self: Transactions) -> str: ...


class LedgerAccess:
    """Mixed into Ledger, whose transactions (write, read) and audit key it uses."""

    # -- access -------------------------------------------------------------------------
    def create_principal(
        self: Transactions, actor: Actor, name: str, kind: str, team: str
    ) -> access.PrincipalInfo:
        def run(conn: Connection, now: int) -> access.PrincipalInfo:
            who = access.create_principal(conn, name, kind, team, now)
            audit.append(
                conn, actor, "principal.create", f"principal/{who.name}", "ok", now, {"kind": who.kind}
            )
            return who

        return self.write(run)

    def create_key(self: Transactions, actor: Actor, principal: str, expires_us: int) -> access.NewKey:
        def run(conn: Connection, now: int) -> access.NewKey:
            who, key = access.create_key(conn, principal, expires_us, now)
            audit.append(conn, actor, "key.create", f"key/{key.key_id}", "ok", now, {"principal": who.name})
            return key

        return self.write(run)

    def revoke_key(self: Transactions, actor: Actor, key_id: str) -> None:
        def run(conn: Connection, now: int) -> None:
            pid = access.revoke_key(conn, key_id, now)
            audit.append(conn, actor, "key.revoke", f"key/{key_id}", "ok", now, {"principal_id": pid})

        self.write(run)

    def grant_role(self: Transactions, actor: Actor, principal: str, role: str, scope: str) -> None:
        def run(conn: Connection, now: int) -> None:
            who = access.grant_role(conn, principal, role, scope, now)
            detail = {"role": role, "scope": scope or "*"}
            audit.append(conn, actor, "role.grant", f"principal/{who.name}", "ok", now, detail)

        self.write(run)

    def revoke_role(self: Transactions, actor: Actor, principal: str, role: str, scope: str) -> None:
        def run(conn: Connection, now: int) -> None:
            who = access.revoke_role(conn, principal, role, scope)
            detail = {"role": role, "scope": scope or "*"}
            audit.append(conn, actor, "role.revoke", f"principal/{who.name}", "ok", now, detail)

        self.write(run)

    def authenticate(self: Transactions, key: str, actor: Actor | None = None) -> access.Identity:
        try:
            return self.read(lambda conn: access.authenticate(conn, key, self.clock()))
        except AuthFailed:
            if not self.watch.halted:  # a halted ledger still answers UNAUTHENTICATED
                self.append_audit(actor or Actor(), "auth.denied", f"key/{audited_key_id(key)}", "denied", {})
            raise

    # -- audit --------------------------------------------------------------------------
    def append_audit(
        self: Transactions, actor: Actor, action: str, resource: str, outcome: str, detail: dict[str, Any]
    ) -> audit.AuditRecord:
        return self.write(lambda conn, now: audit.append(conn, actor, action, resource, outcome, now, detail))

    def query_audit(
        self: Transactions, action: str, principal: str, since_us: int, until_us: int, limit: int
    ) -> list[audit.AuditRecord]:
        reports.check_window(since_us, until_us)
        return audit.query(self.engines.read, action, principal, since_us, until_us, limit)

    def verify_audit(self: Transactions) -> audit.Verification:
        """The chain's verdict, failing closed on the anchor (services/metering/integrity.py)."""
        verdict = audit.verify(self.engines.read, self.audit_key, self.anchor_path)
        if not verdict.ok:
            return verdict
        with self.engines.read.connect() as conn:
            audit.bind_key(conn, self.audit_key)
            forged = rowmac.forged_rows(conn)
            if forged:
                message = f"rows written behind metering's back: {', '.join(forged[:20])}"
                return audit.Verification(False, verdict.rows_checked, 0, "row", message)
            failure = integrity.unresolved_failure(conn)
            if failure is not None:
                message = f"integrity failure recorded at row {failure[0]}: {failure[1]}"
                return audit.Verification(False, verdict.rows_checked, failure[0], "anchor", message)
            if self.anchor_path is not None:
                try:
                    integrity.check_anchor(conn, self.anchor_path, self.audit_key, self.watch.anchored_seq)
                except AnchorError as exc:
                    return audit.Verification(False, verdict.rows_checked, 0, "anchor", str(exc))
            broken = self._witness_break()
            if broken:
                return audit.Verification(False, verdict.rows_checked, 0, "witness", broken)
        if self.watch.halted:
            return audit.Verification(False, verdict.rows_checked, 0, "anchor", self.watch.halted)
        return verdict

    def _witness_break(self: Transactions) -> str:
        """The chain against the witness's newest countersigned head ("" when it agrees)."""
        if self.witness is None:
            return ""
        try:
            head = self.witness.latest()
        except witness_client.WitnessUnreachable as exc:  # fail closed: nothing vouches for the tail
            return str(exc)
        with self.engines.read.connect() as conn:
            if head is None:  # a witness with nothing to show for an anchored chain vouches for nothing
                anchored = integrity.was_anchored(conn)
                return (
                    f"the witness has no head of log {self.witness.log}, yet the chain was anchored"
                    if anchored
                    else ""
                )
            return witness_client.chain_break(conn, head)

    def write_anchor(self: Transactions) -> bool:
        """Sign the committed head into the anchor file (if one is configured and it moved).

        The anchor there is checked first (integrity.check_anchor); one that fails is never
        overwritten: the ledger halts and AnchorError is raised.
        """
        if self.anchor_path is None or self.watch.halted:
            return False
        try:
            with self.engines.read.connect() as conn:
                if not self.watch.marked and (failure := integrity.unresolved_failure(conn)):
                    raise AnchorError(f"integrity failure recorded at row {failure[0]}: {failure[1]}")
                anchor = integrity.check_anchor(
                    conn, self.anchor_path, self.audit_key, self.watch.anchored_seq
                )
        except AnchorError as exc:
            integrity.halt(self.engines.write, self.audit_key, self.watch, str(exc))
            raise
        seq, digest = audit.head(self.engines.read)
        if seq == 0:
            return False
        self._witness(seq, digest)
        written = auditkey.write_anchor(self.anchor_path, self.audit_key, seq, digest, self.clock())
        self.watch.anchored_seq = max(self.watch.anchored_seq, seq)
        if not self.watch.marked:  # the chain remembers that it is anchored, once the file is there
            with self.engines.read.connect() as conn:
                marked = integrity.was_anchored(conn)
            if not marked:
                detail = {"seq": seq, "anchor_found": anchor is not None}
                self.append_audit(integrity.SERVICE, integrity.ANCHORED, "audit/anchor", "ok", detail)
            self.watch.marked = True
        return written

    def _witness(self: Transactions, seq: int, digest: str) -> None:
        """Have the witness countersign the head before it is anchored; its refusal halts."""
        if self.witness is None or seq <= self.watch.witnessed_seq:
            return
        try:
            self.witness.submit(seq, digest)
        except witness_client.WitnessRefused as exc:
            integrity.halt(self.engines.write, self.audit_key, self.watch, str(exc))
            raise AnchorError(str(exc)) from None
        except witness_client.WitnessUnreachable as exc:  # anchored locally; the next round retries
            integrity.log.warning("audit head not countersigned: %s", exc)
            return
        self.watch.witnessed_seq = seq

    def reanchor(self: Transactions, actor: Actor, reason: str) -> int:
        """The operator's decision after investigating a failure: the chain as it is now (which
        must walk cleanly) becomes the anchored one. Returns the anchored seq."""
        if self.anchor_path is None:
            raise integrity.IntegrityHalted("no anchor file is configured (SWITCHYARD_AUDIT_ANCHOR)")
        walk = audit.verify(self.engines.read, self.audit_key, None)
        if not walk.ok:
            raise integrity.IntegrityHalted(
                f"the chain itself is broken at seq {walk.first_broken_seq} ({walk.problem}): {walk.message}"
            )
        try:
            old = repr(auditkey.read_anchor(self.anchor_path, self.audit_key))
        except AnchorError as exc:
            old = str(exc)
        detail = {"reason": reason, "previous_anchor": old[:512]}
        rec = self.write(
            lambda conn, now: audit.append(
                conn, actor, integrity.REANCHORED, "audit/anchor", "ok", now, detail
            )
        )
        auditkey.write_anchor(self.anchor_path, self.audit_key, rec.seq, rec.hash, self.clock(), force=True)
        self.watch.halted, self.watch.anchored_seq = "", rec.seq
        return rec.seq
