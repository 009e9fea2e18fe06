"""Run-time route changes shared by the routers of a fleet (`route_changes`).

Each RouterAdmin change is one appended row, audited in the same transaction (`route.set`,
`route.delete`, with the route it replaced as the router had it); the latest row per fleet and
model is in force.
Metering only checks the shape (names, a JSON object or a deletion): the routers validate a
route against their own deployments when they apply it.
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import Column, Connection, Table, func, select

from services.metering import audit
from services.metering.metering_errors import BadInput
from services.metering.records import MAX_KEY, Actor
from services.metering.schema import ROUTE_CHANGES

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
    return newest_per(conn, ROUTE_CHANGES, ROUTE_CHANGES.c.model, fleet)


def newest_per(conn: Connection, table: Table, key: Column[Any], fleet: str) -> list[Any]:
    """The rows of an append-only change table in force for a fleet: the highest id for each
    value of `key`, ordered by it (route changes here, per-principal limits too)."""
    newest = select(func.max(table.c.id)).where(table.c.fleet == fleet).group_by(key)
    return list(conn.execute(select(table).where(table.c.id.in_(newest)).order_by(key)))


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
    """Appends one row of a fleet's change table (`values`, who and when) and its audit row,
    whose detail leads with the fleet and the row's id as the revision; returns the row."""
    insert = table.insert().values(
        **values, changed_us=now_us, principal=actor.principal, request_id=actor.request_id
    )
    row = conn.execute(insert.returning(table)).one()
    detail = {"fleet": values["fleet"], "revision": row.id, **detail}
    audit.append(conn, actor, action, resource, "ok", now_us, detail)
    return row
