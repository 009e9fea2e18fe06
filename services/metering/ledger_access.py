"""The ledger's access operations: principals, API keys, role bindings and authentication.
Each write is one transaction with its audit row, run through the ledger's Transactions
(services/metering/transactions.py); reached as `ledger.access`.
"""

from __future__ import annotations

import hashlib
import re

from sqlalchemy import Connection

from services.metering import access, audit
from services.metering.metering_errors import AuthFailed
from services.metering.records import Actor
from services.metering.transactions import Transactions

_KEY_ID = re.compile(r"sk_[0-9a-f]{16}")


def audited_key_id(key: str) -> str:
    """What an audit row may name of a refused key: its id when it has switchyard's form
    (`sk_<16 hex>.<secret>`), else a short hash, so no part of a mistaken secret (an OpenAI
    `sk-proj-...` key, say) is ever stored."""
    key_id, dot, _ = key.partition(".")
    if dot and _KEY_ID.fullmatch(key_id):
        return key_id
    return "malformed:" + hashlib.sha256(key.encode()).hexdigest()[:12]


class LedgerAccess:
    """Who may call: principals, their keys and role bindings, and the check of a key."""

    def __init__(self, tx: Transactions) -> None:
        self.tx = tx

    def create_principal(self, actor: Actor, name: str, kind: str, team: str) -> access.PrincipalInfo:
        def run(conn: Connection, now: int) -> access.PrincipalInfo:
            who = access.create_principal(conn, name, kind, team, now)
            audit.append(
                conn, actor, "principal.create", f"principal/{who.name}", "ok", now, {"kind": who.kind}
            )
            return who

        return self.tx.write(run)

    def create_key(self, actor: Actor, principal: str, expires_us: int) -> access.NewKey:
        def run(conn: Connection, now: int) -> access.NewKey:
            who, key = access.create_key(conn, principal, expires_us, now)
            audit.append(conn, actor, "key.create", f"key/{key.key_id}", "ok", now, {"principal": who.name})
            return key

        return self.tx.write(run)

    def revoke_key(self, actor: Actor, key_id: str) -> None:
        def run(conn: Connection, now: int) -> None:
            pid = access.revoke_key(conn, key_id, now)
            audit.append(conn, actor, "key.revoke", f"key/{key_id}", "ok", now, {"principal_id": pid})

        self.tx.write(run)

    def grant_role(self, actor: Actor, principal: str, role: str, scope: str) -> None:
        def run(conn: Connection, now: int) -> None:
            who = access.grant_role(conn, principal, role, scope, now)
            detail = {"role": role, "scope": scope or "*"}
            audit.append(conn, actor, "role.grant", f"principal/{who.name}", "ok", now, detail)

        self.tx.write(run)

    def revoke_role(self, actor: Actor, principal: str, role: str, scope: str) -> None:
        def run(conn: Connection, now: int) -> None:
            who = access.revoke_role(conn, principal, role, scope)
            detail = {"role": role, "scope": scope or "*"}
            audit.append(conn, actor, "role.revoke", f"principal/{who.name}", "ok", now, detail)

        self.tx.write(run)

    def authenticate(self, key: str, actor: Actor | None = None) -> access.Identity:
        """The key's identity; a refused key is audited once, as `auth.denied`."""
        try:
            return self.tx.read(lambda conn: access.authenticate(conn, key, self.tx.clock()))
        except AuthFailed:
            if not self.tx.watch.halted:  # a halted ledger still answers UNAUTHENTICATED
                resource = f"key/{audited_key_id(key)}"
                who = actor or Actor()
                self.tx.write(
                    lambda conn, now: audit.append(conn, who, "auth.denied", resource, "denied", now, {})
                )
            raise
