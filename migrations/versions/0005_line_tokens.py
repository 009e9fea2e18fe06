"""ledger_lines: the prompt and output tokens of a generation request's line.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01

Both columns are BIGINT NOT NULL DEFAULT 0: lines written before this revision (and lines
that are not generation requests: idle shares, preparation, other models) hold 0 tokens.
A plain ADD COLUMN on both databases: the journal's append-only triggers stay in place
(a batch-mode table copy on SQLite would drop and recreate them).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("prompt_tokens", "output_tokens")


def upgrade() -> None:
    for name in COLUMNS:
        op.add_column(
            "ledger_lines", sa.Column(name, sa.BigInteger(), server_default=sa.text("0"), nullable=False)
        )


def downgrade() -> None:
    for name in reversed(COLUMNS):
        op.drop_column("ledger_lines", name)
