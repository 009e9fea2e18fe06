"""Route changes made through RouterAdmin, kept across restarts.

The routes file is the operator's (often a read-only ConfigMap), so changes made at run time
go to a state file in the router's state directory (its usage spool directory):
`routes-state.json`, holding for each changed model its route as a config-file table, or
null when the route was deleted. At start-up the router applies it over the file's routes;
each kept change is validated against the deployments configured now, and one that no longer
fits (a deployment gone, say) is skipped with a warning rather than stopping the router.
A change is written (temporary file, fsync, rename, fsync of the directory) before it takes
effect, so an acknowledged change survives a crash, and a failed write leaves the route as it
was. Each replica keeps its own file: a change reaches the replica it was sent to.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from services.router.config import Deployment, Route, route_from_table, route_table
from switchyard.errors import SwitchyardError, Unavailable

log = logging.getLogger(__name__)

FILE_NAME = "routes-state.json"
FORMAT = 1


class RouteStore:
    def __init__(self, directory: Path) -> None:
        self.path = directory / FILE_NAME
        self._changes: dict[str, dict[str, Any] | None] = {}

    def apply(self, routes: dict[str, Route], deployments: tuple[Deployment, ...]) -> dict[str, Route]:
        """The file's routes with the kept changes applied (read once, at start-up)."""
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return routes
        except (OSError, ValueError) as exc:
            log.warning("ignoring route changes in %s: unreadable (%s)", self.path, exc)
            return routes
        changes = raw.get("routes") if isinstance(raw, dict) and raw.get("format") == FORMAT else None
        if not isinstance(changes, dict):
            log.warning("ignoring route changes in %s: not a format-%d routes state file", self.path, FORMAT)
            return routes
        out = dict(routes)
        for model, table in changes.items():
            if table is None:
                out.pop(model, None)
                self._changes[model] = None
                continue
            try:
                out[model] = route_from_table(model, table, deployments)
            except SwitchyardError as exc:
                log.warning("skipping the kept change to route %r from %s: %s", model, self.path, exc)
                continue
            self._changes[model] = table
        if self._changes:
            log.info("applied run-time route changes from %s: %s", self.path, sorted(self._changes))
        return out

    def save(self, model: str, route: Route | None) -> None:
        """Records `route` (None: deleted) for `model`; raises Unavailable if it cannot be written."""
        changes = {**self._changes, model: route_table(route) if route is not None else None}
        data = json.dumps({"format": FORMAT, "routes": changes}, indent=2, sort_keys=True)
        temporary = self.path.with_suffix(".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with temporary.open("w") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            temporary.replace(self.path)
            directory = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        except OSError as exc:
            raise Unavailable(
                f"could not save the route change to {self.path} ({exc}); the route is unchanged"
            ) from None
        self._changes = changes
