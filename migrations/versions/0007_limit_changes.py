"""limit_changes: per-principal limits set through RouterAdmin, shared by the routers of a fleet.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "limit_changes",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("fleet", sa.String(length=200), nullable=False),
        sa.Column("principal_id", sa.String(length=200), nullable=False),
        sa.Column("rate_per_s", sa.Float(), nullable=False),
        sa.Column("burst", sa.Integer(), nullable=False),
        sa.Column("max_in_flight", sa.Integer(), nullable=False),
        sa.Column("reset", sa.Boolean(), nullable=False),
        sa.Column("changed_us", sa.BigInteger(), nullable=False),
        sa.Column("principal", sa.String(length=200), nullable=False),
        sa.Column("request_id", sa.String(length=200), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_limit_changes")),
    )
    op.create_index(
        op.f("ix_limit_changes_fleet_principal_id_id"),
        "limit_changes",
        ["fleet", "principal_id", "id"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_limit_changes_fleet_principal_id_id"), table_name="limit_changes")
    op.drop_table("limit_changes")
