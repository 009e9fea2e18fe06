"""Row MACs: `mac` on role_bindings and api_keys (services/metering/rowmac.py).

Rows written before this revision have no MAC and are refused at use (re-grant the role or
issue a new key through the service); the database cannot compute one, as it lacks the key.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("role_bindings", sa.Column("mac", sa.String(length=64), nullable=True))
    op.add_column("api_keys", sa.Column("mac", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("mac")
    with op.batch_alter_table("role_bindings") as batch:
        batch.drop_column("mac")
