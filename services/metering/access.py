"""Principals, roles and API keys, and authentication of a presented key.

A key is "<key_id>.<secret>". Only the key id is stored in clear; the secret is kept as
SHA-256 over the key id and secret (the secret has 256 bits of entropy, so a slow password
hash buys nothing, and a fast one keeps Authenticate cheap on the router's hot path). The
secret is returned once, at creation, and never logged. Every failure to authenticate
gets the same message, so a caller cannot tell an unknown key from a revoked one.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import Connection, delete, select, update

from services.metering import rowmac
from services.metering.metering_errors import AuthFailed, BadInput, Conflict, UnknownEntity
from services.metering.records import check_key, check_time
from services.metering.schema import BINDINGS, KEYS, PRINCIPALS

ROLES = ("infer", "trials:run", "workloads:read", "ledger:read", "admin")
PRINCIPAL_KINDS = ("user", "service", "team")
KEY_PREFIX = "sk_"
AUTH_FAILED = "API key is not valid (unknown, wrong, revoked or expired); ask an admin for a new key"


@dataclass(frozen=True)
class PrincipalInfo:
    principal_id: str
    name: str
    kind: str
    team: str


@dataclass(frozen=True)
class NewKey:
    key_id: str
    secret: str
    expires_us: int

    @property
    def key(self) -> str:
        return f"{self.key_id}.{self.secret}"


@dataclass(frozen=True)
class Identity:
    principal: PrincipalInfo
    roles: tuple[tuple[str, str], ...]  # (role, scope)
    key_id: str


def secret_hash(key_id: str, secret: str) -> str:
    return hashlib.sha256(f"{key_id}:{secret}".encode()).hexdigest()


def create_principal(conn: Connection, name: str, kind: str, team: str, now_us: int) -> PrincipalInfo:
    check_key(name, "principal name")
    kind = kind or "user"
    if kind not in PRINCIPAL_KINDS:
        raise BadInput(f"principal kind {kind!r} is not one of {', '.join(PRINCIPAL_KINDS)}")
    if conn.execute(select(PRINCIPALS.c.principal_id).where(PRINCIPALS.c.name == name)).first():
        raise Conflict(f"principal {name!r} already exists")
    pid = "p_" + secrets.token_hex(8)
    conn.execute(
        PRINCIPALS.insert().values(principal_id=pid, name=name, kind=kind, team=team, created_us=now_us)
    )
    return PrincipalInfo(pid, name, kind, team)


def find_principal(conn: Connection, ref: str) -> PrincipalInfo:
    """By id or by name."""
    row = conn.execute(
        select(PRINCIPALS).where((PRINCIPALS.c.principal_id == ref) | (PRINCIPALS.c.name == ref))
    ).first()
    if row is None:
        raise UnknownEntity(f"unknown principal {ref!r}")
    return PrincipalInfo(row.principal_id, row.name, row.kind, row.team)


def create_key(
    conn: Connection, principal: str, expires_us: int, now_us: int
) -> tuple[PrincipalInfo, NewKey]:
    check_time(expires_us, "expires_unix_us")
    if expires_us and expires_us <= now_us:
        raise BadInput(f"expires_unix_us {expires_us} is in the past; give a future time or 0 for none")
    who = find_principal(conn, principal)
    key_id = KEY_PREFIX + secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    digest = secret_hash(key_id, secret)
    conn.execute(
        KEYS.insert().values(
            key_id=key_id,
            principal_id=who.principal_id,
            secret_hash=digest,
            created_us=now_us,
            expires_us=expires_us,
            revoked_us=None,
            mac=rowmac.key_mac(conn, key_id, who.principal_id, digest, now_us, expires_us, None),
        )
    )
    return who, NewKey(key_id, secret, expires_us)


def revoke_key(conn: Connection, key_id: str, now_us: int) -> str:
    """Returns the key's principal id; revoking twice is accepted (same end state)."""
    row = conn.execute(select(KEYS).where(KEYS.c.key_id == key_id)).first()
    if row is None:
        raise UnknownEntity(f"unknown key id {key_id!r}")
    if row.revoked_us is None:
        mac = rowmac.key_mac(
            conn, key_id, row.principal_id, row.secret_hash, row.created_us, row.expires_us, now_us
        )
        conn.execute(update(KEYS).where(KEYS.c.key_id == key_id).values(revoked_us=now_us, mac=mac))
    return str(row.principal_id)


def _check_role(role: str, scope: str) -> None:
    if role not in ROLES:
        raise BadInput(f"role {role!r} is not one of {', '.join(ROLES)}")
    if scope != "*" and not (scope.startswith(("model:", "team:")) and len(scope.split(":", 1)[1]) > 0):
        raise BadInput(f"scope {scope!r} is not '*', 'model:<name>' or 'team:<name>'")


def grant_role(conn: Connection, principal: str, role: str, scope: str, now_us: int) -> PrincipalInfo:
    scope = scope or "*"
    _check_role(role, scope)
    who = find_principal(conn, principal)
    exists = conn.execute(
        select(BINDINGS.c.id).where(
            BINDINGS.c.principal_id == who.principal_id, BINDINGS.c.role == role, BINDINGS.c.scope == scope
        )
    ).first()
    if exists is None:
        mac = rowmac.binding_mac(conn, who.principal_id, role, scope, now_us)
        conn.execute(
            BINDINGS.insert().values(
                principal_id=who.principal_id, role=role, scope=scope, created_us=now_us, mac=mac
            )
        )
    return who


def revoke_role(conn: Connection, principal: str, role: str, scope: str) -> PrincipalInfo:
    scope = scope or "*"
    _check_role(role, scope)
    who = find_principal(conn, principal)
    gone = conn.execute(
        delete(BINDINGS).where(
            BINDINGS.c.principal_id == who.principal_id, BINDINGS.c.role == role, BINDINGS.c.scope == scope
        )
    )
    if gone.rowcount == 0:
        raise UnknownEntity(f"{who.name} has no role {role} on {scope}")
    return who


def authenticate(conn: Connection, key: str, now_us: int) -> Identity:
    key_id, _, secret = key.partition(".")
    if not key_id.startswith(KEY_PREFIX) or not secret:
        raise AuthFailed(AUTH_FAILED)
    row = conn.execute(select(KEYS).where(KEYS.c.key_id == key_id)).first()
    if row is None or not hmac.compare_digest(row.secret_hash, secret_hash(key_id, secret)):
        raise AuthFailed(AUTH_FAILED)
    if not rowmac.key_ok(conn, row):  # written behind metering's back: refused like a wrong key
        raise AuthFailed(AUTH_FAILED)
    if row.revoked_us is not None or (row.expires_us and row.expires_us <= now_us):
        raise AuthFailed(AUTH_FAILED)
    who = find_principal(conn, row.principal_id)
    return Identity(who, roles_of(conn, who.principal_id), key_id)


def roles_of(conn: Connection, principal_id: str) -> tuple[tuple[str, str], ...]:
    """The principal's (role, scope) bindings now; one whose MAC does not match grants nothing."""
    rows = conn.execute(
        select(BINDINGS)
        .where(BINDINGS.c.principal_id == principal_id)
        .order_by(BINDINGS.c.role, BINDINGS.c.scope)
    ).all()
    return tuple((r.role, r.scope) for r in rows if rowmac.binding_ok(conn, r))


def missing_roles(roles: tuple[tuple[str, str], ...], needed: Iterable[str], scope: str) -> list[str]:
    """The roles of `needed` not held on `scope` ("*" or "model:<name>"); admin on * holds all."""
    held = set(roles)
    if ("admin", "*") in held:
        return []
    return [
        role for role in needed if (role, "*") not in held and (scope == "*" or (role, scope) not in held)
    ]
