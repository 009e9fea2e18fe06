"""What RouterAdmin does, without its messages: routes, deployments, principal limits, shadow report.

Changing the router (a route, a principal's limit) and listing its deployments (internal
addresses) need a key with role `admin`; the other reads need a valid key and show only what
its roles cover (routes and shadow statistics it may infer with, its own limit override). A
denied attempt is audited by admission; a route change by metering, in the transaction that
saves it for the fleet (`route_store`), with the old and the new route as detail; a limit
change likewise when metering shares it with the fleet (`fleet_limits`), else here. A route
is validated whole (the same rules as the routes file) before it replaces the old one.
`admin_servicer` converts RouterAdmin's messages to and from these calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from services.router import ids
from services.router.admission import Limit, Metadata, PrincipalLimits
from services.router.auth import Identity
from services.router.fleet_limits import FleetLimits
from services.router.policies import DeploymentState
from services.router.request_path import RequestPath
from services.router.router_config import Route, validate_route
from services.router.shadow_divergence import ShadowStats
from switchyard.errors import InvalidArgument

MAX_PRINCIPAL_ID = 200


@dataclass(frozen=True)
class Caller:
    """Who asks, where from, and the id their request is audited under."""

    identity: Identity
    request_id: str
    peer: str


class RouterAdministration:
    def __init__(self, path: RequestPath, fleet_limits: FleetLimits | None = None) -> None:
        self.path = path
        # limits set here: for the fleet through metering, else on this router only
        self.fleet_limits = fleet_limits or FleetLimits(path.admission.limits)

    @property
    def limits(self) -> PrincipalLimits:
        return self.path.admission.limits

    async def caller(self, metadata: Metadata, peer: str, resource: str, need_admin: bool) -> Caller:
        request_id = ids.time_ordered_hex()
        identity = await self.path.admission.identify(metadata, resource, request_id, peer)
        if need_admin:
            self.path.admission.require_admin(identity, resource, request_id, peer)
        return Caller(identity, request_id, peer)

    def routes(self, caller: Caller) -> list[Route]:
        """The routes the caller's roles cover (every route, for an admin)."""
        visible = set(self.path.admission.visible_models(caller.identity, self.path.routes))
        return sorted((r for r in self.path.routes.values() if r.model in visible), key=lambda r: r.model)

    async def set_route(self, route: Route, caller: Caller) -> Route:
        route = validate_route(route, self.path.table.deployments)
        await self.path.table.set_route(route, caller.identity.principal_id, caller.request_id)
        return route

    async def delete_route(self, model: str, caller: Caller) -> None:
        await self.path.table.delete_route(model, caller.identity.principal_id, caller.request_id)

    def deployments(self) -> list[tuple[DeploymentState, str]]:
        """Each deployment's state, with how requests reach it now ("frames" or "grpc")."""
        pool = self.path.pool
        return [(state, pool.transport(state.deployment.name)) for state in pool.states.values()]

    async def set_limit(self, principal: str, limit: Limit, reset: bool, caller: Caller) -> Limit:
        """Overrides one principal's limits (`reset`: back to the defaults) on every router of
        the fleet, through metering (`fleet_limits`), else on this router; audited either way.
        Returns the limits now in force for it."""
        if not principal or len(principal) > MAX_PRINCIPAL_ID:
            raise InvalidArgument(
                f"limit.principal_id must name a principal (1..{MAX_PRINCIPAL_ID} characters)"
            )
        if limit.rate_per_s < 0 or limit.burst < 0 or limit.max_in_flight < 0:
            raise InvalidArgument("limits must be >= 0 (0 = unlimited)")
        shared = await self.fleet_limits.set(
            principal, None if reset else limit, caller.identity.principal_id, caller.request_id
        )
        now = self.limits.limit_for(principal)
        if shared:
            return now  # audited by metering, in the transaction that saved it
        detail = json.dumps(
            {
                "rate_per_s": now.rate_per_s,
                "burst": now.burst,
                "max_in_flight": now.max_in_flight,
                "reset": reset,
            }
        )
        self.path.admission.audit(
            caller.identity,
            "limit.set",
            f"principal/{principal}",
            "ok",
            detail,
            caller.request_id,
            caller.peer,
        )
        return now

    def shadow_stats(self, caller: Caller, model: str = "") -> list[ShadowStats]:
        """The shadow statistics per route and candidate (of one route, when `model` is given),
        of the routes the caller's roles cover."""
        stats = sorted(self.path.mirror.stats.items())
        visible = set(self.path.admission.visible_models(caller.identity, {m for (m, _), _ in stats}))
        return [s for (m, _), s in stats if m in visible and (not model or m == model)]
