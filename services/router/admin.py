"""RouterAdmin servicer: routes read and changed at run time, every change audited.

Changing a route needs a key with role `admin`; reading needs any valid key. A route is
validated whole (the same rules as the config file) before it replaces the old one. A denied
attempt is audited by the router; a change by metering, in the transaction that saves it for
the fleet (`route_store`), with the old and the new route as detail.
"""

from __future__ import annotations

import json
import time

from services.router.auth import Identity
from services.router.config import Policy, Route, ShadowSpec, Target, validate_route
from services.router.forward import Router
from services.router.limits import Limit
from switchyard import ids
from switchyard.errors import InvalidArgument, PermissionDenied
from switchyard.gen.switchyard.v1 import router_pb2 as rpb
from switchyard.gen.switchyard.v1 import router_pb2_grpc as rgrpc
from switchyard.grpcio import ServicerContext as Ctx


def _target_from(msg: rpb.Target) -> Target:
    return Target(msg.deployment, msg.model, msg.version, msg.weight or 1.0)


def route_from_proto(msg: rpb.Route) -> Route:
    try:
        policy = Policy(msg.policy or "failover")
    except ValueError:
        raise InvalidArgument(
            f"unknown policy {msg.policy!r}; use one of {[p.value for p in Policy]}"
        ) from None
    shadow = None
    if msg.HasField("shadow") and (msg.shadow.candidates or msg.shadow.share):
        shadow = ShadowSpec(msg.shadow.share, tuple(_target_from(c) for c in msg.shadow.candidates))
    return Route(msg.model, policy, tuple(_target_from(t) for t in msg.targets), shadow, msg.max_in_flight)


def _target_to(t: Target) -> rpb.Target:
    return rpb.Target(deployment=t.deployment, model=t.model, version=t.version, weight=t.weight)


def route_to_proto(route: Route) -> rpb.Route:
    msg = rpb.Route(
        model=route.model,
        policy=route.policy.value,
        max_in_flight=route.max_in_flight,
        targets=[_target_to(t) for t in route.targets],
    )
    if route.shadow is not None:
        msg.shadow.share = route.shadow.share
        msg.shadow.candidates.extend(_target_to(c) for c in route.shadow.candidates)
    return msg


def _limit_msg(principal: str, limit: Limit) -> rpb.PrincipalLimit:
    return rpb.PrincipalLimit(
        principal_id=principal,
        rate_per_s=limit.rate_per_s,
        burst=limit.burst,
        max_in_flight=limit.max_in_flight,
    )


class AdminServicer(rgrpc.RouterAdminServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    async def _caller(self, context: Ctx, resource: str, need_admin: bool) -> tuple[Identity, str]:
        request_id = ids.time_ordered_hex()
        identity = await self.router.identify(
            context.invocation_metadata() or (), resource, request_id, context.peer()
        )
        if need_admin and not identity.is_admin():
            reason = f"principal {identity.name!r} lacks role `admin` (scope *) needed to change routes"
            self.router.audit_denial(
                identity, resource, reason, "PERMISSION_DENIED", request_id, context.peer()
            )
            raise PermissionDenied(reason)
        return identity, request_id

    async def ListRoutes(self, request: rpb.ListRoutesRequest, context: Ctx) -> rpb.ListRoutesResponse:
        await self._caller(context, "routes", need_admin=False)
        routes = sorted(self.router.routes.values(), key=lambda r: r.model)
        return rpb.ListRoutesResponse(routes=[route_to_proto(r) for r in routes])

    async def SetRoute(self, request: rpb.SetRouteRequest, context: Ctx) -> rpb.Route:
        identity, request_id = await self._caller(context, f"route:{request.route.model}", need_admin=True)
        route = validate_route(route_from_proto(request.route), self.router.config.deployments)
        await self.router.set_route(route, identity.principal_id, request_id)
        return route_to_proto(route)

    async def DeleteRoute(self, request: rpb.DeleteRouteRequest, context: Ctx) -> rpb.DeleteRouteResponse:
        identity, request_id = await self._caller(context, f"route:{request.model}", need_admin=True)
        await self.router.delete_route(request.model, identity.principal_id, request_id)
        return rpb.DeleteRouteResponse()

    async def ListDeployments(
        self, request: rpb.ListDeploymentsRequest, context: Ctx
    ) -> rpb.ListDeploymentsResponse:
        await self._caller(context, "deployments", need_admin=False)
        now = time.monotonic()
        out = []
        for state in self.router.pool.states.values():
            d = state.deployment
            out.append(
                rpb.DeploymentState(
                    name=d.name,
                    address=d.address,
                    path=d.path,
                    healthy=state.admitted(),
                    ejected_for_s=max(0.0, state.ejected_until - now),
                    ejections=state.ejections,
                    last_error=state.last_error,
                    in_flight=state.in_flight,
                    queue_depth=state.queue_depth,
                    service_time_us=state.service_time_us,
                    price_micros_per_hour=d.price_micros_per_hour,
                    transport=self.router.pool.transport(d.name),
                )
            )
        return rpb.ListDeploymentsResponse(deployments=out)

    async def SetPrincipalLimit(
        self, request: rpb.SetPrincipalLimitRequest, context: Ctx
    ) -> rpb.PrincipalLimit:
        msg = request.limit
        identity, request_id = await self._caller(context, f"limit:{msg.principal_id[:200]}", need_admin=True)
        if not msg.principal_id or len(msg.principal_id) > 200:
            raise InvalidArgument("limit.principal_id must name a principal (1..200 characters)")
        if msg.rate_per_s < 0 or msg.burst < 0 or msg.max_in_flight < 0:
            raise InvalidArgument("limits must be >= 0 (0 = unlimited)")
        limits = self.router.limits
        limit = None if request.reset else Limit(msg.rate_per_s, msg.burst, msg.max_in_flight)
        limits.set(msg.principal_id, limit)
        now = limits.limit_for(msg.principal_id)
        detail = json.dumps(
            {
                "rate_per_s": now.rate_per_s,
                "burst": now.burst,
                "max_in_flight": now.max_in_flight,
                "reset": request.reset,
            }
        )
        self.router.audit(
            identity, "limit.set", f"principal/{msg.principal_id}", "ok", detail, request_id, context.peer()
        )
        return _limit_msg(msg.principal_id, now)

    async def ListPrincipalLimits(
        self, request: rpb.ListPrincipalLimitsRequest, context: Ctx
    ) -> rpb.ListPrincipalLimitsResponse:
        await self._caller(context, "limits", need_admin=False)
        limits = self.router.limits
        return rpb.ListPrincipalLimitsResponse(
            default_limit=_limit_msg("", limits.default),
            overrides=[_limit_msg(p, lim) for p, lim in sorted(limits.overrides.items())],
            refused=limits.refused,
        )

    async def ShadowReport(self, request: rpb.ShadowReportRequest, context: Ctx) -> rpb.ShadowReportResponse:
        await self._caller(context, "shadow", need_admin=False)
        stats = [
            s
            for (model, _), s in sorted(self.router.shadow_stats.items())
            if not request.model or model == request.model
        ]
        return rpb.ShadowReportResponse(
            stats=[
                rpb.ShadowStats(
                    model=s.model,
                    candidate=s.candidate,
                    pairs=s.pairs,
                    failures=s.failures + s.skipped,
                    diverged=s.diverged,
                    max_abs_error=s.max_abs_error,
                    mean_max_abs_error=s.mean_max_abs_error,
                    min_cosine=s.min_cosine,
                    comparer=s.comparer,
                )
                for s in stats
            ]
        )
