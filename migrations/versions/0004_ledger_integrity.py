"""Ledger integrity: one reversal per line, TRUNCATE refused, the audit head cannot be deleted.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01

- A unique index on the reversal target (`method` = 'reverses <key>' of reversal rows), so
  two writers racing to reverse one line cannot both succeed. (A ledger that already holds a
  line reversed twice fails this migration: find them with
  `SELECT method, COUNT(*) FROM ledger_lines WHERE basis = 'reversal' GROUP BY method HAVING COUNT(*) > 1`.)
- PostgreSQL: BEFORE TRUNCATE triggers on the journal, the audit trail and the audit head
  (TRUNCATE skips row triggers, so the append-only triggers never saw it).
- Both: the audit head row cannot be deleted.

The audit chain is keyed (HMAC) from this revision on; rows written before it were hashed
without a key, and `switchyard audit verify` names them `unkeyed`.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NO_TRUNCATE = ("ledger_lines", "audit_log", "audit_head")
WHERE = "basis = 'reversal'"


def upgrade() -> None:
    op.create_index(
        "uq_ledger_lines_reversal_target",
        "ledger_lines",
        ["method"],
        unique=True,
        sqlite_where=sa.text(WHERE),
        postgresql_where=sa.text(WHERE),
    )
    if op.get_bind().dialect.name == "sqlite":
        op.execute(
            "CREATE TRIGGER audit_head_no_delete BEFORE DELETE ON audit_head "
            "BEGIN SELECT RAISE(ABORT, 'audit_head cannot be deleted'); END"
        )
        return
    op.execute(
        "CREATE FUNCTION switchyard_no_truncate() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "RAISE EXCEPTION '% cannot be truncated; the ledger is append-only', TG_TABLE_NAME; END $$"
    )
    for table in NO_TRUNCATE:
        op.execute(
            f"CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table} "
            "FOR EACH STATEMENT EXECUTE FUNCTION switchyard_no_truncate()"
        )
    op.execute(
        "CREATE FUNCTION switchyard_keep_row() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "RAISE EXCEPTION '% rows cannot be deleted', TG_TABLE_NAME; END $$"
    )
    op.execute(
        "CREATE TRIGGER audit_head_no_delete BEFORE DELETE ON audit_head "
        "FOR EACH ROW EXECUTE FUNCTION switchyard_keep_row()"
    )


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute("DROP TRIGGER IF EXISTS audit_head_no_delete")
    else:
        op.execute("DROP TRIGGER IF EXISTS audit_head_no_delete ON audit_head")
        op.execute("DROP FUNCTION IF EXISTS switchyard_keep_row()")
        for table in NO_TRUNCATE:
            op.execute(f"DROP TRIGGER IF EXISTS {table}_no_truncate ON {table}")
        op.execute("DROP FUNCTION IF EXISTS switchyard_no_truncate()")
    op.drop_index("uq_ledger_lines_reversal_target", table_name="ledger_lines")
