"""Path MACs: `mac` on paths (services/metering/rowmac.py), the price key each is charged at.

A path registered before this revision has no MAC and holds where its chained
`path.register` row names the same price key and resource class.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("paths", sa.Column("mac", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("paths") as batch:
        batch.drop_column("mac")
