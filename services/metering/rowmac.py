"""Keyed MACs on the rows that grant power or set money: role bindings, API keys (with their
revocation), paths (the price key each is charged at), prices, ledger lines, and a fleet's
per-principal limits and route changes.

Each such row carries `mac`, an HMAC-SHA256 under a key derived from the audit key (which the
database does not hold) of the row's meaningful fields. Metering writes it with the row and
checks it whenever it uses the row: a binding whose MAC does not match grants nothing, and a
key whose MAC does not match (a revoked key whose `revoked_us` was cleared, a changed
principal, a key inserted by hand) does not authenticate, and a price whose MAC does not match
(a rate lowered or raised by SQL, a version inserted by hand), like a path whose MAC does not
match (its price key pointed at a cheaper one), charges nothing: usage on it is refused
(FAILED_PRECONDITION, the router keeps it in its journal) until an operator acts.
`audit verify` names such rows (problem `row`). A binding or key written before migration 0008
has no MAC and is refused likewise: re-grant the role or issue a new key through the service.
A price written before migration 0009 (a path: 0010) has none either; it holds where the
chain vouches for it (its `price.set` row names the same version, rate and currency; its
`path.register` row the same price key and resource class), since paths and prices are never
changed and so are never signed again.

A ledger line's MAC covers every field it has (what it charges, for which job, model, team
and trial, at which price version, when): a line inserted or changed by SQL is refused where
it is used (the idempotency check of a new event with its key, a job's cost, a reversal, a
reservation's close, a cost report over it, the exports), FAILED_PRECONDITION naming the
line, and `audit verify` names it (`line/<key>`). Lines from before migration 0013 have no
MAC: at metering's first start after it the chain records them (`ledger.lines_signed`: the
highest id among them, their count and the digest of their fields), so such a line holds at
use, and `audit verify` recomputes the digest (a legacy line changed or added by SQL is
named `line/legacy`); any other line without a MAC is forged. A line deleted by SQL leaves no row to check,
and its MAC cannot name it.

A limit change (`limit_changes`) or route change (`route_changes`) row's MAC covers every
field, its id included (metering picks the id, so the INSERT carries the MAC and the runtime
role needs no UPDATE): a limit raised by SQL, or an older, looser limit (or another route)
inserted above the newest with its own MAC, fails it. Where the routers read them
(ListLimitChanges, ListRouteChanges: route_changes.in_force) such a row is left out with a
warning and the newest genuine change below it is served; `audit verify` names it
(`limit_change/<id>`, `route_change/<id>`), and an audited revision gone from the table too.
A change from before migration 0014 has no MAC; it holds where the chain vouches for it, as
for prices: the first `limit.set` (`route.set`, `route.delete`) row naming its revision,
written in the same transaction, is on the same resource, names the same fleet and says the
same limits (route); only metering writes those actions (METERING_ONLY_ACTIONS). Every
change is audited that way, so no row needs recording at start-up as lines do.

What a MAC cannot tell apart: a row put back exactly as it was earlier (a key's state before
its revocation, with that state's MAC); `audit verify` cross-checks every `key.revoke` row
of the chain against the key's row, so that replay is named too.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, Table, func, select

from services.metering import audit
from services.metering.metering_errors import WrongState
from services.metering.records import Actor
from services.metering.schema import (
    AUDIT,
    BINDINGS,
    KEYS,
    LIMIT_CHANGES,
    LINES,
    PATHS,
    PRICES,
    ROUTE_CHANGES,
)

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


PRICE_FIELDS = ("price_key", "micros_per_hour", "currency", "effective_from_us", "version", "created_us")


def price_mac(conn: Connection, fields: dict[str, Any]) -> str:
    """Of a price's fields (PRICE_FIELDS): what it charges, from when, as which version; and,
    for an example price only, its mark (so a price signed before migration 0011 still holds,
    and the mark can be neither added nor removed by SQL)."""
    marked = ("example",) if fields.get("example") else ()
    return _mac(conn, "price", *(fields[name] for name in PRICE_FIELDS), *marked)


def price_ok(conn: Connection, row: Any) -> bool:
    """The row's MAC matches; or it has none (written before migration 0009) and the chain's
    `price.set` row for its version says the same rate and currency."""
    if row.mac is None:
        return not row.example and _chained_price(conn, row)
    expected = price_mac(conn, {name: getattr(row, name) for name in (*PRICE_FIELDS, "example")})
    return hmac.compare_digest(str(row.mac), expected)


PATH_FIELDS = ("path", "backend", "resource_class", "price_key", "host", "created_us")


def path_mac(conn: Connection, fields: dict[str, Any]) -> str:
    """Of a path's fields (PATH_FIELDS): above all, the price key it is charged at."""
    return _mac(conn, "path", *(fields[name] for name in PATH_FIELDS))


def path_ok(conn: Connection, row: Any) -> bool:
    """As price_ok: the MAC, or (a path from before migration 0010) its chained path.register."""
    if row.mac is None:
        wanted = {"price_key": row.price_key, "resource_class": row.resource_class}
        return wanted in _chained(conn, "path.register", f"path/{row.path}")
    expected = path_mac(conn, {name: getattr(row, name) for name in PATH_FIELDS})
    return hmac.compare_digest(str(row.mac), expected)


def _chained(conn: Connection, action: str, resource: str) -> list[dict[str, Any]]:
    """The details of the chain's `action` rows on `resource`."""
    rows = conn.execute(
        select(AUDIT.c.detail_json).where(AUDIT.c.action == action, AUDIT.c.resource == resource)
    )
    return [json.loads(detail) for (detail,) in rows]


def _chained_price(conn: Connection, row: Any) -> bool:
    wanted = (row.version, int(row.micros_per_hour), row.currency)
    said = _chained(conn, "price.set", f"price/{row.price_key}")
    return any((d.get("version"), d.get("micros_per_hour"), d.get("currency")) == wanted for d in said)


# Every column of a ledger line but its id and its MAC, in the order the hot path inserts them
# (usage.LINE_COLUMNS): what a line charges, for what, when, and how it was priced.
LINE_FIELDS = (
    "idempotency_key", "content_hash", "basis", "at_us", "end_us", "quantity_us", "amount_micros", "currency",
    "price_version", "method", "path", "reservation_id", "job_id", "model", "team", "trial_id", "arm",
    "tags_json", "recorded_us", "prompt_tokens", "output_tokens",
)  # fmt: skip
_LINE_DEFAULTS = {"prompt_tokens": 0, "output_tokens": 0}  # the columns' own defaults
LINES_SIGNED = "ledger.lines_signed"  # the chain's row after which every line carries a MAC
# The chain's rows that vouch for a table row (a price or path from before its MAC, a limit or
# route change from before its MAC, the lines from before theirs, a key's revocation) and the
# anchor's marks: only metering records them, in the transaction that writes what they vouch
# for. AppendAudit refuses them (PERMISSION_DENIED), so no caller can vouch for a row it wrote
# by SQL; a chain that took one before this check keeps it.
METERING_ONLY_ACTIONS = frozenset(
    {"price.set", "path.register", "limit.set", "route.set", "route.delete", "key.revoke", LINES_SIGNED}
    | {"audit.anchor", "audit.integrity", "audit.reanchor"}
)
SIGNER = Actor("metering", "line-signing")


def line_signer(conn: Connection) -> Callable[[Sequence[Any]], str]:
    """The MAC of a line's values in LINE_FIELDS order (the key derived once, for a batch).
    The HMAC's keyed state is copied per line and one encoder serves the batch: the same MAC
    as hmac.new over json.dumps, in about two thirds of the time (6 -> 4 us a line)."""
    keyed = hmac.new(_key(conn), digestmod=hashlib.sha256)
    encode = json.JSONEncoder(separators=(",", ":")).encode

    def sign(values: Sequence[Any]) -> str:
        mac = keyed.copy()
        mac.update(encode(["ledger_line", *values]).encode())
        return mac.hexdigest()

    return sign


def line_mac(conn: Connection, fields: Mapping[Any, Any]) -> str:
    """Of every field of a ledger line (LINE_FIELDS)."""
    return line_signer(conn)([fields.get(n, _LINE_DEFAULTS.get(n)) for n in LINE_FIELDS])


def signed_lines(conn: Connection, rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows to insert into ledger_lines, each with its MAC (the writers that build dicts;
    the hot path signs its tuples with line_signer)."""
    return [{**r, "mac": line_mac(conn, r)} for r in rows]


def _legacy(conn: Connection) -> dict[str, Any] | None:
    """The chain's `ledger.lines_signed` row (None: this ledger was never opened by a metering
    that signs lines)."""
    first = select(AUDIT.c.detail_json).where(AUDIT.c.action == LINES_SIGNED).order_by(AUDIT.c.seq).limit(1)
    row = conn.execute(first).first()
    return None if row is None else dict(json.loads(row[0]))


def line_ok(conn: Connection, row: Any, legacy_through: int = 0) -> bool:
    """The line's MAC matches; or it has none and is a line from before migration 0013 (its id
    at most `legacy_through`, which the chain recorded with their digest: `adopt_legacy_lines`)."""
    if row.mac is None:
        return bool(row.id <= legacy_through)
    return hmac.compare_digest(str(row.mac), line_mac(conn, row._mapping))


def check_lines(conn: Connection, rows: Iterable[Any], using: str) -> None:
    """Refuse to use lines written behind metering's back (WrongState: FAILED_PRECONDITION)."""
    legacy = _legacy(conn)
    through = int(legacy["through_id"]) if legacy else 0
    bad = [str(r.idempotency_key) for r in rows if not line_ok(conn, r, through)]
    if bad:
        raise WrongState(
            f"{using}: ledger line {bad[0]}{f' and {len(bad) - 1} more' if len(bad) > 1 else ''} "
            "fails its MAC (written behind metering's back), so it is not used; see `switchyard audit verify`"
        )


def _legacy_digest(conn: Connection, through_id: int) -> tuple[int, str]:
    """How many lines up to `through_id` have no MAC, and the digest of all their fields."""
    rows = conn.execute(
        select(LINES).where(LINES.c.mac.is_(None), LINES.c.id <= through_id).order_by(LINES.c.id)
    ).all()
    digest = hashlib.sha256()
    for r in rows:
        digest.update(
            json.dumps([r.id, *(r._mapping[n] for n in LINE_FIELDS)], separators=(",", ":")).encode()
        )
    return len(rows), digest.hexdigest()


def adopt_legacy_lines(conn: Connection, now_us: int) -> int | None:
    """Once per ledger, at metering's first start after migration 0013: record in the chain
    the lines written before it (without a MAC: the highest id among them, their count and
    the digest of their fields), which `audit verify` recomputes; None when already done.
    Metering's runtime role may not UPDATE lines, so they are vouched for, not signed."""
    if _legacy(conn) is not None:
        return None
    through = conn.execute(select(func.max(LINES.c.id)).where(LINES.c.mac.is_(None))).scalar() or 0
    count, digest = _legacy_digest(conn, int(through))
    detail = {"through_id": int(through), "count": count, "digest": digest}
    audit.append(conn, SIGNER, LINES_SIGNED, "ledger/lines", "ok", now_us, detail)
    return count


# A fleet's change rows (services/metering/route_changes.py): every column but the MAC, the id
# included, so a row's MAC copied onto another row (an older limit re-inserted above the newest,
# to put it back in force) does not match.
CHANGE_FIELDS = {
    "limit_changes": (
        "id", "fleet", "principal_id", "rate_per_s", "burst", "max_in_flight", "reset", "changed_us",
        "principal", "request_id",
    ),
    "route_changes": ("id", "fleet", "model", "route_json", "changed_us", "principal", "request_id"),
}  # fmt: skip
_CHANGE_TYPES = {"rate_per_s": float, "burst": int, "max_in_flight": int, "reset": bool}


def change_mac(conn: Connection, table: Table, fields: Mapping[str, Any]) -> str:
    """Of a change row's fields (CHANGE_FIELDS), typed as the column reads back (a rate of 0
    signed as 0.0, a reset as a bool), so SQLite and PostgreSQL agree."""
    values = [_CHANGE_TYPES.get(n, lambda v: v)(fields[n]) for n in CHANGE_FIELDS[table.name]]
    return _mac(conn, table.name, *values)


def _change_said(table: Table, row: Any) -> tuple[str, str, dict[str, Any]]:
    """The chain's action, resource and what its detail must say for this change row."""
    if table is LIMIT_CHANGES:
        said = {
            n: _CHANGE_TYPES[n](getattr(row, n)) for n in ("rate_per_s", "burst", "max_in_flight", "reset")
        }
        return "limit.set", f"principal/{row.principal_id}", said
    new = None if row.route_json is None else json.loads(row.route_json)
    action = "route.set" if new is not None else "route.delete"
    return action, f"route/{row.fleet}/{row.model}", {"new": new}


_CHANGE_ACTIONS = {"limit_changes": ("limit.set",), "route_changes": ("route.set", "route.delete")}


def change_vouchers(conn: Connection, table: Table) -> dict[int, tuple[str, str, dict[str, Any]]]:
    """The chain's audit row for each revision of a change table: action, resource and detail
    of the first (lowest seq) row naming it, the one written with the change."""
    rows = conn.execute(
        select(AUDIT.c.action, AUDIT.c.resource, AUDIT.c.detail_json)
        .where(AUDIT.c.action.in_(_CHANGE_ACTIONS[table.name]))
        .order_by(AUDIT.c.seq)
    )
    out: dict[int, tuple[str, str, dict[str, Any]]] = {}
    for action, resource, detail_json in rows:
        detail = json.loads(detail_json)
        revision = detail.get("revision")
        if isinstance(revision, int) and revision not in out:
            out[revision] = (str(action), str(resource), detail)
    return out


def change_ok(
    conn: Connection, table: Table, row: Any, vouchers: Mapping[int, tuple[str, str, dict[str, Any]]]
) -> bool:
    """The change row's MAC matches; or it has none (written before migration 0014) and the
    chain's audit row for its revision (`limit.set`, `route.set` or `route.delete`, written in
    the same transaction: `change_vouchers`) names the same fleet and says the same limits or
    route."""
    if row.mac is not None:
        return hmac.compare_digest(str(row.mac), change_mac(conn, table, row._mapping))
    try:
        action, resource, said = _change_said(table, row)
    except ValueError:  # a route_json that is not JSON was never written by metering
        return False
    voucher = vouchers.get(row.id)
    if voucher is None or voucher[:2] != (action, resource):
        return False
    wanted = {"fleet": row.fleet, "revision": row.id, **said}
    return {n: voucher[2].get(n) for n in wanted} == wanted


def _forged_changes(conn: Connection) -> list[str]:
    """Every limit or route change row whose MAC does not match (`limit_change/<id>`,
    `route_change/<id>`), and every revision the chain audited that the table lost."""
    bad: list[str] = []
    for table, name in ((LIMIT_CHANGES, "limit_change"), (ROUTE_CHANGES, "route_change")):
        vouchers = change_vouchers(conn, table)
        ids = set()
        for row in conn.execute(select(table)):
            ids.add(row.id)
            if not change_ok(conn, table, row, vouchers):
                bad.append(f"{name}/{row.id}")
        bad += [f"{name}/{revision}" for revision in vouchers if revision not in ids]  # audited, gone
    return bad


def binding_ok(conn: Connection, row: Any) -> bool:
    expected = binding_mac(conn, row.principal_id, row.role, row.scope, row.created_us)
    return row.mac is not None and hmac.compare_digest(str(row.mac), expected)


def key_ok(conn: Connection, row: Any) -> bool:
    expected = key_mac(
        conn, row.key_id, row.principal_id, row.secret_hash, row.created_us, row.expires_us, row.revoked_us
    )
    return row.mac is not None and hmac.compare_digest(str(row.mac), expected)


def forged_rows(conn: Connection) -> list[str]:
    """Every binding, key, path and price whose MAC does not match, every key the chain revoked
    that the table says is live (a replayed earlier state) and every price the chain set that
    the table lost: `role_binding/<id>`, `api_key/<id>`, `path/<name>`, `price/<version>`."""
    bad = [f"role_binding/{r.id}" for r in conn.execute(select(BINDINGS)) if not binding_ok(conn, r)]
    keys = {r.key_id: r for r in conn.execute(select(KEYS))}
    bad += [f"api_key/{k}" for k, r in keys.items() if not key_ok(conn, r)]
    bad += [f"path/{r.path}" for r in conn.execute(select(PATHS)) if not path_ok(conn, r)]
    prices = list(conn.execute(select(PRICES)))
    bad += [f"price/{r.version}" for r in prices if not price_ok(conn, r)]
    versions = {r.version for r in prices}
    chained = conn.execute(select(AUDIT.c.detail_json).where(AUDIT.c.action == "price.set"))
    for (detail,) in chained:  # a price the chain set, gone from the table
        version = str(json.loads(detail).get("version", ""))
        if version and version not in versions and f"price/{version}" not in bad:
            bad.append(f"price/{version}")
    legacy = _legacy(conn)
    if legacy is not None:
        through = int(legacy["through_id"])
        bad += [
            f"line/{r.idempotency_key}" for r in conn.execute(select(LINES)) if not line_ok(conn, r, through)
        ]
        if _legacy_digest(conn, through) != (legacy["count"], legacy["digest"]):
            bad.append(f"line/legacy (the {legacy['count']} lines from before their MACs changed)")
    revoked = conn.execute(select(AUDIT.c.resource).where(AUDIT.c.action == "key.revoke"))
    for (resource,) in revoked:
        key_id = str(resource).removeprefix("key/")
        row = keys.get(key_id)
        if row is not None and row.revoked_us is None and f"api_key/{key_id}" not in bad:
            bad.append(f"api_key/{key_id}")
    return bad + _forged_changes(conn)
