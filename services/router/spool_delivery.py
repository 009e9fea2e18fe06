"""How the usage spool hands its events to metering, and what it does with a refusal.

A batch goes in one RecordUsage; if metering refuses it as a whole, event by event. An event
refused for a reason that can heal (an unknown path not registered yet, a precondition) is
handed back, for the spool to keep and replay later; one refused for its content (a
conflicting key, an invalid field) goes to the dead-letter file (`spool_segments`). An audit
row metering refuses is dead-lettered alike, so a poisoned audit never blocks what follows it.
Metering unreachable (`DOWN`) is raised to the spool, which then writes to disk and backs off.
"""

from __future__ import annotations

import logging
from typing import Protocol

from services.router.spool_segments import SegmentStore, SpoolStats
from switchyard.errors import DeadlineExceeded, FailedPrecondition, NotFound, SwitchyardError, Unavailable
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb

log = logging.getLogger(__name__)

DOWN = (Unavailable, DeadlineExceeded, TimeoutError, ConnectionError)  # metering unreachable
LATER = (NotFound, FailedPrecondition)  # refused for now; may be taken after a while


class MeteringSink(Protocol):
    async def record_usage(self, request: mpb.RecordUsageRequest) -> None: ...

    async def append_audit(self, request: mpb.AppendAuditRequest) -> None: ...


class MeteringDelivery:
    def __init__(self, sink: MeteringSink, disk: SegmentStore, stats: SpoolStats) -> None:
        self._sink = sink
        self._disk = disk
        self._stats = stats

    async def usage(self, request: mpb.RecordUsageRequest) -> list[mpb.UsageEvent]:
        """Sends a batch; returns the events metering cannot take yet (to keep and replay)."""
        try:
            await self._sink.record_usage(request)
            return []
        except DOWN:
            raise
        except SwitchyardError as exc:
            log.warning("metering refused a usage batch (%s); retrying event by event", exc)
        later: list[mpb.UsageEvent] = []
        for event in request.events:
            try:
                await self._sink.record_usage(mpb.RecordUsageRequest(events=[event], actor=request.actor))
            except DOWN:
                raise
            except LATER:
                later.append(event)
            except SwitchyardError as single:
                self._disk.dead_letter(event, str(single))
        if later:
            log.warning("metering cannot take %d events yet (unknown path?); kept in the spool", len(later))
        return later

    async def audit(self, audit: mpb.AppendAuditRequest) -> bool:
        """Sends an audit row; one metering refuses is dead-lettered. False: the disk refused the
        dead letter too (the caller keeps the row)."""
        try:
            await self._sink.append_audit(audit)
        except DOWN:
            raise
        except SwitchyardError as exc:  # poisoned: set aside, the rest flows on
            return self._disk.dead_letter(audit, str(exc))
        self._stats.audits_sent += 1
        return True
