"""Metering's reading RPCs: a job's cost, cost reports and exports, paths, trial reports and the
fleet's route changes.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from services.metering.ledger_calls import LedgerCalls
from services.metering.metering_messages import (
    limit_change_msg,
    path_msg,
    route_change_msg,
)
from switchyard.field_copy import copy_fields
from switchyard.gen.switchyard.v1 import metering_pb2 as pb


class ReportRpcs(LedgerCalls):
    """GetJobCost, CostReport, Export, ListPaths, GetTrialReport, ListRouteChanges, ListLimitChanges."""

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
        return pb.CostReportResponse(rows=[copy_fields(pb.CostRow, row) for row in rows])

    async def Export(self, request: pb.ExportRequest, context: Any) -> AsyncIterator[pb.ExportChunk]:
        chunks = self.ledger.export(request.format, request.since_unix_us, request.until_unix_us)
        done = object()
        while True:
            chunk = await self._r(lambda: next(chunks, done))
            if chunk is done:
                return
            assert isinstance(chunk, bytes)
            yield pb.ExportChunk(data=chunk)

    async def ListPaths(self, request: pb.ListPathsRequest, context: Any) -> pb.ListPathsResponse:
        rows = await self._r(self.ledger.list_paths)
        return pb.ListPathsResponse(
            paths=[path_msg(r, priced=priced, created_unix_us=r.created_us) for r, priced in rows]
        )

    async def GetTrialReport(self, request: pb.GetTrialReportRequest, context: Any) -> pb.TrialReport:
        row = await self._r(lambda: self.ledger.trial(request.trial_id))
        return pb.TrialReport(
            trial_id=row.trial_id,
            status=row.status,
            report_json=row.report_json,
            verdicts=json.loads(row.verdicts_json or "{}"),
        )

    async def ListRouteChanges(
        self, request: pb.ListRouteChangesRequest, context: Any
    ) -> pb.ListRouteChangesResponse:
        rows = await self._r(lambda: self.ledger.route_changes(request.fleet))
        return pb.ListRouteChangesResponse(changes=[route_change_msg(r) for r in rows])

    async def ListLimitChanges(
        self, request: pb.ListLimitChangesRequest, context: Any
    ) -> pb.ListLimitChangesResponse:
        rows = await self._r(lambda: self.ledger.limit_changes(request.fleet))
        return pb.ListLimitChangesResponse(changes=[limit_change_msg(r) for r in rows])
