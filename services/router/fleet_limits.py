"""Per-principal limits for a fleet of routers: what RouterAdmin.SetPrincipalLimit sets.

With metering, a change is saved there first (`limit_changes`, audited as `limit.set` in the
same transaction) and refused UNAVAILABLE when metering cannot take it, as route changes are
(`route_store`); every router of the fleet (`[router] fleet`) polls for the latest change per
principal every `route_sync_s` and applies those newer than what it holds, so a limit set on
one replica holds on all. Without metering, the change applies to this router only and the
router audits it itself. The defaults stay `[router] principal_*` from each router's
configuration; a reset returns a principal to them.
"""

from __future__ import annotations

import logging
from typing import Protocol

from services.router.admission import Limit, PrincipalLimits
from services.router.fleet_sync import FleetPoller
from switchyard.errors import Unavailable

log = logging.getLogger(__name__)


class SharedLimits(Protocol):
    """Where a fleet's limit changes are shared (metering)."""

    async def save_limit_change(
        self, fleet: str, principal_id: str, limit: Limit | None, principal: str, request_id: str
    ) -> int: ...

    async def limit_changes(self, fleet: str) -> dict[str, tuple[Limit | None, int]]: ...


class FleetLimits:
    def __init__(
        self, limits: PrincipalLimits, shared: SharedLimits | None = None, fleet: str = "default"
    ) -> None:
        self.limits = limits
        self.shared = shared
        self.fleet = fleet
        self.revisions: dict[str, int] = {}  # principal -> metering's revision applied here
        self.poller = FleetPoller(self.sync, "principal limits")  # started by the router's assembly

    async def set(self, principal_id: str, limit: Limit | None, principal: str, request_id: str) -> bool:
        """Sets (None: resets) `principal_id`'s limits; True when metering kept (and audited) it
        for the fleet, False when it holds on this router only."""
        if self.shared is None:
            self.limits.set(principal_id, limit)
            return False
        try:
            revision = await self.shared.save_limit_change(
                self.fleet, principal_id, limit, principal, request_id
            )
        except Unavailable as exc:
            raise Unavailable(
                f"could not save the limit in metering ({exc}); the limits are unchanged"
            ) from None
        self._apply(principal_id, limit, revision)
        return True

    def _apply(self, principal_id: str, limit: Limit | None, revision: int) -> bool:
        if revision <= self.revisions.get(principal_id, 0):
            return False
        self.revisions[principal_id] = revision
        self.limits.set(principal_id, limit)
        return True

    async def sync(self) -> int:
        """Applies the fleet's newer changes; returns how many. Raises Unavailable while
        metering does not answer."""
        if self.shared is None:
            return 0
        changes = await self.shared.limit_changes(self.fleet)
        applied = sum(self._apply(p, limit, revision) for p, (limit, revision) in sorted(changes.items()))
        if applied:
            log.info("applied %d of the fleet's principal limit changes", applied)
        return applied

    async def close(self) -> None:
        await self.poller.close()
