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

from services.metering import access, audit, auditkey, reports
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

    def write(self: Transactions, fn: Callable[[Connection, int], T]) -> T: ...

    def read(self: Transactions, fn: Callable[[Connection], T]) -> T: ...

    def append_audit(
        self: Transactions, actor: Actor, action: str, resource: str, outcome: str, detail: dict[str, Any]
    ) -> audit.AuditRecord: ...


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
        return audit.verify(self.engines.read, self.audit_key, self.anchor_path)

    def write_anchor(self: Transactions) -> bool:
        """Sign the committed head into the anchor file (if one is configured and it moved)."""
        if self.anchor_path is None:
            return False
        seq, digest = audit.head(self.engines.read)
        if seq == 0:
            return False
        return auditkey.write_anchor(self.anchor_path, self.audit_key, seq, digest, self.clock())
