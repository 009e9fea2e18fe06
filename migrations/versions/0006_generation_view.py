"""v_generation_cost: the cost of generation per path, model, team and day, for BI tools.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01

What CostReport gives per group (services/metering/reports.py, docs/ledger.md "Tokens"): the
tokens of the group's lines net of reversals, the cost of the lines of generation jobs (jobs
with a busy line that carries tokens), those jobs ended completed within quality, and the
cost per completed generation job and per million output and prompt tokens, each rounded
half up once on exact integers (NULL without a divisor). The per-million figure is computed
as q x 10^6 + round((r x 10^6) / t) with q, r = divmod(cost, t), so no product can leave
BIGINT. Only groups with tokens or generation cost are rows.
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _day(col: str) -> str:
    if op.get_bind().dialect.name == "sqlite":
        return f"strftime('%Y-%m-%d', {col} / 1000000, 'unixepoch')"
    return f"to_char(timezone('UTC', to_timestamp({col} / 1000000.0)), 'YYYY-MM-DD')"


def _half_up(num: str, den: str) -> str:
    """num / den rounded half away from zero, den > 0 (as costmodel.round_div)."""
    return (
        f"CASE WHEN {num} >= 0 THEN (2 * {num} + {den}) / (2 * {den}) "
        f"ELSE -((-2 * {num} + {den}) / (2 * {den})) END"
    )


def _per_million(cost: str, tokens: str) -> str:
    def positive(m: str) -> str:
        return f"({m} / {tokens}) * 1000000 + (2 * ({m} % {tokens}) * 1000000 + {tokens}) / (2 * {tokens})"

    return (
        f"CASE WHEN {tokens} > 0 THEN CASE WHEN {cost} >= 0 THEN {positive(cost)} "
        f"ELSE -({positive('(-' + cost + ')')}) END END"
    )


def upgrade() -> None:
    op.execute(
        f"""CREATE VIEW v_generation_cost AS
        WITH gen AS (
            SELECT DISTINCT job_id FROM ledger_lines
            WHERE basis = 'busy' AND job_id IS NOT NULL AND (prompt_tokens > 0 OR output_tokens > 0)),
        cost AS (
            SELECT path, model, team, {_day("at_us")} AS day, MAX(currency) AS currency,
                   CAST(COALESCE(SUM(CASE WHEN job_id IN (SELECT job_id FROM gen)
                                      THEN amount_micros ELSE 0 END), 0) AS BIGINT) AS generation_micros,
                   CAST(SUM(prompt_tokens) AS BIGINT) AS prompt_tokens,
                   CAST(SUM(output_tokens) AS BIGINT) AS output_tokens,
                   SUM(CASE WHEN amount_micros IS NULL THEN 1 ELSE 0 END) AS unpriced_lines
            FROM ledger_lines GROUP BY path, model, team, {_day("at_us")}),
        done AS (
            SELECT path, model, team, {_day("ended_us")} AS day, COUNT(*) AS jobs
            FROM jobs WHERE status = 'completed' AND met_quality AND job_id IN (SELECT job_id FROM gen)
            GROUP BY path, model, team, {_day("ended_us")})
        SELECT cost.path, cost.model, cost.team, cost.day, cost.currency, cost.generation_micros,
               cost.prompt_tokens, cost.output_tokens,
               COALESCE(done.jobs, 0) AS generation_jobs_completed,
               CASE WHEN done.jobs > 0 THEN {_half_up("cost.generation_micros", "done.jobs")} END
                   AS cost_per_completed_generation_job_micros,
               {_per_million("cost.generation_micros", "cost.output_tokens")}
                   AS cost_per_million_output_tokens_micros,
               {_per_million("cost.generation_micros", "cost.prompt_tokens")}
                   AS cost_per_million_prompt_tokens_micros,
               cost.unpriced_lines
        FROM cost LEFT JOIN done
            ON done.path = cost.path AND done.model = cost.model AND done.team = cost.team
            AND done.day = cost.day
        WHERE cost.prompt_tokens <> 0 OR cost.output_tokens <> 0 OR cost.generation_micros <> 0"""
    )


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS v_generation_cost")
