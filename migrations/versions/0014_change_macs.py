"""Change MACs: `mac` on limit_changes and route_changes (services/metering/rowmac.py), over
every field of a change, its id included.

A change written before this revision has none; it holds where the chain's audit row for its
revision (`limit.set`, `route.set`, `route.delete`, written in the same transaction) names the
same fleet and says the same limits or route.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("limit_changes", "route_changes")


def upgrade() -> None:
    for table in TABLES:
        op.add_column(table, sa.Column("mac", sa.String(length=64), nullable=True))


def downgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("mac")
