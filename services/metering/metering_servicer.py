"""The Metering gRPC servicer: an adapter from messages to the Ledger and back.

Ledger calls block on the database, so they run in threads (services/metering/ledger_calls.py).
"""

from __future__ import annotations

from typing import Any

from google.protobuf.message import Message

from services.metering.access_rpcs import AccessRpcs
from services.metering.jobs import TrialUpdate
from services.metering.limit_changes import PrincipalLimit
from services.metering.metering_errors import BadInput
from services.metering.metering_messages import (
    actor_of,
    event_of,
    limit_change_msg,
    path_msg,
    price_msg,
    reservation_msg,
    route_change_msg,
)
from services.metering.records import JobInfo
from services.metering.report_rpcs import ReportRpcs
from services.metering.usage import check_batch
from switchyard.field_copy import copy_fields
from switchyard.gen.switchyard.v1 import metering_pb2 as pb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as pb_grpc

MAX_BATCH = 50_000


class MeteringServicer(AccessRpcs, ReportRpcs, pb_grpc.MeteringServicer):
    """The Metering service: the writes of usage, reservations, jobs, prices, paths, trials and
    route and limit changes here; access, authorization and audit in AccessRpcs, the reads in ReportRpcs."""

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
        ended = _required(request, "job", "the Job that ended (job_id, path, status, ...)")
        info = copy_fields(JobInfo, ended, ended_us=ended.ended_unix_us)
        job = await self._w(lambda: self.ledger.complete_job(info, request.prepare_us))
        return copy_fields(pb.Job, job, ended_unix_us=job.ended_us)

    async def SetPrice(self, request: pb.SetPriceRequest, context: Any) -> pb.Price:
        p = _required(request, "price", "the Price to set (price_key, micros_per_hour, currency)")
        row = await self._w(
            lambda: self.ledger.set_price(
                actor_of(request.actor, context),
                p.price_key,
                p.micros_per_hour,
                p.currency,
                p.effective_from_unix_us,
                p.example,
            )
        )
        return price_msg(row)

    async def RegisterPath(self, request: pb.RegisterPathRequest, context: Any) -> pb.PathInfo:
        p = _required(
            request, "path_info", "the PathInfo to register (path, backend, resource_class, price_key, host)"
        )
        row = await self._w(
            lambda: self.ledger.register_path(
                actor_of(request.actor, context), p.path, p.backend, p.resource_class, p.price_key, p.host
            )
        )
        return path_msg(row)

    async def RecordTrial(self, request: pb.RecordTrialRequest, context: Any) -> pb.RecordTrialResponse:
        r = request
        await self._w(
            lambda: self.ledger.record_trial(
                actor_of(r.actor, context),
                TrialUpdate(
                    r.trial_id, r.workflow_id, r.model, r.status, r.spec_json, r.report_json, dict(r.verdicts)
                ),
            )
        )
        return pb.RecordTrialResponse()

    async def SaveRouteChange(self, request: pb.SaveRouteChangeRequest, context: Any) -> pb.RouteChange:
        c = request.change
        if c.deleted == bool(c.route_json):
            raise BadInput("give route_json for a changed route, or deleted = true (and no route_json)")
        row = await self._w(
            lambda: self.ledger.save_route_change(
                actor_of(request.actor, context),
                c.fleet,
                c.model,
                None if c.deleted else c.route_json,
                request.previous_json,
            )
        )
        return route_change_msg(row)

    async def SaveLimitChange(self, request: pb.SaveLimitChangeRequest, context: Any) -> pb.LimitChange:
        c = request.change
        row = await self._w(
            lambda: self.ledger.save_limit_change(
                actor_of(request.actor, context),
                c.fleet,
                PrincipalLimit(c.principal_id, c.rate_per_s, c.burst, c.max_in_flight, c.reset),
            )
        )
        return limit_change_msg(row)


def _required(request: Message, field: str, what: str) -> Any:
    """`request`'s message field `field`, which must be set: else INVALID_ARGUMENT naming it."""
    if not request.HasField(field):
        raise BadInput(f"{type(request).__name__}.{field} is required: {what}")
    return getattr(request, field)
