"""route_changes: run-time route changes shared by the routers of a fleet.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "route_changes",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("fleet", sa.String(length=200), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("route_json", sa.Text(), nullable=True),
        sa.Column("changed_us", sa.BigInteger(), nullable=False),
        sa.Column("principal", sa.String(length=200), nullable=False),
        sa.Column("request_id", sa.String(length=200), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_route_changes")),
    )
    op.create_index(
        op.f("ix_route_changes_fleet_model_id"), "route_changes", ["fleet", "model", "id"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_route_changes_fleet_model_id"), table_name="route_changes")
    op.drop_table("route_changes")
