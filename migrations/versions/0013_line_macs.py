"""Line MACs: `mac` on ledger_lines (services/metering/rowmac.py), over every field of a line.

Lines written before this revision have none; at metering's first start after it the audit
chain records them (`ledger.lines_signed`: their highest id, count and digest), and from
then on a line without a valid MAC was written behind metering's back.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("ledger_lines", sa.Column("mac", sa.String(length=64), nullable=True))


def downgrade() -> None:
    op.drop_column("ledger_lines", "mac")  # not in batch: SQLite's views name the table
