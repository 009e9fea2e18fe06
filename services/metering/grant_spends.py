"""Spending a trial grant: the first VerifyGrant of a grant records the Temporal run it names.

A grant travels in the workflow's memo, which anyone who can read the workflow in Temporal
sees. Without this, the same workflow id started again with that memo would run as the grant's
principal for as long as the grant lasts. So the first verification records (grant id, run id)
in `grant_spends`, in the transaction that writes its audit row; a later verification naming
another run is refused, and one naming the same run (the activity retried, a worker killed
mid-activity) passes. Two replicas racing on one grant: the primary key lets one insert win;
the other's transaction is retried (Transactions.write) and sees it. Domain code: no gRPC here.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, insert, select

from services.metering.schema import GRANT_SPENDS

MAX_RUN_ID = 200


@dataclass(frozen=True)
class Spend:
    spent_by: str  # the run the grant is spent by
    first: bool  # spent by this verification

    def allows(self, run_id: str) -> bool:
        return self.spent_by == run_id


def spend(conn: Connection, grant_id: str, run_id: str, subject: str, principal_id: str, now: int) -> Spend:
    """Spend `grant_id` on `run_id` unless a run has already; what the ledger now says."""
    spent_by = conn.execute(
        select(GRANT_SPENDS.c.run_id).where(GRANT_SPENDS.c.grant_id == grant_id)
    ).scalar_one_or_none()
    if spent_by is not None:
        return Spend(str(spent_by), first=False)
    conn.execute(
        insert(GRANT_SPENDS).values(
            grant_id=grant_id, run_id=run_id, subject=subject, principal_id=principal_id, spent_us=now
        )
    )
    return Spend(run_id, first=True)
