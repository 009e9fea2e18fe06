"""Ledger activities: the trial's own device time and jobs go through metering, the ledger's
only writer. Every write carries an idempotency key built from the workflow run, so retries
and a resumed worker never double count; money comes back as integer micro-units.

A path holds a reservation from the start of its first phase to the end of its last; what
its phases used is charged inside it (golden, correctness and training runs as preparation
of the path, performance requests as jobs), and the idle remainder is explicit. Cost per
completed job is the ledger's figure for that path and trial.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import grpc
from temporalio import activity
from temporalio.exceptions import ApplicationError

from switchyard.field_copy import copy_fields
from switchyard.gen.switchyard.v1 import executor_pb2 as xpb
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
from workflows.activities.connections import Connections, grpc_errors
from workflows.activities.path import Clock, now_us
from workflows.pipeline.types import (
    CloseRequest,
    EconomicsRequest,
    EconomicsResult,
    PathInfo,
    Registration,
    ReservationRequest,
    ReservationResult,
    Target,
    TrialRecord,
    UsageRecord,
)

ACTOR = mpb.Actor(source="trial-worker")
USAGE_BATCH = 500  # events per RecordUsage


def usage_event(target: Target, key: str, kind: str, **fields: Any) -> mpb.UsageEvent:
    """A usage event of the trial on `target`'s path; `key` makes a retried write idempotent."""
    return mpb.UsageEvent(
        idempotency_key=key,
        path=target.ledger_path,
        model=target.model,
        model_version=target.version,
        team=target.team,
        kind=kind,
        trial_id=target.trial_id,
        arm=target.path,
        **fields,
    )


async def send_usage(connections: Connections, target: Target, events: list[mpb.UsageEvent]) -> None:
    """A phase's usage events, in batches of USAGE_BATCH (each batch one RecordUsage)."""
    for i in range(0, len(events), USAGE_BATCH):
        with grpc_errors(f"RecordUsage for {target.path}"):
            await connections.metering().RecordUsage(
                mpb.RecordUsageRequest(events=events[i : i + USAGE_BATCH], actor=ACTOR), timeout=60
            )


class LedgerActivities:
    def __init__(self, connections: Connections, clock: Clock = time.time) -> None:
        self.connections = connections
        self.clock = clock

    def _actor(self) -> mpb.Actor:
        info = activity.info()
        return mpb.Actor(
            principal="trial-worker",
            source="trial-worker",
            request_id=f"{info.workflow_id}/{info.activity_id}",
        )

    @activity.defn(name="register_path")
    async def register_path(self, info: PathInfo) -> Registration:
        """Register the path; the problem is "" when registered, else why its cost cannot be known."""
        try:
            described = {k: getattr(info, k) for k in ("backend", "resource_class", "price_key", "host")}
            await self.connections.metering().RegisterPath(
                mpb.RegisterPathRequest(
                    path_info=mpb.PathInfo(path=info.ledger_path, **described), actor=self._actor()
                ),
                timeout=30,
            )
        except grpc.aio.AioRpcError as err:
            if err.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS):
                return Registration(f"ledger: {err.details()}")
            with grpc_errors(f"RegisterPath {info.ledger_path}"):
                raise
        return Registration()

    @activity.defn(name="open_reservation")
    async def open_reservation(self, request: ReservationRequest) -> ReservationResult:
        t = request.target
        run = activity.info().workflow_run_id
        start = request.start_unix_us or now_us(self.clock)
        with grpc_errors(f"OpenReservation for {t.ledger_path}"):
            r = await self.connections.metering().OpenReservation(
                mpb.OpenReservationRequest(
                    idempotency_key=f"{run}/{t.path}/reservation",
                    path=t.ledger_path,
                    start_unix_us=start,
                    trial_id=t.trial_id,
                    actor=self._actor(),
                ),
                timeout=30,
            )
        return ReservationResult(r.reservation_id, r.start_unix_us)

    @activity.defn(name="record_path_usage")
    async def record_path_usage(self, record: UsageRecord) -> None:
        """Golden, correctness and training runs: device time of the trial, charged to the path."""
        t = record.target
        run = activity.info().workflow_run_id
        event = usage_event(
            t,
            f"{run}/{t.path}/{record.phase}",
            "prepare",
            busy_us=min(record.busy_us, max(record.ended_unix_us - record.started_unix_us, 0)),
            started_unix_us=record.started_unix_us,
            ended_unix_us=record.ended_unix_us,
            tags={"phase": record.phase},
        )
        with grpc_errors(f"RecordUsage ({record.phase}) for {t.ledger_path}"):
            await self.connections.metering().RecordUsage(
                mpb.RecordUsageRequest(events=[event], actor=self._actor()), timeout=30
            )

    async def _close(self, reservation_id: str, end_us: int) -> mpb.Reservation:
        with grpc_errors(f"CloseReservation {reservation_id}"):
            return await self.connections.metering().CloseReservation(
                mpb.CloseReservationRequest(
                    reservation_id=reservation_id, end_unix_us=end_us, actor=self._actor()
                ),
                timeout=30,
            )

    @activity.defn(name="close_path")
    async def close_path(self, request: CloseRequest) -> None:
        """Cleanup: close the reservation; put back the serving configuration, or unload."""
        t = request.target
        if request.reservation_id:
            await self._close(request.reservation_id, request.end_unix_us or now_us(self.clock))
        if request.unload:
            control = self.connections.control(t.executor)
            try:
                if request.restore is not None:
                    restore = xpb.LoadModelRequest(**dataclasses.asdict(request.restore))
                    await control.LoadModel(restore, timeout=600)
                else:
                    await control.Unload(xpb.UnloadRequest(model_name=t.model, version=t.version), timeout=30)
            except (grpc.aio.AioRpcError, ApplicationError) as err:
                activity.logger.info("restoring/unloading %s on %s: %s", t.model, t.path, err)

    @activity.defn(name="economics")
    async def economics(self, request: EconomicsRequest) -> EconomicsResult:
        t = request.target
        reservation = await self._close(request.reservation_id, request.end_unix_us or now_us(self.clock))
        with grpc_errors(f"CostReport for trial {t.trial_id}"):
            report = await self.connections.metering().CostReport(
                mpb.CostReportRequest(
                    group_by=["path"],
                    trial_id=t.trial_id,
                    since_unix_us=request.since_unix_us,
                    actor=self._actor(),
                ),
                timeout=60,
            )
        row = next((r for r in report.rows if r.group.get("path") == t.ledger_path), None)
        if row is None:
            raise ApplicationError(f"the ledger has no cost rows for {t.ledger_path} in trial {t.trial_id}")
        return copy_fields(
            EconomicsResult,
            row,
            currency=row.currency or reservation.currency,
            reserved_micros=reservation.cost_micros,
            unpriced=row.unpriced_events > 0 or not row.currency,
        )

    @activity.defn(name="record_trial")
    async def record_trial(self, record: TrialRecord) -> None:
        with grpc_errors(f"RecordTrial {record.trial_id}"):
            # TrialRecord's fields are the request's, one for one
            request = mpb.RecordTrialRequest(**dataclasses.asdict(record), actor=self._actor())
            await self.connections.metering().RecordTrial(request, timeout=60)
