"""Example prices: `example` on prices marks an illustrative price (the book `switchyard up`
sets), so reports can say that a cost was charged at it.

A price from before this revision is not an example; its MAC (signed without the mark)
still holds, since an example price's MAC is the only one that covers the mark.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("prices", sa.Column("example", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("prices") as batch:
        batch.drop_column("example")
