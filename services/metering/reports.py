"""Cost reports and exports, computed in SQL from the journal and the jobs.

Cost per completed job = all cost of the group in the window (busy, idle, preparation,
failed work included) / jobs of the group that ended in the window as completed within the
quality criteria, rounded half up once. Unpriced lines are counted, never summed as zero.

Generation (docs/ledger.md "Tokens"): a generation job is a job with a usage line that
carries tokens. Its cost is every line of the job (busy, idle shares, corrections); per
group, cost per completed generation job = that cost / generation jobs completed within
quality, and cost per million output (prompt) tokens = that cost x 10^6 / output (prompt)
tokens, net of reversals. The same cost is divided by each count: it is not split between
prompt and output tokens, which share the device's steps. Integer figures are rounded half
up once; the exact fractions follow from the integers of the row.
Exports stream the journal as CSV or as FOCUS 1.2 columns (docs/focus.md), a chunk at a time.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, Select, case, exists, func, literal, literal_column, select
from sqlalchemy.sql.elements import ColumnElement

from services.metering import audit, rowmac
from services.metering.costmodel import round_div
from services.metering.metering_errors import BadInput
from services.metering.money import decimal
from services.metering.schema import JOBS, LINES, PATHS, PRICES

GROUPS = ("path", "model", "team", "day")
IDLE = ("idle", "idle_share")


@dataclass(frozen=True)
class CostRow:
    group: dict[str, str]
    currency: str = ""
    total_micros: int = 0
    busy_micros: int = 0
    idle_micros: int = 0
    prepare_micros: int = 0
    unpriced_events: int = 0
    jobs_completed: int = 0
    jobs_failed: int = 0
    jobs_total: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    generation_micros: int = 0
    generation_jobs_completed: int = 0
    generation_jobs_total: int = 0
    example_priced_lines: int = 0  # charged at an example price (Price.example)

    @property
    def cost_per_completed_job_micros(self) -> int:
        return round_div(self.total_micros, self.jobs_completed) if self.jobs_completed else 0

    @property
    def cost_per_completed_generation_job_micros(self) -> int:
        jobs = self.generation_jobs_completed
        return round_div(self.generation_micros, jobs) if jobs else 0

    @property
    def cost_per_million_output_tokens_micros(self) -> int:
        return per_million(self.generation_micros, self.output_tokens)

    @property
    def cost_per_million_prompt_tokens_micros(self) -> int:
        return per_million(self.generation_micros, self.prompt_tokens)


def per_million(micros: int, tokens: int) -> int:
    """Cost of a million tokens, rounded half up once; 0 when there are no tokens."""
    return round_div(micros * 1_000_000, tokens) if tokens > 0 else 0


def generation_jobs() -> Any:
    """Ids of the jobs with a usage line that carries tokens (whenever it was recorded)."""
    tokens = (LINES.c.prompt_tokens > 0) | (LINES.c.output_tokens > 0)
    return select(LINES.c.job_id).where(LINES.c.basis == "busy", LINES.c.job_id.is_not(None), tokens)


def check_window(since_us: int, until_us: int) -> None:
    if since_us < 0 or until_us < 0:
        raise BadInput("since/until are negative; give microseconds since the Unix epoch (0 = open)")
    if until_us and since_us and until_us <= since_us:
        raise BadInput(f"until ({until_us}) is not after since ({since_us}); the window is empty or reversed")


def check_groups(group_by: Sequence[str]) -> list[str]:
    out = []
    for g in group_by:
        if g not in GROUPS:
            raise BadInput(f"cannot group by {g!r}; choose from {', '.join(GROUPS)}")
        if g not in out:
            out.append(g)
    return out


def day_of(engine_dialect: str, col: Any) -> ColumnElement[Any]:
    if engine_dialect == "sqlite":
        return func.strftime("%Y-%m-%d", col / 1_000_000, "unixepoch")
    return func.to_char(func.timezone("UTC", func.to_timestamp(col / 1_000_000.0)), "YYYY-MM-DD")


def _cols(table: Any, groups: list[str], dialect: str, time_col: Any) -> list[ColumnElement[Any]]:
    return [(day_of(dialect, time_col) if g == "day" else table.c[g]).label(g) for g in groups]


def _window(stmt: Select[Any], since_us: int, until_us: int, trial_id: str = "") -> Select[Any]:
    """`stmt` over the lines in [since, until) of a trial ("" = every one)."""
    if since_us:
        stmt = stmt.where(LINES.c.at_us >= since_us)
    if until_us:
        stmt = stmt.where(LINES.c.at_us < until_us)
    return stmt.where(LINES.c.trial_id == trial_id) if trial_id else stmt


def check_lines(conn: Any, audit_key: bytes | None, since_us: int, until_us: int, trial_id: str = "") -> None:
    """With the audit key (the ledger's reports): refuse a report over a line written behind
    metering's back (rowmac.py); every line of the window is read once to check it."""
    if audit_key is None:
        return
    audit.bind_key(conn, audit_key)
    stmt = _window(select(LINES), since_us, until_us, trial_id)
    rowmac.check_lines(conn, conn.execute(stmt).yield_per(1000), "the report")


def cost_report(
    engine: Engine,
    group_by: Sequence[str],
    since_us: int,
    until_us: int,
    trial_id: str = "",
    audit_key: bytes | None = None,
) -> list[CostRow]:
    groups = check_groups(group_by)
    check_window(since_us, until_us)
    lines, jobs = _cost_queries(groups, engine.dialect.name, since_us, until_us, trial_id)
    rows: dict[tuple[str, ...], dict[str, Any]] = {}
    with engine.connect() as conn:
        check_lines(conn, audit_key, since_us, until_us, trial_id)
        for r in conn.execute(lines):
            key = tuple(str(getattr(r, g) or "") for g in groups)
            rows[key] = dict(currency=r.currency, total_micros=int(r.total), busy_micros=int(r.busy))
            rows[key].update(
                idle_micros=int(r.idle), prepare_micros=int(r.prepare), unpriced_events=int(r.unpriced or 0)
            )
            rows[key].update(
                prompt_tokens=int(r.prompt_tokens),
                output_tokens=int(r.output_tokens),
                generation_micros=int(r.generation),
                example_priced_lines=int(r.example or 0),
            )
        for r in conn.execute(jobs):
            if r.total is None:  # aggregate over no rows without GROUP BY
                continue
            key = tuple(str(getattr(r, g) or "") for g in groups)
            entry = rows.setdefault(key, {})
            entry.update(jobs_completed=int(r.completed), jobs_failed=int(r.failed), jobs_total=int(r.total))
            entry.update(
                generation_jobs_completed=int(r.generation_completed),
                generation_jobs_total=int(r.generation_total),
            )
    return [CostRow(dict(zip(groups, k, strict=True)), **v) for k, v in sorted(rows.items())]


def _example_priced(dialect: str) -> ColumnElement[Any]:
    """1 for a line charged at an example price: its price version is one, or (an idle line
    over several versions) one of its comma-separated versions is; else 0."""
    find = func.instr if dialect == "sqlite" else func.strpos
    listed = literal(",") + LINES.c.price_version + literal(",")
    version = literal(",") + PRICES.c.version + literal(",")
    named = exists().where(PRICES.c.example.is_(True), find(listed, version) > 0)
    return case((named, 1), else_=0)


def _cost_queries(
    groups: list[str], dialect: str, since_us: int, until_us: int, trial_id: str
) -> tuple[Select[Any], Select[Any]]:
    """The two aggregates of a cost report: the journal's money per group, and its jobs."""
    amount = LINES.c.amount_micros

    def by(basis: tuple[str, ...]) -> ColumnElement[Any]:
        return func.coalesce(func.sum(case((LINES.c.basis.in_(basis), amount), else_=0)), 0)

    lines: Select[Any] = select(
        *_cols(LINES, groups, dialect, LINES.c.at_us),
        func.coalesce(func.max(LINES.c.currency), "").label("currency"),
        func.coalesce(func.sum(amount), 0).label("total"),
        by(("busy", "reversal")).label("busy"),  # corrections count where most originals are
        by(IDLE).label("idle"),
        by(("prepare",)).label("prepare"),
        func.sum(case((amount.is_(None), 1), else_=0)).label("unpriced"),
        func.coalesce(func.sum(LINES.c.prompt_tokens), 0).label("prompt_tokens"),
        func.coalesce(func.sum(LINES.c.output_tokens), 0).label("output_tokens"),
        func.coalesce(func.sum(case((LINES.c.job_id.in_(generation_jobs()), amount), else_=0)), 0).label(
            "generation"
        ),
        func.sum(_example_priced(dialect)).label("example"),
    )
    done = (JOBS.c.status == "completed") & (JOBS.c.met_quality == literal(True))
    generating = JOBS.c.job_id.in_(generation_jobs())
    jobs = select(
        *_cols(JOBS, groups, dialect, JOBS.c.ended_us),
        func.sum(case((done, 1), else_=0)).label("completed"),
        func.sum(case((JOBS.c.status.in_(("failed", "cancelled")), 1), else_=0)).label("failed"),
        func.sum(case((JOBS.c.status != "running", 1), else_=0)).label("total"),
        func.sum(case((done & generating, 1), else_=0)).label("generation_completed"),
        func.sum(case(((JOBS.c.status != "running") & generating, 1), else_=0)).label("generation_total"),
    )
    lines = _window(lines, since_us, until_us, trial_id)
    if since_us:
        jobs = jobs.where(JOBS.c.ended_us >= since_us)
    if until_us:
        jobs = jobs.where(JOBS.c.ended_us < until_us)
    if trial_id:
        jobs = jobs.where(JOBS.c.trial_id == trial_id)
    if groups:
        # By output label: PostgreSQL and SQLite both accept it, and the day expression is not repeated.
        lines = lines.group_by(*[literal_column(g) for g in groups])
        jobs = jobs.group_by(*[literal_column(g) for g in groups])
    return lines, jobs


CSV_COLUMNS = (
    "id",
    "idempotency_key",
    "basis",
    "at",
    "end",
    "quantity_us",
    "amount_micros",
    "currency",
    "price_version",
    "method",
    "path",
    "reservation_id",
    "job_id",
    "model",
    "team",
    "trial_id",
    "arm",
    "unpriced",
    "prompt_tokens",
    "output_tokens",
)
# FOCUS 1.2: the 21 mandatory columns, the conditional ones the journal has data for, the
# nullable ones left empty (present, so a validator finds them), then our own x_ columns.
FOCUS_COLUMNS = (
    "AvailabilityZone",
    "BilledCost",
    "BillingAccountId",
    "BillingAccountName",
    "BillingCurrency",
    "BillingPeriodEnd",
    "BillingPeriodStart",
    "ChargeCategory",
    "ChargeClass",
    "ChargeDescription",
    "ChargeFrequency",
    "ChargePeriodEnd",
    "ChargePeriodStart",
    "CommitmentDiscountCategory",
    "CommitmentDiscountId",
    "CommitmentDiscountName",
    "CommitmentDiscountStatus",
    "CommitmentDiscountType",
    "ConsumedQuantity",
    "ConsumedUnit",
    "ContractedCost",
    "ContractedUnitPrice",
    "EffectiveCost",
    "InvoiceIssuerName",
    "ListCost",
    "ListUnitPrice",
    "PricingCategory",
    "PricingQuantity",
    "PricingUnit",
    "ProviderName",
    "PublisherName",
    "RegionId",
    "RegionName",
    "ResourceId",
    "ResourceName",
    "ResourceType",
    "ServiceCategory",
    "ServiceName",
    "SkuId",
    "SkuPriceId",
    "SubAccountId",
    "SubAccountName",
    "Tags",
    "x_JobId",
    "x_TrialId",
    "x_CostBasis",
    "x_PriceVersion",
    "x_AllocationMethod",
    "x_Unpriced",
    "x_PromptTokens",
    "x_OutputTokens",
)


def iso(us: int) -> str:
    return datetime.fromtimestamp(us / 1_000_000, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def iso_s(us: int) -> str:
    """ISO 8601 UTC to the second (FOCUS date-times carry no fractions)."""
    return datetime.fromtimestamp(us // 1_000_000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ceil_s(us: int) -> int:
    return -(-us // 1_000_000) * 1_000_000


def month_bounds(us: int) -> tuple[int, int]:
    """The calendar month (UTC) holding `us`: the billing period, as microseconds."""
    day = datetime.fromtimestamp(us // 1_000_000, UTC)
    start = day.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    end = (
        start.replace(year=start.year + 1, month=1)
        if start.month == 12
        else start.replace(month=start.month + 1)
    )
    return int(start.timestamp()) * 1_000_000, int(end.timestamp()) * 1_000_000


@dataclass(frozen=True)
class FocusParty:
    """Who bills whom in a FOCUS export (`[metering]`-level settings, from the environment):
    SWITCHYARD_BILLING_ACCOUNT_ID / _NAME, SWITCHYARD_INVOICE_ISSUER, SWITCHYARD_PROVIDER,
    and SWITCHYARD_BILLING_CURRENCY for lines whose price key was never priced."""

    account_id: str = "switchyard"
    account_name: str = "switchyard"
    issuer: str = "switchyard"
    provider: str = "switchyard"
    currency: str = "USD"

    @classmethod
    def from_env(cls) -> FocusParty:
        env = os.environ.get
        return cls(
            env("SWITCHYARD_BILLING_ACCOUNT_ID", cls.account_id),
            env("SWITCHYARD_BILLING_ACCOUNT_NAME", cls.account_name),
            env("SWITCHYARD_INVOICE_ISSUER", cls.issuer),
            env("SWITCHYARD_PROVIDER", cls.provider),
            env("SWITCHYARD_BILLING_CURRENCY", cls.currency),
        )


def money(micros: int | None) -> str:
    """Micro-units as an exact decimal string; '' for unpriced (never 0)."""
    return "" if micros is None else decimal(micros)


def _csv_row(r: Any) -> list[str]:
    return [
        str(r.id),
        r.idempotency_key,
        r.basis,
        iso(r.at_us),
        iso(r.end_us),
        str(r.quantity_us),
        "" if r.amount_micros is None else str(r.amount_micros),
        r.currency or "",
        r.price_version or "",
        r.method or "",
        r.path,
        r.reservation_id or "",
        r.job_id or "",
        r.model,
        r.team,
        r.trial_id,
        r.arm,
        "true" if r.amount_micros is None else "false",
        str(r.prompt_tokens),
        str(r.output_tokens),
    ]


def _focus_row(r: Any, party: FocusParty, currencies: dict[str, str]) -> list[str]:
    """One journal line as FOCUS 1.2: the columns named below, the nullable rest left empty
    (present, so a validator finds them). An unpriced line is billed 0 (FOCUS has no
    "unknown" cost) and flagged: x_Unpriced=true and the tag `x_unpriced`; reports never count
    it as 0."""
    unpriced = r.amount_micros is None
    named = {
        **_focus_charge(r, party, currencies, money(0 if unpriced else r.amount_micros)),
        **_focus_quantity(r),
        **_focus_resource(r, party, unpriced),
        "x_JobId": r.job_id or "",
        "x_TrialId": r.trial_id,
        "x_CostBasis": r.basis,
        "x_PriceVersion": r.price_version or "",
        "x_AllocationMethod": r.method or "",
        "x_Unpriced": "true" if unpriced else "false",
    }
    return [named.get(column, "") for column in FOCUS_COLUMNS]


def _focus_charge(r: Any, party: FocusParty, currencies: dict[str, str], cost: str) -> dict[str, str]:
    """Who bills what, when: the cost columns (no negotiated discounts, so the list price is
    the contract and every cost is the line's amount) and the charge and billing periods."""
    start = r.at_us // 1_000_000 * 1_000_000
    end = max(_ceil_s(max(r.end_us, r.at_us)), start + 1_000_000)  # exclusive, at least a second
    period_start, period_end = month_bounds(r.at_us)
    return {
        "BilledCost": cost,
        "ContractedCost": cost,
        "EffectiveCost": cost,
        "ListCost": cost,
        "BillingAccountId": party.account_id,
        "BillingAccountName": party.account_name,
        "BillingCurrency": r.currency or currencies.get(r.path, party.currency),
        "BillingPeriodStart": iso_s(period_start),
        "BillingPeriodEnd": iso_s(period_end),
        "ChargeCategory": "Usage",
        "ChargeClass": "Correction" if r.basis == "reversal" else "",
        "ChargeDescription": f"{r.basis} time on {r.path}",
        "ChargeFrequency": "Usage-Based",
        "ChargePeriodStart": iso_s(start),
        "ChargePeriodEnd": iso_s(end),
        "InvoiceIssuerName": party.issuer,
    }


def _focus_quantity(r: Any) -> dict[str, str]:
    """ConsumedQuantity stays the line's hours, the unit it is priced in; a generation
    request's tokens are two quantities of one charge, so they go in x_PromptTokens and
    x_OutputTokens (0 on other lines; docs/focus.md)."""
    hours = f"{r.quantity_us / 3_600_000_000:.9f}"
    return {
        "ConsumedQuantity": hours,
        "ConsumedUnit": "Hours",
        "PricingQuantity": hours,
        "PricingUnit": "Hours",
        "x_PromptTokens": str(r.prompt_tokens),
        "x_OutputTokens": str(r.output_tokens),
    }


def _focus_resource(r: Any, party: FocusParty, unpriced: bool) -> dict[str, str]:
    """What was used and by whom: the path as the resource, the team as the sub-account, and
    the line's labels as tags."""
    tags = dict(json.loads(r.tags_json or "{}"), model=r.model, team=r.team, arm=r.arm)
    if unpriced:
        tags["x_unpriced"] = "true"
    return {
        "ProviderName": party.provider,
        "PublisherName": party.provider,
        "ResourceId": r.path,
        "ResourceName": r.path,
        "ResourceType": "accelerator path",
        "ServiceCategory": "AI and Machine Learning",
        "ServiceName": "switchyard",
        "SubAccountId": r.team,
        "SubAccountName": r.team,
        "Tags": json.dumps(tags, sort_keys=True),
    }


def _path_currencies(conn: Any) -> dict[str, str]:
    """path -> the currency its price key is priced in (a key keeps one currency)."""
    stmt = (
        select(PATHS.c.path, func.max(PRICES.c.currency))
        .join(PRICES, PRICES.c.price_key == PATHS.c.price_key)
        .group_by(PATHS.c.path)
    )
    return {path: currency for path, currency in conn.execute(stmt)}


def export(
    engine: Engine,
    fmt: str,
    since_us: int,
    until_us: int,
    chunk_bytes: int = 64 * 1024,
    audit_key: bytes | None = None,
) -> Iterator[bytes]:
    """Yield the export in chunks of about `chunk_bytes`; a header first, rows in journal order."""
    if fmt not in ("csv", "focus"):
        raise BadInput(f"export format {fmt!r} is not csv or focus")
    check_window(since_us, until_us)
    stmt = _window(select(LINES).order_by(LINES.c.id), since_us, until_us)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_COLUMNS if fmt == "csv" else FOCUS_COLUMNS)
    party = FocusParty.from_env()
    with engine.connect() as conn:
        check_lines(conn, audit_key, since_us, until_us)  # before the first row goes out
        currencies = _path_currencies(conn) if fmt == "focus" else {}

        def convert(r: Any) -> list[str]:
            return _csv_row(r) if fmt == "csv" else _focus_row(r, party, currencies)

        for r in conn.execute(stmt).yield_per(1000):
            writer.writerow(convert(r))
            if buf.tell() >= chunk_bytes:
                yield buf.getvalue().encode()
                buf.seek(0)
                buf.truncate()
    if buf.tell():
        yield buf.getvalue().encode()
