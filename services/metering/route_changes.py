"""Run-time route changes shared by the routers of a fleet (`route_changes`).

Each RouterAdmin change is one appended row, audited in the same transaction (`route.set`,
`route.delete`, with the route it replaced as the router had it); the latest row per fleet and
model is in force.
Metering only checks the shape (names, a JSON object or a deletion): the routers validate a
route against their own deployments when they apply it.

A route change moves traffic and money: it picks the deployments a model's requests go to
(and so the path, with its price, they are charged at) and the share copied to shadow
candidates. So each row, like a limit change, carries a keyed MAC (services/metering/rowmac.py)
over all its fields, its id included: metering chooses the id (the highest plus one, under
the audit head's lock, so one audited writer at a time) and writes row and MAC in one INSERT,
as its runtime role may not UPDATE these tables. When the rows are served to the routers
(`in_force`), a row whose MAC does not match is left out and the newest genuine change for
that model (or principal) is served instead, with a warning naming the row: refusing the
whole list would freeze every route (every limit) of the fleet, so a forger could block a
limit being lowered, and leaving the model out would give a freshly started router its file's
route (a principal: the router's default limits, often none). `audit verify` names the row.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from sqlalchemy import Column, Connection, Table, func, select

from services.metering import audit, rowmac
from services.metering.metering_errors import BadInput
from services.metering.records import MAX_KEY, Actor
from services.metering.schema import HEAD, ROUTE_CHANGES

log = logging.getLogger(__name__)

MAX_ROUTE_JSON = 64 * 1024


def _check_name(value: str, what: str) -> None:
    if not value or len(value) > MAX_KEY:
        raise BadInput(f"{what} has {len(value)} characters; give 1..{MAX_KEY}")


def _table(text: str, what: str) -> dict[str, Any]:
    if len(text) > MAX_ROUTE_JSON:
        raise BadInput(f"{what} is {len(text)} bytes; a route is at most {MAX_ROUTE_JSON}")
    try:
        table = json.loads(text)
    except ValueError as exc:
        raise BadInput(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(table, dict):
        raise BadInput(f"{what} must be a JSON object (the route's routes-file table)")
    return table


def save(
    conn: Connection,
    actor: Actor,
    fleet: str,
    model: str,
    route_json: str | None,
    previous_json: str,
    now_us: int,
) -> Any:
    """Appends one change (`route_json` None: deleted) and its audit row; returns the change."""
    _check_name(fleet, "fleet name")
    _check_name(model, "model name")
    new = _table(route_json, "route_json") if route_json is not None else None
    old = _table(previous_json, "previous_json") if previous_json else None
    action = "route.set" if new is not None else "route.delete"
    values = {"fleet": fleet, "model": model, "route_json": route_json}
    resource, detail = f"route/{fleet}/{model}", {"old": old, "new": new}
    return append_change(conn, ROUTE_CHANGES, actor, now_us, values, action, resource, detail)


def latest(conn: Connection, fleet: str) -> list[Any]:
    """The fleet's change in force for each model (its highest id), ordered by model."""
    _check_name(fleet, "fleet name")
    return in_force(conn, ROUTE_CHANGES, ROUTE_CHANGES.c.model, fleet)


def newest_per(conn: Connection, table: Table, key: Column[Any], fleet: str) -> list[Any]:
    """The newest rows of an append-only change table for a fleet: the highest id for each
    value of `key`, ordered by it (route changes here, per-principal limits too)."""
    newest = select(func.max(table.c.id)).where(table.c.fleet == fleet).group_by(key)
    return list(conn.execute(select(table).where(table.c.id.in_(newest)).order_by(key)))


def in_force(conn: Connection, table: Table, key: Column[Any], fleet: str) -> list[Any]:
    """The change in force for each value of `key`: its newest row whose MAC holds (a forged
    row is left out, logged, and the genuine one below it served instead)."""
    out = []
    vouchers: dict[int, Any] | None = None  # read once, when a row without a MAC needs them
    for row in newest_per(conn, table, key, fleet):
        while row is not None:
            if row.mac is None and vouchers is None:
                vouchers = rowmac.change_vouchers(conn, table)
            if rowmac.change_ok(conn, table, row, vouchers or {}):
                out.append(row)
                break
            log.warning(
                "%s row %d (fleet %r, %s %r) fails its MAC (written behind metering's back): "
                "not served, the newest genuine change holds; see `switchyard audit verify`",
                table.name, row.id, fleet, key.name, row._mapping[key.name],
            )  # fmt: skip
            below = (table.c.fleet == fleet, key == row._mapping[key.name], table.c.id < row.id)
            row = conn.execute(select(table).where(*below).order_by(table.c.id.desc()).limit(1)).first()
    return out


def append_change(
    conn: Connection,
    table: Table,
    actor: Actor,
    now_us: int,
    values: dict[str, Any],
    action: str,
    resource: str,
    detail: dict[str, Any],
) -> Any:
    """Appends one row of a fleet's change table (`values`, who and when, and its MAC) and its
    audit row, whose detail leads with the fleet and the row's id as the revision; returns the row."""
    conn.execute(select(HEAD.c.seq).where(HEAD.c.id == 1).with_for_update())  # one writer at a time
    next_id = (conn.execute(select(func.max(table.c.id))).scalar() or 0) + 1
    fields = {
        "id": next_id, **values, "changed_us": now_us, "principal": actor.principal,
        "request_id": actor.request_id,
    }  # fmt: skip
    insert = table.insert().values(**fields, mac=rowmac.change_mac(conn, table, fields))
    row = conn.execute(insert.returning(table)).one()
    detail = {"fleet": values["fleet"], "revision": row.id, **detail}
    audit.append(conn, actor, action, resource, "ok", now_us, detail)
    return row
