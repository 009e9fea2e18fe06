"""Keeping up with the fleet: what every router of a fleet shares through metering.

Route changes (`route_table`) and principal limits (`fleet_limits`) are kept in metering, so
every router of a fleet applies them. Each router fetches them once before it serves (without
metering it serves what it kept, and says so) and then every `route_sync_s`; a poll that fails
is logged once until one succeeds again, and never stops the polling.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from switchyard.errors import SwitchyardError

log = logging.getLogger(__name__)

Sync = Callable[[], Awaitable[object]]


class FleetPoller:
    """Fetches the fleet's `what` with `sync`: once before serving, then every interval."""

    def __init__(self, sync: Sync, what: str) -> None:
        self._sync = sync
        self._what = what
        self._task: asyncio.Task[None] | None = None

    async def start(self, interval_s: float) -> None:
        """The fleet's changes before the first request (serving goes on without them if
        metering does not answer: the polling catches up), then every `interval_s` (0: never)."""
        try:
            await self._sync()
        except SwitchyardError as exc:
            log.warning("serving without the fleet's latest %s until metering answers: %s", self._what, exc)
        if interval_s > 0:
            self._task = asyncio.create_task(
                _every(self._sync, interval_s, self._what), name=f"sync {self._what}"
            )

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


async def _every(sync: Sync, interval_s: float, what: str) -> None:
    failing = False
    while True:
        await asyncio.sleep(interval_s)
        try:
            await sync()
        except SwitchyardError as exc:
            if not failing:
                log.warning("cannot fetch the fleet's %s from metering, retrying: %s", what, exc)
            failing = True
            continue
        except Exception:  # a bug here must not stop the polling for good
            log.exception("fetching the fleet's %s failed; retrying", what)
            continue
        if failing:
            log.info("fetching the fleet's %s from metering again", what)
        failing = False
