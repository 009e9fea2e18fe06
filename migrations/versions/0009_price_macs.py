"""Price MACs: `mac` on prices (services/metering/rowmac.py).

A price written before this revision has no MAC, and usage on its key is refused until an
admin sets it again (`switchyard prices set`, same key, rate and time: metering then signs
it). The database cannot compute a MAC, as it lacks the key.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("prices", sa.Column("mac", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("prices") as batch:
        batch.drop_column("mac")
