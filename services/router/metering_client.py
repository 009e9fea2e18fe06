"""gRPC adapter from the router's ports (AuthPort, MeteringSink) to the metering service.

Status codes coming back become switchyard errors here, so the auth cache and the spool
reason about Unavailable / Unauthenticated without importing grpc.
"""

from __future__ import annotations

import json
import logging

import grpc

from services.router.admission import Limit
from services.router.auth import Identity
from services.router.executor_pool import CHANNEL_OPTIONS
from services.router.route_store import Change, RouteChange
from switchyard import errors, telemetry, tls
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as mgrpc

log = logging.getLogger(__name__)

_BY_CODE: dict[grpc.StatusCode, type[errors.SwitchyardError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.ALREADY_EXISTS: errors.AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.UNIMPLEMENTED: errors.Unimplemented,
    grpc.StatusCode.CANCELLED: errors.Unavailable,  # the channel went away under the call
}


def as_error(exc: grpc.aio.AioRpcError) -> errors.SwitchyardError:
    kind = _BY_CODE.get(exc.code(), errors.SwitchyardError)
    return kind(exc.details() or exc.code().name)


class MeteringClient:
    """Authenticate, RecordUsage and AppendAudit over one channel, with short timeouts."""

    def __init__(self, address: str, timeout_s: float = 2.0, security: tls.Security | None = None) -> None:
        self.address = address
        self._timeout = timeout_s
        # with tracing on, each call is a CLIENT span, its trace context in the call's metadata
        self._channel = tls.aio_channel(
            address,
            CHANNEL_OPTIONS,
            security,
            interceptors=telemetry.client_interceptors(),
            expect=tls.METERING,
        )
        self._stub = mgrpc.MeteringStub(self._channel)

    async def authenticate(self, key: str) -> Identity:
        try:
            reply = await self._stub.Authenticate(mpb.AuthenticateRequest(key=key), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            error = as_error(exc)
            if isinstance(error, errors.NotFound | errors.PermissionDenied | errors.InvalidArgument):
                raise errors.Unauthenticated("API key is unknown, revoked or expired") from None
            raise error from None
        p = reply.principal
        return Identity(
            p.principal_id, p.name, p.team, reply.key_id, tuple((r.role, r.scope) for r in reply.roles)
        )

    async def record_usage(self, request: mpb.RecordUsageRequest) -> None:
        if not request.HasField("actor"):
            request.actor.source = "router"
        try:
            await self._stub.RecordUsage(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise as_error(exc) from None

    async def append_audit(self, request: mpb.AppendAuditRequest) -> None:
        try:
            await self._stub.AppendAudit(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise as_error(exc) from None

    async def register_path(self, request: mpb.RegisterPathRequest) -> mpb.PathInfo:
        try:
            reply: mpb.PathInfo = await self._stub.RegisterPath(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise as_error(exc) from None
        return reply

    async def save_route_change(self, change: RouteChange) -> int:
        actor = mpb.Actor(
            principal=change.principal,
            source="router",
            request_id=change.request_id,
            trace_id=telemetry.current_trace_id(),
        )
        table, previous = change.table, change.previous
        saved = mpb.RouteChange(
            fleet=change.fleet,
            model=change.model,
            route_json=json.dumps(table, sort_keys=True) if table is not None else "",
            deleted=table is None,
        )
        request = mpb.SaveRouteChangeRequest(
            change=saved,
            actor=actor,
            previous_json=json.dumps(previous, sort_keys=True) if previous is not None else "",
        )
        try:
            reply = await self._stub.SaveRouteChange(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise as_error(exc) from None
        return reply.revision

    async def route_changes(self, fleet: str) -> dict[str, Change]:
        try:
            reply = await self._stub.ListRouteChanges(
                mpb.ListRouteChangesRequest(fleet=fleet), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as exc:
            raise as_error(exc) from None
        out = {}
        for c in reply.changes:
            try:
                out[c.model] = Change(None if c.deleted else json.loads(c.route_json), c.revision)
            except ValueError as exc:  # metering checks JSON on the way in; a row edited since
                log.warning("skipping route change %d for %r: not JSON (%s)", c.revision, c.model, exc)
        return out

    async def save_limit_change(
        self, fleet: str, principal_id: str, limit: Limit | None, principal: str, request_id: str
    ) -> int:
        actor = mpb.Actor(
            principal=principal, source="router", request_id=request_id, trace_id=telemetry.current_trace_id()
        )
        change = mpb.LimitChange(fleet=fleet, principal_id=principal_id, reset=limit is None)
        if limit is not None:
            change.rate_per_s, change.burst, change.max_in_flight = (
                limit.rate_per_s,
                limit.burst,
                limit.max_in_flight,
            )
        request = mpb.SaveLimitChangeRequest(change=change, actor=actor)
        try:
            reply = await self._stub.SaveLimitChange(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise as_error(exc) from None
        return reply.revision

    async def limit_changes(self, fleet: str) -> dict[str, tuple[Limit | None, int]]:
        try:
            reply = await self._stub.ListLimitChanges(
                mpb.ListLimitChangesRequest(fleet=fleet), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as exc:
            raise as_error(exc) from None
        return {
            c.principal_id: (None if c.reset else Limit(c.rate_per_s, c.burst, c.max_in_flight), c.revision)
            for c in reply.changes
        }

    async def close(self) -> None:
        await self._channel.close()
