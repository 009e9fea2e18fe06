"""One path's account in the ledger, from inside the workflow: the reservation it holds for
its pipeline, the non-job usage charged inside it (golden, correctness, training), its cost
read back at the end, and the cleanup that closes the reservation and hands back the
executor's serving set-up. Runs in the workflow sandbox; the writes are LedgerActivities.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from temporalio.exceptions import ActivityError

from workflows.activities.trial_ledger import LedgerActivities
from workflows.pipeline.context import TrialContext, now_us, reason_of
from workflows.pipeline.path_state import PathState
from workflows.pipeline.types import CloseRequest, EconomicsRequest, ReservationRequest, Target, UsageRecord


class Timed(Protocol):
    """An activity result the ledger charges: its busy time and when it ran."""

    @property
    def busy_us(self) -> int: ...
    @property
    def started_unix_us(self) -> int: ...
    @property
    def ended_unix_us(self) -> int: ...


In = TypeVar("In")
Run = TypeVar("Run", bound=Timed)


class PathLedger:
    def __init__(self, ctx: TrialContext, target: Target, state: PathState) -> None:
        self.ctx = ctx
        self.target = target
        self.state = state
        self.unload = True  # False: the path shares another path's load, which that one hands back

    async def open(self) -> None:
        """Hold a reservation for the pipeline (none if the path could not be registered)."""
        if self.state.ledger_problem:
            return
        # the start comes from the workflow so a retried activity sends the same request
        self.state.reservation_start_us = now_us()
        await self._reserve()

    async def _reserve(self) -> None:
        request = ReservationRequest(self.target, self.state.reservation_start_us)
        r = await self.ctx.call(LedgerActivities.open_reservation, request)
        self.state.reservation_id, self.state.reservation_open = r.reservation_id, True

    async def usage(self, phase: str, busy_us: int, started: int, ended: int) -> None:
        if self.state.reservation_open:
            record = UsageRecord(self.target, phase, busy_us, started, ended, self.state.reservation_id)
            await self.ctx.call(LedgerActivities.record_path_usage, record)

    async def golden(
        self, run: Callable[[Any, In], Awaitable[Run]], request: In, fallback: str
    ) -> Run | None:
        """The reference's float64 golden run, charged as "golden". Its failure does not fail
        the path: a note says so and what the comparison falls back to."""
        try:
            result = await self.ctx.call(run, request)
        except ActivityError as err:
            self.state.notes.append(f"no float64 golden run ({reason_of(err)}): {fallback}")
            return None
        await self.usage("golden", result.busy_us, result.started_unix_us, result.ended_unix_us)
        return result

    async def economics(self) -> None:
        """Close the reservation and read the path's cost per completed job."""
        if not self.state.reservation_open:
            self.state.economics_unpriced = True
            return
        request = EconomicsRequest(self.target, self.state.reservation_id, 0, now_us())
        try:
            self.state.economics = await self.ctx.call(LedgerActivities.economics, request)
            self.state.reservation_open = False
        except ActivityError as err:
            self.state.errors["economics"] = reason_of(err)
            self.state.status = "failed"

    async def cleanup(self) -> None:
        """Close the reservation (if still open) and hand back the serving set-up (or unload
        what only the trial loaded); safe to call twice."""
        if self.state.reservation_start_us and not self.state.reservation_id:
            await self._recover_reservation()
        if not self.state.reservation_open and not self.state.loaded:
            return
        reservation = self.state.reservation_id if self.state.reservation_open else ""
        request = CloseRequest(self.target, reservation, now_us(), self.unload, self.state.restore)
        try:
            await self.ctx.call(LedgerActivities.close_path, request)
            self.state.reservation_open = False
            self.state.loaded = False
        except ActivityError as err:
            self.state.notes.append(f"cleanup failed: {reason_of(err)}")

    async def _recover_reservation(self) -> None:
        """A cancellation that lands while the reservation is being opened loses the answer
        (asyncio throws it in at that await), not the reservation: asked again with the same
        key and start, metering answers with the one it holds, which cleanup then closes."""
        try:
            await self._reserve()
        except ActivityError as err:
            self.state.notes.append(f"reservation left unknown: {reason_of(err)}")
