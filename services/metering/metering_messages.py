"""Metering's messages to and from the domain's records: actors, usage events, reservations,
prices, audit rows, route changes, authorizations.
"""

from __future__ import annotations

from typing import Any

from services.metering.authorize import Authorized
from services.metering.records import Actor, UsageEvent
from switchyard import authz, telemetry
from switchyard.field_copy import copy_fields
from switchyard.gen.switchyard.v1 import metering_pb2 as pb


def trace_id_of(context: Any) -> str:
    """The caller's trace id from its `traceparent` metadata, else the current span's."""
    metadata = context.invocation_metadata() if context is not None else ()
    return telemetry.trace_id_of_metadata(metadata) or telemetry.current_trace_id()


def actor_of(msg: pb.Actor, context: Any = None) -> Actor:
    """Who acts, for the audit trail: the identity the call authenticated (its certificate, or
    the principal of its API key), with the principal the caller named kept as "on behalf of";
    what the caller said only where metering is explicitly insecure. The trace id comes from
    the call's trace context when the caller did not name one, so audit rows join up with
    traces. Every string is capped."""
    cap = authz.cap
    trace = cap(msg.trace_id or trace_id_of(context), 64)
    caller = authz.CALLER.get()
    if caller is None or caller.insecure:
        return Actor(cap(msg.principal), cap(msg.source), cap(msg.request_id, 128), trace)
    named = msg.principal if msg.principal != caller.actor else ""
    source = f"{msg.source} ({caller.identity})" if caller.principal else msg.source or caller.identity
    return Actor(cap(caller.actor), cap(source), cap(msg.request_id, 128), trace, cap(named))


def event_of(e: pb.UsageEvent) -> UsageEvent:
    return UsageEvent(
        e.idempotency_key,
        e.path,
        e.model,
        e.model_version,
        e.team,
        e.principal,
        e.job_id,
        e.kind or "request",
        e.status,
        e.met_quality,
        e.busy_us,
        e.started_unix_us,
        e.ended_unix_us,
        e.trial_id,
        e.arm,
        tuple(sorted(e.tags.items())) if e.tags else (),
        e.reservation_id,
        e.prompt_tokens,
        e.output_tokens,
    )


def reservation_msg(r: Any) -> pb.Reservation:
    return pb.Reservation(
        reservation_id=r.reservation_id,
        path=r.path,
        start_unix_us=r.start_us,
        end_unix_us=r.end_us or 0,
        cost_micros=r.cost_micros or 0,
        idle_micros=r.idle_micros or 0,
        currency=r.currency or "",
        state=r.state,
        trial_id=r.trial_id,
        price_version=r.price_version,
        unpriced=r.state == "closed" and r.cost_micros is None,
    )


def price_msg(r: Any) -> pb.Price:
    return copy_fields(pb.Price, r, effective_from_unix_us=r.effective_from_us)


def audit_msg(r: Any) -> pb.AuditRecord:
    a = r.actor
    return pb.AuditRecord(
        seq=r.seq,
        at_unix_us=r.at_us,
        actor=pb.Actor(principal=a.principal, source=a.source, request_id=a.request_id, trace_id=a.trace_id),
        action=r.action,
        resource=r.resource,
        outcome=r.outcome,
        detail_json=r.detail_json,
        prev_hash=r.prev_hash,
        hash=r.hash,
    )


def route_change_msg(r: Any) -> pb.RouteChange:
    return pb.RouteChange(
        fleet=r.fleet,
        model=r.model,
        route_json=r.route_json or "",
        deleted=r.route_json is None,
        revision=r.id,
        changed_unix_us=r.changed_us,
        principal=r.principal,
    )


def limit_change_msg(r: Any) -> pb.LimitChange:
    return copy_fields(pb.LimitChange, r, revision=r.id, changed_unix_us=r.changed_us)


def authorized_msg(done: Authorized) -> pb.AuthorizeResponse:
    p = done.principal
    return pb.AuthorizeResponse(
        principal=pb.Principal(principal_id=p.principal_id, name=p.name, kind=p.kind, team=p.team),
        grant=done.grant,
        expires_unix_us=done.expires_us,
    )


def path_msg(r: Any, priced: bool = False, created_unix_us: int = 0) -> pb.PathInfo:
    """A registered path; `priced` and its creation time where the caller lists paths."""
    return copy_fields(pb.PathInfo, r, priced=priced, created_unix_us=created_unix_us)
