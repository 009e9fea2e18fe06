"""v_cost_per_completed_job rounds half up, as CostReport does (0001 truncated).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _day(col: str) -> str:
    if op.get_bind().dialect.name == "sqlite":
        return f"strftime('%Y-%m-%d', {col} / 1000000, 'unixepoch')"
    return f"to_char(timezone('UTC', to_timestamp({col} / 1000000.0)), 'YYYY-MM-DD')"


def _view(per_job: str) -> None:
    op.execute("DROP VIEW IF EXISTS v_cost_per_completed_job")
    op.execute(
        f"""CREATE VIEW v_cost_per_completed_job AS
        WITH cost AS (
            SELECT path, {_day("at_us")} AS day, MAX(currency) AS currency,
                   CAST(SUM(amount_micros) AS BIGINT) AS total_micros,
                   SUM(CASE WHEN amount_micros IS NULL THEN 1 ELSE 0 END) AS unpriced_lines
            FROM ledger_lines GROUP BY path, {_day("at_us")}),
        done AS (
            SELECT path, {_day("ended_us")} AS day, COUNT(*) AS jobs_completed
            FROM jobs WHERE status = 'completed' AND met_quality GROUP BY path, {_day("ended_us")})
        SELECT cost.path, cost.day, cost.currency, cost.total_micros,
               COALESCE(done.jobs_completed, 0) AS jobs_completed,
               CASE WHEN done.jobs_completed > 0 THEN {per_job} END AS cost_per_completed_job_micros,
               cost.unpriced_lines
        FROM cost LEFT JOIN done ON done.path = cost.path AND done.day = cost.day"""
    )


# Half away from zero on exact integers, like services.metering.costmodel.round_div.
HALF_UP = (
    "CASE WHEN cost.total_micros >= 0 "
    "THEN (2 * cost.total_micros + done.jobs_completed) / (2 * done.jobs_completed) "
    "ELSE -((-2 * cost.total_micros + done.jobs_completed) / (2 * done.jobs_completed)) END"
)
TRUNCATED = "cost.total_micros / done.jobs_completed"


def upgrade() -> None:
    _view(HALF_UP)


def downgrade() -> None:
    _view(TRUNCATED)
