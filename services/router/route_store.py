"""Route changes made through RouterAdmin: kept across restarts, shared by a fleet of routers.

The routes file is the operator's (often a read-only ConfigMap), so changes made at run time
live elsewhere:
- With metering, in its `route_changes` table under the router's fleet (`[router] fleet`): a
  change is saved there, and audited in the same transaction, before it takes effect, and
  refused (UNAVAILABLE) when metering cannot take it. Every router of the fleet polls for the
  latest change per model every `route_sync_s`, so a change sent to one replica reaches them
  all.
- In `routes-state.json` in the router's state directory (its usage spool directory). Without
  metering it is where changes are kept: written (temporary file, fsync, rename, fsync of the
  directory) before a change takes effect, and a failed write refuses the change. With
  metering it caches the fleet's changes, so a router restarted while metering is down still
  serves them.
Changes apply over the file's routes, at start-up and whenever new ones arrive. Each is
validated against the deployments configured now; one that no longer fits (a deployment gone,
say) is skipped with a warning rather than stopping the router. Each change carries metering's
revision (0: kept only in this router's file) and the newer one wins, so a poll that raced a
change made here does not undo it.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from services.router.router_config import Deployment, Route, route_from_table, route_table
from switchyard.errors import SwitchyardError, Unavailable

log = logging.getLogger(__name__)

FILE_NAME = "routes-state.json"
FORMAT = 1


@dataclass(frozen=True)
class Change:
    table: dict[str, Any] | None  # the route as its routes-file table; None: deleted
    revision: int = 0  # metering's; 0: kept only in this router's file


@dataclass(frozen=True)
class RouteChange:
    """One change to share with the fleet: the route's new table (None: deleted) and the one it
    replaces (for the audit trail), by whom, under which request id."""

    fleet: str
    model: str
    table: dict[str, Any] | None
    previous: dict[str, Any] | None
    principal: str = ""
    request_id: str = ""


class SharedRoutes(Protocol):
    """Where a fleet's route changes are shared (metering)."""

    async def save_route_change(self, change: RouteChange) -> int:
        """Keeps the change for the fleet; returns its revision."""
        ...

    async def route_changes(self, fleet: str) -> dict[str, Change]: ...


class RouteStore:
    def __init__(self, directory: Path, shared: SharedRoutes | None = None, fleet: str = "default") -> None:
        self.path = directory / FILE_NAME
        self.shared = shared
        self.fleet = fleet
        self.changes = self._read()
        self._skipped: set[tuple[str, int]] = set()  # (model, revision) already warned about

    def _read(self) -> dict[str, Change]:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("ignoring route changes in %s: unreadable (%s)", self.path, exc)
            return {}
        changes = raw.get("routes") if isinstance(raw, dict) and raw.get("format") == FORMAT else None
        if not isinstance(changes, dict):
            log.warning("ignoring route changes in %s: not a format-%d routes state file", self.path, FORMAT)
            return {}
        revisions = raw.get("revisions")
        if not isinstance(revisions, dict):
            revisions = {}
        kept = {
            model: Change(table, revision if isinstance(revision := revisions.get(model), int) else 0)
            for model, table in changes.items()
            if table is None or isinstance(table, dict)
        }
        if kept:
            log.info("run-time route changes from %s: %s", self.path, sorted(kept))
        return kept

    def routes(self, base: dict[str, Route], deployments: tuple[Deployment, ...]) -> dict[str, Route]:
        """`base` (the routes file's routes) with the changes applied."""
        out = dict(base)
        for model, change in sorted(self.changes.items()):
            if change.table is None:
                out.pop(model, None)
                continue
            try:
                out[model] = route_from_table(model, change.table, deployments)
            except SwitchyardError as exc:
                if (model, change.revision) not in self._skipped:
                    self._skipped.add((model, change.revision))
                    where = f"revision {change.revision}" if change.revision else str(self.path)
                    log.warning("skipping the kept change to route %r (%s): %s", model, where, exc)
        return out

    async def save(
        self,
        model: str,
        route: Route | None,
        previous: Route | None = None,
        principal: str = "",
        request_id: str = "",
    ) -> None:
        """Keeps `route` (None: deleted) for `model`, replacing `previous` (for the audit trail);
        raises Unavailable if it cannot be kept."""
        table = route_table(route) if route is not None else None
        if self.shared is None:
            changes = {**self.changes, model: Change(table)}
            try:
                self._write(changes)
            except OSError as exc:
                raise Unavailable(
                    f"could not save the route change to {self.path} ({exc}); the route is unchanged"
                ) from None
        else:
            try:
                old = route_table(previous) if previous is not None else None
                change = RouteChange(self.fleet, model, table, old, principal, request_id)
                revision = await self.shared.save_route_change(change)
            except Unavailable as exc:
                raise Unavailable(
                    f"could not save the route change in metering ({exc}); the route is unchanged"
                ) from None
            changes = {**self.changes, model: Change(table, revision)}
            self._cache(changes)
        self.changes = changes

    async def sync(self) -> bool:
        """Takes the fleet's changes newer than those here; True when there were any.
        Raises Unavailable while metering does not answer."""
        if self.shared is None:
            return False
        fetched = await self.shared.route_changes(self.fleet)
        newer = {m: c for m, c in fetched.items() if c.revision > self.changes.get(m, Change(None)).revision}
        if not newer:
            return False
        self.changes = {**self.changes, **newer}
        self._cache(self.changes)
        return True

    def _cache(self, changes: dict[str, Change]) -> None:
        try:
            self._write(changes)
        except OSError as exc:  # metering keeps the change; only a restart without it would miss it
            log.warning("could not cache the fleet's route changes in %s: %s", self.path, exc)

    def _write(self, changes: dict[str, Change]) -> None:
        data = {
            "format": FORMAT,
            "fleet": self.fleet,
            "routes": {m: c.table for m, c in changes.items()},
            "revisions": {m: c.revision for m, c in changes.items()},
        }
        temporary = self.path.with_suffix(".tmp")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with temporary.open("w") as f:
            f.write(json.dumps(data, indent=2, sort_keys=True))
            f.flush()
            os.fsync(f.fileno())
        temporary.replace(self.path)
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
