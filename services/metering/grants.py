"""Signed grants: what a trial's Temporal history holds instead of the API key that started it.

`switchyard trial start` asks metering's Authorize, with the operator's key, for the roles the
trial needs: `trials:run` on the model's scope, `workloads:read` on the route of each captured
workload it replays (inputs or generation), `admin` on * for an executor named by address; it answers
with a grant of the subject
"<workflow id>|<model>|<inputs' workload>|<generation's workload>|spec:<sha256 of the spec>",
the roles and their scopes, signed with HMAC-SHA256 under a key derived from the audit key (which
the database does not hold, and which every metering replica shares). The workflow's first
activity hands it to VerifyGrant: signature, expiry and subject must match (so a spec swapped
under the same workflow id is refused), and the principal must still hold the roles. The first
verification spends the grant on its Temporal run (services/metering/grant_spends.py): a grant
authorises that one run of that one trial; it opens no other RPC, and it names the principal
by id, never by a secret.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from dataclasses import dataclass

from services.metering.metering_errors import MeteringError
from switchyard.errors import PermissionDenied

LABEL = b"switchyard trial grant v1"
LIFETIME_US = 3600 * 1_000_000  # time from `trial start` to its first activity
MAX_GRANT = 2048  # characters


@dataclass(frozen=True)
class Grant:
    principal_id: str
    subject: str
    roles: tuple[str, ...]
    scope: str
    expires_us: int
    more: tuple[tuple[str, str], ...] = ()  # (role, scope): also granted, each on its own scope


def grant_key(audit_key: bytes) -> bytes:
    return hmac.new(audit_key, LABEL, hashlib.sha256).digest()


def sign(key: bytes, grant: Grant) -> str:
    body = json.dumps(
        {
            "p": grant.principal_id,
            "s": grant.subject,
            "r": list(grant.roles),
            "c": grant.scope,
            "e": grant.expires_us,
            "m": [list(pair) for pair in grant.more],
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    payload = base64.urlsafe_b64encode(body).decode().rstrip("=")
    tag = hmac.new(key, payload.encode(), hashlib.sha256).hexdigest()
    return f"{payload}.{tag}"


def grant_id(token: str) -> str:
    """The grant's name in the ledger (grant_spends): the sha256 of the whole signed token."""
    return hashlib.sha256(token.encode()).hexdigest()


class GrantRefused(PermissionDenied, MeteringError):
    """The grant is not one metering signed, or no longer holds (the message says which)."""


def verify(key: bytes, token: str, subject: str, now_us: int) -> Grant:
    if not token or len(token) > MAX_GRANT or "." not in token:
        raise GrantRefused(
            "the trial grant is missing or malformed; start the trial with `switchyard trial start`"
        )
    payload, _, tag = token.rpartition(".")
    expected = hmac.new(key, payload.encode(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(tag, expected):
        raise GrantRefused("the trial grant's signature does not verify: it was not issued by this metering")
    try:
        raw = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        more = tuple((str(role), str(scope)) for role, scope in raw.get("m", ()))
        grant = Grant(
            str(raw["p"]), str(raw["s"]), tuple(str(r) for r in raw["r"]), str(raw["c"]), int(raw["e"]), more
        )
    except (ValueError, KeyError, TypeError):
        raise GrantRefused("the trial grant's body is malformed") from None
    if grant.subject != subject:
        raise GrantRefused(_mismatch(grant.subject, subject))
    if grant.expires_us <= now_us:
        raise GrantRefused("the trial grant has expired; start the trial again")
    return grant


def _mismatch(granted: str, asked: str) -> str:
    """Why a grant's subject is not this trial's; a spec swapped under its workflow id is named."""
    head, _, spec = granted.rpartition("|spec:")
    asked_head, _, asked_spec = asked.rpartition("|spec:")
    if spec and asked_spec and head == asked_head:
        return (
            f"the trial grant is for another spec (sha256 {spec[:16]}...), not this one (sha256 "
            f"{asked_spec[:16]}...): a grant holds only for the spec it was issued for; start the "
            "trial with `switchyard trial start`"
        )
    return f"the trial grant is for {granted!r}, not {asked!r}"
