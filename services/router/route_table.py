"""The route table: the routes in force, from the routes file and the fleet's run-time changes.

The file's routes are the base; RouterAdmin changes are kept and shared first
(`route_store.RouteStore`: on disk and, for a fleet, in metering) and only then applied, so a
change that cannot be kept is refused. Each router polls for its fleet's newer changes every
`route_sync_s`. Applying is copy-on-write: requests already running keep the route object they
started with. Whenever the table changes, the deployments it sends to are registered with
metering as ledger paths (`path_registrar.PathRegistrar`).
"""

from __future__ import annotations

import logging

from services.router.fleet_sync import FleetPoller
from services.router.path_registrar import PathRegistrar
from services.router.route_store import RouteStore
from services.router.router_config import Deployment, Route
from switchyard.errors import NotFound

log = logging.getLogger(__name__)


class RouteTable:
    def __init__(
        self,
        file_routes: tuple[Route, ...],
        deployments: tuple[Deployment, ...],
        store: RouteStore,
        registrar: PathRegistrar | None = None,
    ) -> None:
        self.store = store
        self.registrar = registrar
        self._file_routes = {r.model: r for r in file_routes}
        self.deployments = deployments
        self.routes: dict[str, Route] = {}
        self.poller = FleetPoller(self.sync, "route changes")  # started by the router's assembly
        self._apply()

    def route_for(self, model: str) -> Route:
        route = self.routes.get(model)
        if route is None:
            raise NotFound(f"unknown model {model!r}; the router serves {sorted(self.routes)}")
        return route

    def _apply(self) -> None:
        """The routes in force: the file's, with the run-time changes kept (and shared) since."""
        self.routes = self.store.routes(self._file_routes, self.deployments)
        if self.registrar is not None:  # the paths the routes now send to, registered with metering
            self.registrar.want_routes(self.routes.values())

    async def set_route(self, route: Route, principal: str = "", request_id: str = "") -> None:
        """Adds or replaces a (validated) route; kept and shared first, so a change that cannot
        be kept is refused (`route_store`)."""
        await self.store.save(route.model, route, self.routes.get(route.model), principal, request_id)
        self._apply()

    async def delete_route(self, model: str, principal: str = "", request_id: str = "") -> None:
        old = self.route_for(model)  # NOT_FOUND before anything is kept
        await self.store.save(model, None, old, principal, request_id)
        self._apply()

    async def sync(self) -> None:
        """Applies the fleet's newer route changes; raises Unavailable while metering is down."""
        if await self.store.sync():
            self._apply()
            log.info("applied the fleet's route changes: %d routes now", len(self.routes))

    async def close(self) -> None:
        await self.poller.close()
        if self.registrar is not None:
            await self.registrar.close()
