"""RouterAdmin servicer: RouterAdmin's messages converted to and from `administration`'s calls.

What each call does (who may, what is audited, how a route is validated) is in
`administration.RouterAdministration`; this module only converts messages.
"""

from __future__ import annotations

import time

from services.router.administration import Caller, RouterAdministration
from services.router.admission import Limit
from services.router.router_config import Policy, Route, ShadowSpec, Target
from switchyard.errors import InvalidArgument
from switchyard.field_copy import copy_fields
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
    return copy_fields(rpb.PrincipalLimit, limit, principal_id=principal)


class AdminServicer(rgrpc.RouterAdminServicer):
    def __init__(self, admin: RouterAdministration) -> None:
        self.admin = admin

    async def _caller(self, context: Ctx, resource: str, need_admin: bool) -> Caller:
        metadata = context.invocation_metadata() or ()
        return await self.admin.caller(metadata, context.peer(), resource, need_admin)

    async def ListRoutes(self, request: rpb.ListRoutesRequest, context: Ctx) -> rpb.ListRoutesResponse:
        caller = await self._caller(context, "routes", need_admin=False)
        return rpb.ListRoutesResponse(routes=[route_to_proto(r) for r in self.admin.routes(caller)])

    async def SetRoute(self, request: rpb.SetRouteRequest, context: Ctx) -> rpb.Route:
        caller = await self._caller(context, f"route:{request.route.model}", need_admin=True)
        route = await self.admin.set_route(route_from_proto(request.route), caller)
        return route_to_proto(route)

    async def DeleteRoute(self, request: rpb.DeleteRouteRequest, context: Ctx) -> rpb.DeleteRouteResponse:
        caller = await self._caller(context, f"route:{request.model}", need_admin=True)
        await self.admin.delete_route(request.model, caller)
        return rpb.DeleteRouteResponse()

    async def ListDeployments(
        self, request: rpb.ListDeploymentsRequest, context: Ctx
    ) -> rpb.ListDeploymentsResponse:
        await self._caller(context, "deployments", need_admin=True)  # internal addresses
        now = time.monotonic()
        out = []
        for state, transport in self.admin.deployments():
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
                    transport=transport,
                )
            )
        return rpb.ListDeploymentsResponse(deployments=out)

    async def SetPrincipalLimit(
        self, request: rpb.SetPrincipalLimitRequest, context: Ctx
    ) -> rpb.PrincipalLimit:
        msg = request.limit
        caller = await self._caller(context, f"limit:{msg.principal_id[:200]}", need_admin=True)
        asked = Limit(msg.rate_per_s, msg.burst, msg.max_in_flight)
        now = await self.admin.set_limit(msg.principal_id, asked, request.reset, caller)
        return _limit_msg(msg.principal_id, now)

    async def ListPrincipalLimits(
        self, request: rpb.ListPrincipalLimitsRequest, context: Ctx
    ) -> rpb.ListPrincipalLimitsResponse:
        caller = await self._caller(context, "limits", need_admin=False)
        limits = self.admin.limits
        admin = caller.identity.is_admin()
        mine = caller.identity.principal_id
        return rpb.ListPrincipalLimitsResponse(
            default_limit=_limit_msg("", limits.default),
            # a non-admin sees its own override only: other principals' ids are not its to read
            overrides=[
                _limit_msg(p, lim) for p, lim in sorted(limits.overrides.items()) if admin or p == mine
            ],
            refused=limits.refused if admin else 0,
        )

    async def ShadowReport(self, request: rpb.ShadowReportRequest, context: Ctx) -> rpb.ShadowReportResponse:
        caller = await self._caller(context, "shadow", need_admin=False)
        return rpb.ShadowReportResponse(
            stats=[
                copy_fields(rpb.ShadowStats, s, failures=s.failures + s.skipped)
                for s in self.admin.shadow_stats(caller, request.model)
            ]
        )
