"""The Metering gRPC servicer: an adapter from messages to the Ledger and back.

Ledger calls block on the database, so they run in threads: writes on one thread (in-process
writers queue here rather than contend for SQLite's lock; batching gives the throughput),
reads on a small pool so reports never wait behind a write.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from services.metering.authorize import Authorized, Authorizer
from services.metering.guard import bearer
from services.metering.ledger import Ledger
from services.metering.metering_errors import BadInput
from services.metering.metering_metrics import MeteringStats
from services.metering.records import Actor, UsageEvent
from services.metering.usage import check_batch
from switchyard import authz, telemetry, tls
from switchyard.errors import PermissionDenied
from switchyard.gen.switchyard.v1 import metering_pb2 as pb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as pb_grpc

T = TypeVar("T")
MAX_BATCH = 50_000
MAX_AUDIT_LIMIT = 10_000


def trace_id_of(context: Any) -> str:
    """The caller's trace id from its W3C `traceparent` metadata (00-<trace id>-<span id>-<flags>)."""
    for key, value in (context.invocation_metadata() or ()) if context is not None else ():
        if key == "traceparent":
            parts = (value.decode() if isinstance(value, bytes) else value).split("-")
            if len(parts) == 4 and len(parts[1]) == 32:
                return parts[1]
    return telemetry.current_trace_id()


MAX_ACTION = 64
MAX_DETAIL_JSON = 8192


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
    return pb.Price(
        price_key=r.price_key,
        micros_per_hour=r.micros_per_hour,
        currency=r.currency,
        effective_from_unix_us=r.effective_from_us,
        version=r.version,
    )


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


class MeteringServicer(pb_grpc.MeteringServicer):
    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.stats = (
            MeteringStats()
        )  # read by the Prometheus collector (services/metering/metering_metrics.py)
        self.authorizer = Authorizer(ledger)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ledger-write")
        self._readers = ThreadPoolExecutor(4, thread_name_prefix="ledger-read")

    def write_queue_depth(self) -> int:
        return self._writer._work_queue.qsize()  # calls waiting behind the one being written

    def shutdown(self) -> None:
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)

    # The call's context (its trace span) goes along into the worker thread.
    async def _w(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(
            self._writer, contextvars.copy_context().run, fn
        )

    async def _r(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(
            self._readers, contextvars.copy_context().run, fn
        )

    async def RecordUsage(self, request: pb.RecordUsageRequest, context: Any) -> pb.RecordUsageResponse:
        if len(request.events) > MAX_BATCH:
            raise BadInput(f"batch of {len(request.events)} events; send at most {MAX_BATCH} per call")
        # Checked here (pure CPU work: validation, content digests), so that it overlaps the
        # writer thread's database work on the batch before instead of queueing behind it.
        batch = check_batch([event_of(e) for e in request.events])
        result = await self._w(lambda: self.ledger.record_usage(batch))
        self.stats.ingested(
            (e.ended_unix_us for e in request.events), result.accepted, result.duplicates, result.unpriced
        )
        return pb.RecordUsageResponse(
            accepted=result.accepted, duplicates=result.duplicates, unpriced=result.unpriced
        )

    async def ReverseUsage(self, request: pb.ReverseUsageRequest, context: Any) -> pb.ReverseUsageResponse:
        r = request
        row, duplicate = await self._w(
            lambda: self.ledger.reverse_usage(
                actor_of(r.actor, context), r.idempotency_key, r.reverses_key, r.reason
            )
        )
        return pb.ReverseUsageResponse(
            amount_micros=row.amount_micros or 0, currency=row.currency or "", duplicate=duplicate
        )

    async def OpenReservation(self, request: pb.OpenReservationRequest, context: Any) -> pb.Reservation:
        r = request
        res = await self._w(
            lambda: self.ledger.open_reservation(
                actor_of(r.actor, context), r.idempotency_key, r.path, r.start_unix_us, r.trial_id
            )
        )
        return reservation_msg(res)

    async def CloseReservation(self, request: pb.CloseReservationRequest, context: Any) -> pb.Reservation:
        r = request
        res = await self._w(
            lambda: self.ledger.close_reservation(actor_of(r.actor, context), r.reservation_id, r.end_unix_us)
        )
        return reservation_msg(res)

    async def CompleteJob(self, request: pb.CompleteJobRequest, context: Any) -> pb.Job:
        r = request
        job = await self._w(
            lambda: self.ledger.complete_job(
                r.job_id,
                r.path,
                r.model,
                r.team,
                r.status,
                r.met_quality,
                r.trial_id,
                r.prepare_us,
                r.ended_unix_us,
            )
        )
        return pb.Job(
            job_id=job.job_id,
            path=job.path,
            model=job.model,
            team=job.team,
            status=job.status,
            met_quality=job.met_quality,
            trial_id=job.trial_id,
            ended_unix_us=job.ended_us,
        )

    async def GetJobCost(self, request: pb.GetJobCostRequest, context: Any) -> pb.JobCost:
        cost = await self._r(lambda: self.ledger.job_cost(request.job_id))
        lines = [
            pb.CostLine(
                basis=ln.basis,
                amount_micros=ln.amount_micros or 0,
                currency=ln.currency or "",
                price_version=ln.price_version,
                method=ln.method,
            )
            for ln in cost.lines
        ]
        return pb.JobCost(
            job_id=cost.job.job_id,
            total_micros=cost.total_micros,
            currency=cost.currency,
            lines=lines,
            unpriced=cost.unpriced,
            path=cost.job.path,
            status=cost.job.status,
            met_quality=cost.job.met_quality,
        )

    async def CostReport(self, request: pb.CostReportRequest, context: Any) -> pb.CostReportResponse:
        r = request
        rows = await self._r(
            lambda: self.ledger.cost_report(list(r.group_by), r.since_unix_us, r.until_unix_us, r.trial_id)
        )
        return pb.CostReportResponse(
            rows=[
                pb.CostRow(
                    group=row.group,
                    total_micros=row.total_micros,
                    busy_micros=row.busy_micros,
                    idle_micros=row.idle_micros,
                    prepare_micros=row.prepare_micros,
                    jobs_completed=row.jobs_completed,
                    jobs_failed=row.jobs_failed,
                    cost_per_completed_job_micros=row.cost_per_completed_job_micros,
                    unpriced_events=row.unpriced_events,
                    currency=row.currency,
                    jobs_total=row.jobs_total,
                    prompt_tokens=row.prompt_tokens,
                    output_tokens=row.output_tokens,
                    generation_micros=row.generation_micros,
                    generation_jobs_completed=row.generation_jobs_completed,
                    generation_jobs_total=row.generation_jobs_total,
                    cost_per_completed_generation_job_micros=row.cost_per_completed_generation_job_micros,
                    cost_per_million_output_tokens_micros=row.cost_per_million_output_tokens_micros,
                    cost_per_million_prompt_tokens_micros=row.cost_per_million_prompt_tokens_micros,
                )
                for row in rows
            ]
        )

    async def Export(self, request: pb.ExportRequest, context: Any) -> AsyncIterator[pb.ExportChunk]:
        chunks = self.ledger.export(request.format, request.since_unix_us, request.until_unix_us)
        done = object()
        while True:
            chunk = await self._r(lambda: next(chunks, done))
            if chunk is done:
                return
            assert isinstance(chunk, bytes)
            yield pb.ExportChunk(data=chunk)

    async def SetPrice(self, request: pb.SetPriceRequest, context: Any) -> pb.Price:
        r = request
        row = await self._w(
            lambda: self.ledger.set_price(
                actor_of(r.actor, context),
                r.price_key,
                r.micros_per_hour,
                r.currency,
                r.effective_from_unix_us,
            )
        )
        return price_msg(row)

    async def RegisterPath(self, request: pb.RegisterPathRequest, context: Any) -> pb.PathInfo:
        r = request
        row = await self._w(
            lambda: self.ledger.register_path(
                actor_of(r.actor, context), r.path, r.backend, r.resource_class, r.price_key, r.host
            )
        )
        return pb.PathInfo(
            path=row.path,
            backend=row.backend,
            resource_class=row.resource_class,
            price_key=row.price_key,
            host=row.host,
        )

    async def ListPaths(self, request: pb.ListPathsRequest, context: Any) -> pb.ListPathsResponse:
        rows = await self._r(self.ledger.list_paths)
        return pb.ListPathsResponse(
            paths=[
                pb.PathInfo(
                    path=r.path,
                    backend=r.backend,
                    resource_class=r.resource_class,
                    price_key=r.price_key,
                    host=r.host,
                    priced=priced,
                    created_unix_us=r.created_us,
                )
                for r, priced in rows
            ]
        )

    async def RecordTrial(self, request: pb.RecordTrialRequest, context: Any) -> pb.RecordTrialResponse:
        r = request
        await self._w(
            lambda: self.ledger.record_trial(
                actor_of(r.actor, context),
                r.trial_id,
                r.workflow_id,
                r.model,
                r.status,
                r.spec_json,
                r.report_json,
                dict(r.verdicts),
            )
        )
        return pb.RecordTrialResponse()

    async def GetTrialReport(self, request: pb.GetTrialReportRequest, context: Any) -> pb.TrialReport:
        row = await self._r(lambda: self.ledger.trial(request.trial_id))
        return pb.TrialReport(
            trial_id=row.trial_id,
            status=row.status,
            report_json=row.report_json,
            verdicts=json.loads(row.verdicts_json or "{}"),
        )

    async def SaveRouteChange(self, request: pb.SaveRouteChangeRequest, context: Any) -> pb.RouteChange:
        r = request
        if r.deleted == bool(r.route_json):
            raise BadInput("give route_json for a changed route, or deleted = true (and no route_json)")
        row = await self._w(
            lambda: self.ledger.save_route_change(
                actor_of(r.actor, context),
                r.fleet,
                r.model,
                None if r.deleted else r.route_json,
                r.previous_json,
            )
        )
        return route_change_msg(row)

    async def ListRouteChanges(
        self, request: pb.ListRouteChangesRequest, context: Any
    ) -> pb.ListRouteChangesResponse:
        rows = await self._r(lambda: self.ledger.route_changes(request.fleet))
        return pb.ListRouteChangesResponse(changes=[route_change_msg(r) for r in rows])

    async def CreatePrincipal(self, request: pb.CreatePrincipalRequest, context: Any) -> pb.Principal:
        r = request
        who = await self._w(
            lambda: self.ledger.create_principal(actor_of(r.actor, context), r.name, r.kind, r.team)
        )
        return pb.Principal(principal_id=who.principal_id, name=who.name, kind=who.kind, team=who.team)

    async def CreateKey(self, request: pb.CreateKeyRequest, context: Any) -> pb.CreateKeyResponse:
        r = request
        key = await self._w(
            lambda: self.ledger.create_key(actor_of(r.actor, context), r.principal, r.expires_unix_us)
        )
        return pb.CreateKeyResponse(
            key_id=key.key_id, secret=key.secret, key=key.key, expires_unix_us=key.expires_us
        )

    async def RevokeKey(self, request: pb.RevokeKeyRequest, context: Any) -> pb.RevokeKeyResponse:
        await self._w(lambda: self.ledger.revoke_key(actor_of(request.actor, context), request.key_id))
        return pb.RevokeKeyResponse()

    async def GrantRole(self, request: pb.RoleRequest, context: Any) -> pb.RoleResponse:
        r = request
        await self._w(
            lambda: self.ledger.grant_role(actor_of(r.actor, context), r.principal, r.role, r.scope)
        )
        return pb.RoleResponse()

    async def RevokeRole(self, request: pb.RoleRequest, context: Any) -> pb.RoleResponse:
        r = request
        await self._w(
            lambda: self.ledger.revoke_role(actor_of(r.actor, context), r.principal, r.role, r.scope)
        )
        return pb.RoleResponse()

    async def Authenticate(self, request: pb.AuthenticateRequest, context: Any) -> pb.AuthenticateResponse:
        peer = Actor(source=authz.cap(str(context.peer())), trace_id=trace_id_of(context))
        key = request.key[: authz.MAX_AUDIT_STRING]  # a real key is far shorter; its id is audited
        ident = await self._r(lambda: self.ledger.authenticate(key, peer))
        p = ident.principal
        return pb.AuthenticateResponse(
            principal=pb.Principal(principal_id=p.principal_id, name=p.name, kind=p.kind, team=p.team),
            roles=[pb.RoleBinding(role=role, scope=scope) for role, scope in ident.roles],
            key_id=ident.key_id,
        )

    async def Authorize(self, request: pb.AuthorizeRequest, context: Any) -> pb.AuthorizeResponse:
        r = request
        caller = authz.CALLER.get()
        operator = caller is not None and not caller.insecure and caller.service == tls.OPERATOR
        action = authz.cap(r.action or "authorize", MAX_ACTION)
        actor = actor_of(r.actor, context)
        key = bearer(context)
        done = await self._w(
            lambda: self.authorizer.authorize(
                key, operator, list(r.roles), r.scope, action, r.resource, r.grant_subject, actor
            )
        )
        return _authorized(done)

    async def VerifyGrant(self, request: pb.VerifyGrantRequest, context: Any) -> pb.AuthorizeResponse:
        r = request
        action = authz.cap(r.action or "grant.verify", MAX_ACTION)
        actor = actor_of(pb.Actor(source="trial worker"), context)
        done = await self._w(
            lambda: self.authorizer.verify(
                r.grant, r.subject, list(r.roles), r.scope, action, r.resource, actor
            )
        )
        return _authorized(done)

    async def AppendAudit(self, request: pb.AppendAuditRequest, context: Any) -> pb.AuditRecord:
        r = request
        if not r.action:
            raise BadInput("action is empty; name what happened, e.g. request.denied")
        if len(r.action) > MAX_ACTION:
            raise BadInput(f"action is {len(r.action)} characters; at most {MAX_ACTION}")
        if len(r.detail_json) > MAX_DETAIL_JSON:
            raise BadInput(f"detail_json is {len(r.detail_json)} characters; at most {MAX_DETAIL_JSON}")
        caller = authz.CALLER.get()
        refusal = (r.action, r.outcome) == ("rpc.denied", "denied")
        if caller is not None and caller.service in ("executor", "evaluator") and not refusal:
            reason = f"{caller.identity} may append only its refusals (rpc.denied, denied)"
            actor = Actor(authz.cap(caller.identity), authz.cap(f"metering {caller.peer}"))
            detail_of = {"status": "PERMISSION_DENIED", "reason": reason}
            await self._w(
                lambda: self.ledger.append_audit(
                    actor, "rpc.denied", "/switchyard.v1.Metering/AppendAudit", "denied", detail_of
                )
            )
            raise PermissionDenied(reason)
        if r.outcome not in ("ok", "denied", "failed"):
            raise BadInput(f"outcome {r.outcome!r} is not ok, denied or failed")
        try:
            detail = json.loads(r.detail_json) if r.detail_json else {}
        except ValueError as exc:
            raise BadInput(f"detail_json is not valid JSON: {exc}") from None
        if not isinstance(detail, dict):
            raise BadInput("detail_json must be a JSON object")
        rec = await self._w(
            lambda: self.ledger.append_audit(
                actor_of(r.actor, context), r.action, authz.cap(r.resource), r.outcome, detail
            )
        )
        return audit_msg(rec)

    async def QueryAudit(self, request: pb.QueryAuditRequest, context: Any) -> pb.QueryAuditResponse:
        r = request
        if r.limit < 0 or r.limit > MAX_AUDIT_LIMIT:
            raise BadInput(f"limit {r.limit} is outside 0..{MAX_AUDIT_LIMIT} (0 = 100)")
        recs = await self._r(
            lambda: self.ledger.query_audit(
                r.action, r.principal, r.since_unix_us, r.until_unix_us, r.limit or 100
            )
        )
        return pb.QueryAuditResponse(records=[audit_msg(x) for x in recs])

    async def VerifyAudit(self, request: pb.VerifyAuditRequest, context: Any) -> pb.VerifyAuditResponse:
        v = await self._r(self.ledger.verify_audit)
        return pb.VerifyAuditResponse(
            ok=v.ok, rows_checked=v.rows_checked, first_broken_seq=v.first_broken_seq, problem=v.problem
        )


def _authorized(done: Authorized) -> pb.AuthorizeResponse:
    p = done.principal
    return pb.AuthorizeResponse(
        principal=pb.Principal(principal_id=p.principal_id, name=p.name, kind=p.kind, team=p.team),
        grant=done.grant,
        expires_unix_us=done.expires_us,
    )
