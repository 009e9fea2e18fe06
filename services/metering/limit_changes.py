"""Per-principal limits shared by the routers of a fleet (`limit_changes`).

Each RouterAdmin.SetPrincipalLimit is one appended row, audited in the same transaction
(`limit.set`, with the limits and the fleet); the latest row per fleet and principal is in
force, and every router of the fleet polls for it (services/router/fleet_limits.py).
Each row carries a keyed MAC; a row written behind metering's back is not served
(route_changes.in_force, services/metering/rowmac.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from services.metering import route_changes
from services.metering.metering_errors import BadInput
from services.metering.records import MAX_KEY, Actor
from services.metering.schema import LIMIT_CHANGES

MAX_RATE = 1e9
MAX_COUNT = 1 << 30


def _check(fleet: str, principal_id: str, rate_per_s: float, burst: int, max_in_flight: int) -> None:
    for value, what in ((fleet, "fleet name"), (principal_id, "principal_id")):
        if not value or len(value) > MAX_KEY:
            raise BadInput(f"{what} has {len(value)} characters; give 1..{MAX_KEY}")
    if not math.isfinite(rate_per_s) or not 0 <= rate_per_s <= MAX_RATE:
        raise BadInput(f"rate_per_s must be 0..{MAX_RATE:g} (0 = unlimited), got {rate_per_s}")
    for count, what in ((burst, "burst"), (max_in_flight, "max_in_flight")):
        if not 0 <= count <= MAX_COUNT:
            raise BadInput(f"{what} must be 0..{MAX_COUNT} (0 = unlimited), got {count}")


@dataclass(frozen=True)
class PrincipalLimit:
    """SetPrincipalLimit's change: the limits (0 = unlimited), or `reset` to the router's own."""

    principal_id: str
    rate_per_s: float
    burst: int
    max_in_flight: int
    reset: bool


def save(conn: Connection, actor: Actor, fleet: str, change: PrincipalLimit, now_us: int) -> Any:
    """Appends one change and its audit row; returns the change."""
    principal_id, reset = change.principal_id, change.reset
    rate_per_s, burst, max_in_flight = change.rate_per_s, change.burst, change.max_in_flight
    _check(fleet, principal_id, rate_per_s, burst, max_in_flight)
    if reset:
        rate_per_s, burst, max_in_flight = 0.0, 0, 0
    limits = {"rate_per_s": rate_per_s, "burst": burst, "max_in_flight": max_in_flight, "reset": reset}
    values = {"fleet": fleet, "principal_id": principal_id, **limits}
    action, resource = "limit.set", f"principal/{principal_id}"
    return route_changes.append_change(conn, LIMIT_CHANGES, actor, now_us, values, action, resource, limits)


def latest(conn: Connection, fleet: str) -> list[Any]:
    """The fleet's change in force for each principal (its highest id), ordered by principal."""
    if not fleet or len(fleet) > MAX_KEY:
        raise BadInput(f"fleet name has {len(fleet)} characters; give 1..{MAX_KEY}")
    return route_changes.in_force(conn, LIMIT_CHANGES, LIMIT_CHANGES.c.principal_id, fleet)
