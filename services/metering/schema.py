"""The ledger schema (SQLAlchemy 2 typed ORM); Alembic migrations in migrations/ follow it.

Money is BIGINT micro-units plus an ISO currency code, never float. `ledger_lines` is the
append-only journal: one row per usage event (its busy cost) and one per idle share,
preparation charge or reversal, each with a unique idempotency key. A NULL amount means
"unpriced" (no price in force): it is reported as such, never summed as zero. A generation
request's line also holds its prompt and output tokens (0 on every other line; a reversal
negates them, as it negates the amount).
Times are integer microseconds since the Unix epoch (UTC).
"""

from __future__ import annotations

from typing import cast

from sqlalchemy import (
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Explicit constraint names so SQLite and PostgreSQL migrations agree and `alembic check` is clean.
NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite only auto-increments an INTEGER PRIMARY KEY; PostgreSQL gets a BIGINT identity.
SerialId = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class PriceRow(Base):
    """Dated price book: the price in force at t is the latest effective_from_us <= t."""

    __tablename__ = "prices"
    __table_args__ = (UniqueConstraint("price_key", "effective_from_us"),)

    id: Mapped[int] = mapped_column(SerialId, primary_key=True, autoincrement=True)
    price_key: Mapped[str] = mapped_column(String(200))
    micros_per_hour: Mapped[int] = mapped_column(BigInteger)
    currency: Mapped[str] = mapped_column(String(3))
    effective_from_us: Mapped[int] = mapped_column(BigInteger)
    version: Mapped[str] = mapped_column(String(240), unique=True)
    created_us: Mapped[int] = mapped_column(BigInteger)
    mac: Mapped[str | None] = mapped_column(String(64))  # services/metering/rowmac.py
    example: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())  # Price.example


class PathRow(Base):
    """An accelerator path (one executor's resource) and the price key it is charged at."""

    __tablename__ = "paths"

    path: Mapped[str] = mapped_column(String(200), primary_key=True)
    backend: Mapped[str] = mapped_column(String(64))
    resource_class: Mapped[str] = mapped_column(String(200))
    price_key: Mapped[str] = mapped_column(String(200))
    host: Mapped[str] = mapped_column(String(200))
    created_us: Mapped[int] = mapped_column(BigInteger)
    mac: Mapped[str | None] = mapped_column(String(64))  # services/metering/rowmac.py


class ReservationRow(Base):
    """A path holding capacity from start to end; closing it crystallises the idle lines."""

    __tablename__ = "reservations"
    __table_args__ = (Index(None, "path", "start_us"),)

    reservation_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    idempotency_key: Mapped[str] = mapped_column(String(200), unique=True)
    path: Mapped[str] = mapped_column(ForeignKey("paths.path"))
    start_us: Mapped[int] = mapped_column(BigInteger)
    end_us: Mapped[int | None] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(16))
    trial_id: Mapped[str] = mapped_column(String(200))
    cost_micros: Mapped[int | None] = mapped_column(BigInteger)
    idle_micros: Mapped[int | None] = mapped_column(BigInteger)
    currency: Mapped[str | None] = mapped_column(String(3))
    price_version: Mapped[str] = mapped_column(String(1000))
    closed_us: Mapped[int | None] = mapped_column(BigInteger)


class JobRow(Base):
    """A request job or a trial job; `met_quality` decides whether it counts as completed."""

    __tablename__ = "jobs"
    __table_args__ = (Index(None, "path", "ended_us"),)

    job_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    path: Mapped[str] = mapped_column(ForeignKey("paths.path"))
    model: Mapped[str] = mapped_column(String(200))
    model_version: Mapped[str] = mapped_column(String(64))
    team: Mapped[str] = mapped_column(String(200))
    principal: Mapped[str] = mapped_column(String(200))
    trial_id: Mapped[str] = mapped_column(String(200))
    arm: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    met_quality: Mapped[bool] = mapped_column(Boolean)
    started_us: Mapped[int] = mapped_column(BigInteger)
    ended_us: Mapped[int] = mapped_column(BigInteger)


class LedgerLine(Base):
    """One immutable journal row. basis: busy | idle_share | idle | prepare | reversal.
    A reversal's method is 'reverses <key>', unique among reversals: a line is reversed once."""

    __tablename__ = "ledger_lines"
    __table_args__ = (
        Index(None, "path", "at_us"),
        Index(None, "job_id"),
        Index(None, "reservation_id"),
        Index(
            "uq_ledger_lines_reversal_target",
            "method",
            unique=True,
            sqlite_where=text("basis = 'reversal'"),
            postgresql_where=text("basis = 'reversal'"),
        ),
    )

    id: Mapped[int] = mapped_column(SerialId, primary_key=True, autoincrement=True)
    idempotency_key: Mapped[str] = mapped_column(String(240), unique=True)
    content_hash: Mapped[str] = mapped_column(String(64))
    basis: Mapped[str] = mapped_column(String(16))
    at_us: Mapped[int] = mapped_column(BigInteger)
    end_us: Mapped[int] = mapped_column(BigInteger)
    quantity_us: Mapped[int] = mapped_column(BigInteger)
    amount_micros: Mapped[int | None] = mapped_column(BigInteger)
    currency: Mapped[str | None] = mapped_column(String(3))
    price_version: Mapped[str | None] = mapped_column(String(1000))
    method: Mapped[str | None] = mapped_column(String(200))
    path: Mapped[str] = mapped_column(ForeignKey("paths.path"))
    reservation_id: Mapped[str | None] = mapped_column(String(64))
    job_id: Mapped[str | None] = mapped_column(String(200))
    model: Mapped[str] = mapped_column(String(200))
    team: Mapped[str] = mapped_column(String(200))
    trial_id: Mapped[str] = mapped_column(String(200))
    arm: Mapped[str] = mapped_column(String(64))
    tags_json: Mapped[str] = mapped_column(Text)
    recorded_us: Mapped[int] = mapped_column(BigInteger)
    # Tokens of a generation request (migration 0005); the default keeps older writers valid.
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    output_tokens: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    mac: Mapped[str | None] = mapped_column(String(64))  # services/metering/rowmac.py (migration 0013)


class PrincipalRow(Base):
    __tablename__ = "principals"

    principal_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    kind: Mapped[str] = mapped_column(String(16))
    team: Mapped[str] = mapped_column(String(200))
    created_us: Mapped[int] = mapped_column(BigInteger)


class RoleBindingRow(Base):
    """Roles are additive: a principal's permissions are the union of its bindings."""

    __tablename__ = "role_bindings"
    __table_args__ = (UniqueConstraint("principal_id", "role", "scope"),)

    id: Mapped[int] = mapped_column(SerialId, primary_key=True, autoincrement=True)
    principal_id: Mapped[str] = mapped_column(ForeignKey("principals.principal_id"))
    role: Mapped[str] = mapped_column(String(32))
    scope: Mapped[str] = mapped_column(String(200))
    created_us: Mapped[int] = mapped_column(BigInteger)
    mac: Mapped[str | None] = mapped_column(String(64))  # services/metering/rowmac.py


class ApiKeyRow(Base):
    """The key id is stored in clear, the secret only as a salted SHA-256 digest."""

    __tablename__ = "api_keys"

    key_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    principal_id: Mapped[str] = mapped_column(ForeignKey("principals.principal_id"))
    secret_hash: Mapped[str] = mapped_column(String(64))
    created_us: Mapped[int] = mapped_column(BigInteger)
    expires_us: Mapped[int] = mapped_column(BigInteger)
    revoked_us: Mapped[int | None] = mapped_column(BigInteger)
    mac: Mapped[str | None] = mapped_column(String(64))  # services/metering/rowmac.py


class AuditRow(Base):
    """Hash-chained audit trail: `hash` covers this row's fields and `prev_hash`."""

    __tablename__ = "audit_log"

    seq: Mapped[int] = mapped_column(SerialId, primary_key=True, autoincrement=True)
    at_us: Mapped[int] = mapped_column(BigInteger)
    principal: Mapped[str] = mapped_column(String(200))
    source: Mapped[str] = mapped_column(String(200))
    request_id: Mapped[str] = mapped_column(String(200))
    trace_id: Mapped[str] = mapped_column(String(64))
    action: Mapped[str] = mapped_column(String(64), index=True)
    resource: Mapped[str] = mapped_column(String(400))
    outcome: Mapped[str] = mapped_column(String(16))
    detail_json: Mapped[str] = mapped_column(Text)
    prev_hash: Mapped[str] = mapped_column(String(64))
    hash: Mapped[str] = mapped_column(String(64))


class AuditHeadRow(Base):
    """The chain's head (last seq and hash), so deleting the newest rows is also detected."""

    __tablename__ = "audit_head"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger)
    hash: Mapped[str] = mapped_column(String(64))


class TrialRow(Base):
    """A trial as the trial workflow records it, with its final report and verdicts."""

    __tablename__ = "trials"

    trial_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    workflow_id: Mapped[str] = mapped_column(String(200))
    model: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16))
    spec_json: Mapped[str] = mapped_column(Text)
    report_json: Mapped[str] = mapped_column(Text)
    verdicts_json: Mapped[str] = mapped_column(Text)
    created_us: Mapped[int] = mapped_column(BigInteger)
    updated_us: Mapped[int] = mapped_column(BigInteger)


class RouteChangeRow(Base):
    """A run-time route change made through a router's RouterAdmin, shared by the routers of
    its fleet. Append-only history; the latest row per fleet and model (highest id) is in force,
    and a NULL route_json means the route was deleted.
    """

    __tablename__ = "route_changes"
    __table_args__ = (Index(None, "fleet", "model", "id"),)

    id: Mapped[int] = mapped_column(SerialId, primary_key=True, autoincrement=True)
    fleet: Mapped[str] = mapped_column(String(200))
    model: Mapped[str] = mapped_column(String(200))
    route_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    changed_us: Mapped[int] = mapped_column(BigInteger)
    principal: Mapped[str] = mapped_column(String(200))
    request_id: Mapped[str] = mapped_column(String(200))
    mac: Mapped[str | None] = mapped_column(String(64))  # services/metering/rowmac.py (migration 0014)


class LimitChangeRow(Base):
    """A principal's limits set through a router's RouterAdmin, shared by the routers of its
    fleet. Append-only history; the latest row per fleet and principal (highest id) is in force,
    and `reset` means back to the routers' configured defaults.
    """

    __tablename__ = "limit_changes"
    __table_args__ = (Index(None, "fleet", "principal_id", "id"),)

    id: Mapped[int] = mapped_column(SerialId, primary_key=True, autoincrement=True)
    fleet: Mapped[str] = mapped_column(String(200))
    principal_id: Mapped[str] = mapped_column(String(200))
    rate_per_s: Mapped[float] = mapped_column(Float)
    burst: Mapped[int] = mapped_column(Integer)
    max_in_flight: Mapped[int] = mapped_column(Integer)
    reset: Mapped[bool] = mapped_column(Boolean)
    changed_us: Mapped[int] = mapped_column(BigInteger)
    principal: Mapped[str] = mapped_column(String(200))
    request_id: Mapped[str] = mapped_column(String(200))
    mac: Mapped[str | None] = mapped_column(String(64))  # services/metering/rowmac.py (migration 0014)


class GrantSpendRow(Base):
    """A trial grant spent: the Temporal run that first verified it (services/metering/grant_spends.py).
    Only ever inserted; another run verifying the same grant is refused, the same run passes."""

    __tablename__ = "grant_spends"

    grant_id: Mapped[str] = mapped_column(String(64), primary_key=True)  # sha256 of the grant
    run_id: Mapped[str] = mapped_column(String(200))
    subject: Mapped[str] = mapped_column(String(400))
    principal_id: Mapped[str] = mapped_column(String(200))
    spent_us: Mapped[int] = mapped_column(BigInteger)


# Core handles on the tables (the hot paths use Core statements, not ORM sessions).
PRICES = cast(Table, PriceRow.__table__)
PATHS = cast(Table, PathRow.__table__)
RESERVATIONS = cast(Table, ReservationRow.__table__)
JOBS = cast(Table, JobRow.__table__)
LINES = cast(Table, LedgerLine.__table__)
PRINCIPALS = cast(Table, PrincipalRow.__table__)
BINDINGS = cast(Table, RoleBindingRow.__table__)
KEYS = cast(Table, ApiKeyRow.__table__)
AUDIT = cast(Table, AuditRow.__table__)
HEAD = cast(Table, AuditHeadRow.__table__)
TRIALS = cast(Table, TrialRow.__table__)
ROUTE_CHANGES = cast(Table, RouteChangeRow.__table__)
LIMIT_CHANGES = cast(Table, LimitChangeRow.__table__)
GRANT_SPENDS = cast(Table, GrantSpendRow.__table__)
