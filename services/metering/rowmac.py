"""Keyed MACs on the rows that grant power: role bindings and API keys (with their revocation).

Each such row carries `mac`, an HMAC-SHA256 under a key derived from the audit key (which the
database does not hold) of the row's meaningful fields. Metering writes it with the row and
checks it whenever it uses the row: a binding whose MAC does not match grants nothing, and a
key whose MAC does not match (a revoked key whose `revoked_us` was cleared, a changed
principal, a key inserted by hand) does not authenticate. `audit verify` names such rows
(problem `row`). A row written before migration 0008 has no MAC and is refused likewise:
re-grant the role or issue a new key through the service.

What a MAC cannot tell apart: a row put back exactly as it was earlier (a key's state before
its revocation, with that state's MAC); `audit verify` cross-checks every `key.revoke` row
of the chain against the key's row, so that replay is named too.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from sqlalchemy import Connection, select

from services.metering import audit
from services.metering.schema import AUDIT, BINDINGS, KEYS

ROW_INFO = b"switchyard row mac v1"


def _key(conn: Connection) -> bytes:
    key = conn.info.get(audit.KEY_INFO)
    if not isinstance(key, bytes):
        raise RuntimeError("no audit key bound to this connection (audit.bind_key)")
    return hmac.new(key, ROW_INFO, hashlib.sha256).digest()


def _mac(conn: Connection, *fields: Any) -> str:
    body = json.dumps(fields, separators=(",", ":")).encode()
    return hmac.new(_key(conn), body, hashlib.sha256).hexdigest()


def binding_mac(conn: Connection, principal_id: str, role: str, scope: str, created_us: int) -> str:
    return _mac(conn, "role_binding", principal_id, role, scope, int(created_us))


def key_mac(
    conn: Connection,
    key_id: str,
    principal_id: str,
    secret_hash: str,
    created_us: int,
    expires_us: int,
    revoked_us: int | None,
) -> str:
    return _mac(
        conn, "api_key", key_id, principal_id, secret_hash, int(created_us), int(expires_us), revoked_us
    )


def binding_ok(conn: Connection, row: Any) -> bool:
    expected = binding_mac(conn, row.principal_id, row.role, row.scope, row.created_us)
    return row.mac is not None and hmac.compare_digest(str(row.mac), expected)


def key_ok(conn: Connection, row: Any) -> bool:
    expected = key_mac(
        conn, row.key_id, row.principal_id, row.secret_hash, row.created_us, row.expires_us, row.revoked_us
    )
    return row.mac is not None and hmac.compare_digest(str(row.mac), expected)


def forged_rows(conn: Connection) -> list[str]:
    """Every binding and key whose MAC does not match, and every key the chain revoked that
    the table says is live (a replayed earlier state): `role_binding/<id>`, `api_key/<id>`."""
    bad = [f"role_binding/{r.id}" for r in conn.execute(select(BINDINGS)) if not binding_ok(conn, r)]
    keys = {r.key_id: r for r in conn.execute(select(KEYS))}
    bad += [f"api_key/{k}" for k, r in keys.items() if not key_ok(conn, r)]
    revoked = conn.execute(select(AUDIT.c.resource).where(AUDIT.c.action == "key.revoke"))
    for (resource,) in revoked:
        key_id = str(resource).removeprefix("key/")
        row = keys.get(key_id)
        if row is not None and row.revoked_us is None and f"api_key/{key_id}" not in bad:
            bad.append(f"api_key/{key_id}")
    return bad
