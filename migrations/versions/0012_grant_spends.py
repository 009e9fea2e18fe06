"""grant_spends: each trial grant spent by the one Temporal run that first verified it.

A later verification of the grant for another run (the workflow id started again with the
memo copied) is refused; the same run (an activity's retry) passes. Rows are only inserted
(the PostgreSQL runtime role gets SELECT, INSERT: services/metering/db.py).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "grant_spends",
        sa.Column("grant_id", sa.String(length=64), nullable=False),
        sa.Column("run_id", sa.String(length=200), nullable=False),
        sa.Column("subject", sa.String(length=400), nullable=False),
        sa.Column("principal_id", sa.String(length=200), nullable=False),
        sa.Column("spent_us", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("grant_id", name=op.f("pk_grant_spends")),
    )


def downgrade() -> None:
    op.drop_table("grant_spends")
