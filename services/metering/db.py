"""Database connection for the ledger: URL resolution, engines, and migration to head.

SQLite (a file, WAL mode) is the default; PostgreSQL comes from SWITCHYARD_DATABASE_URL.
SQLite gets two engines: writes begin with BEGIN IMMEDIATE, so two writers never deadlock
upgrading a read lock, while reads keep plain deferred transactions and run beside a writer.

On PostgreSQL the schema belongs to a migrator role (the one `migrate` connects as) and the
service runs as a runtime role with only what it needs (RUNTIME_GRANTS): on the journal and
the audit trail it may only INSERT and SELECT, so no runtime credential can change or remove
a ledger line or an audit row, and only the owner could drop the append-only triggers.
`migrate(url, runtime_role=...)` (or SWITCHYARD_DATABASE_RUNTIME_ROLE) applies the grants.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.pool import NullPool

from services.metering.metering_errors import LedgerUnavailable
from switchyard import layout

log = logging.getLogger(__name__)
ROOT = layout.data_root()  # the checkout, or the working directory of an installed wheel
DEFAULT_SQLITE = ROOT / "var" / "metering.db"
ENV_URL = "SWITCHYARD_DATABASE_URL"
ENV_RUNTIME_ROLE = "SWITCHYARD_DATABASE_RUNTIME_ROLE"

# What the runtime role may do, table by table. UPDATE on `paths` is for the row locks
# (FOR SHARE / FOR UPDATE need it); paths themselves are never changed.
RUNTIME_GRANTS = {
    "ledger_lines": "SELECT, INSERT",
    "audit_log": "SELECT, INSERT",
    "audit_head": "SELECT, UPDATE",
    "paths": "SELECT, INSERT, UPDATE",
    "prices": "SELECT, INSERT",
    "reservations": "SELECT, INSERT, UPDATE",
    "jobs": "SELECT, INSERT, UPDATE",
    "principals": "SELECT, INSERT",
    "api_keys": "SELECT, INSERT, UPDATE",
    "role_bindings": "SELECT, INSERT, DELETE",
    "trials": "SELECT, INSERT, UPDATE",
    "route_changes": "SELECT, INSERT",
    "limit_changes": "SELECT, INSERT",
    "grant_spends": "SELECT, INSERT",
    "alembic_version": "SELECT",
    "v_cost_per_completed_job": "SELECT",
    "v_idle_by_path": "SELECT",
    "v_generation_cost": "SELECT",
}


def resolve_url(url: str | None = None) -> str:
    """The explicit URL, else SWITCHYARD_DATABASE_URL, else the default SQLite file.

    A bare file path is taken as SQLite; plain `postgresql://` uses the psycopg 3 driver.
    """
    raw = url or os.environ.get(ENV_URL) or f"sqlite:///{DEFAULT_SQLITE}"
    if "://" not in raw:
        raw = f"sqlite:///{Path(raw).resolve()}"
    parsed = make_url(raw)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # Autocommit at the driver level: SQLAlchemy's "begin" event issues BEGIN itself.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    # FULL: a committed batch survives power loss, not only a process crash (ledger rows).
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


@dataclass(frozen=True)
class Engines:
    """The write and read engines of one database (the same engine on PostgreSQL)."""

    url: str
    write: Engine
    read: Engine

    @property
    def dialect(self) -> str:
        return self.write.dialect.name

    def dispose(self) -> None:
        self.write.dispose()
        if self.read is not self.write:
            self.read.dispose()


def _sqlite_engine(url: str, immediate: bool) -> Engine:
    path = make_url(url).database
    if path and path != ":memory:":
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
    event.listen(engine, "connect", _sqlite_pragmas)
    begin = "BEGIN IMMEDIATE" if immediate else "BEGIN"

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        conn.exec_driver_sql(begin)

    return engine


# libpq's settings for a server that stops answering rather than refusing (a link that drops
# every packet): without them a connect waits for TCP's own timeout and a pooled connection
# whose sent bytes went unacknowledged stays stuck on retransmissions backing off for
# minutes, so the single ledger writer hung through a 30 s blackhole and for 29 s after it.
# With them a connect gives up after 5 s and such a connection fails within 15 s (UNAVAILABLE,
# `Reach`), and the pool opens a fresh one once the server answers.
SERVER_CONNECT = {
    "connect_timeout": 5,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 3,
    "keepalives_count": 3,
    "tcp_user_timeout": 15_000,  # ms
}


def make_engines(url: str | None = None) -> Engines:
    resolved = resolve_url(url)
    if is_sqlite(resolved):
        return Engines(resolved, _sqlite_engine(resolved, True), _sqlite_engine(resolved, False))
    given = make_url(resolved).query  # the URL's own settings win over these defaults
    connect = {k: v for k, v in SERVER_CONNECT.items() if k not in given}
    engine = create_engine(resolved, pool_size=8, max_overflow=8, pool_pre_ping=True, connect_args=connect)
    return Engines(resolved, engine, engine)


# SQLSTATEs of a server that is gone or going: connection exceptions (class 08), the
# administrator's or a crash's shutdown and a server still starting (57P01-57P03), no slot left.
_GONE_STATES = ("57P01", "57P02", "57P03", "53300")


def connection_lost(exc: DBAPIError) -> bool:
    """Whether `exc` says the database could not be reached, rather than that it refused the
    statement: a connection dropped under a call, refused, or a server shutting down."""
    if exc.connection_invalidated or isinstance(exc, InterfaceError):
        return True
    state = getattr(exc.orig, "sqlstate", None)
    if state is not None:
        return str(state).startswith("08") or state in _GONE_STATES
    # psycopg's failure to connect has no SQLSTATE; SQLite's OperationalError is about the file
    return isinstance(exc, OperationalError) and type(exc.orig).__module__.startswith("psycopg")


class Reach:
    """Turns a lost database connection into LedgerUnavailable (UNAVAILABLE, DESIGN §7), which
    callers retry, instead of an unexpected error (INTERNAL) that a router's spool would take
    for a refusal and dead-letter; the pool re-connects on the next call (`pool_pre_ping`).
    Logs once when the database stops answering and once when it answers again, not per call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.lost_at: float | None = None  # monotonic; None while the database answers
        self.refused = 0  # calls answered UNAVAILABLE for a lost connection

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        try:
            yield
        except DBAPIError as exc:
            if not connection_lost(exc):
                raise
            text = str(exc.orig).strip()
            reason = text.splitlines()[0] if text else type(exc.orig).__name__
            with self._lock:
                self.refused += 1
                if self.lost_at is None:
                    self.lost_at = time.monotonic()
                    log.warning("the ledger's database cannot be reached (%s): answering UNAVAILABLE", reason)
            raise LedgerUnavailable(f"the ledger's database cannot be reached: {reason}") from exc
        if self.lost_at is not None:
            with self._lock:
                if self.lost_at is not None:
                    down_s, self.lost_at = time.monotonic() - self.lost_at, None
                    log.warning("the ledger's database answers again, after %.1f s", down_s)


def alembic_config(url: str) -> Any:
    """An Alembic Config for the repository's migrations, aimed at `url`."""
    from alembic.config import Config

    cfg = Config(str(layout.alembic_ini()))
    cfg.set_main_option("script_location", str(layout.migrations_dir()))
    cfg.attributes["database_url"] = resolve_url(url)
    return cfg


def migrate(url: str | None = None, runtime_role: str | None = None) -> None:
    """Bring the database to the newest migration (idempotent); on PostgreSQL, then give the
    runtime role (argument or SWITCHYARD_DATABASE_RUNTIME_ROLE) exactly RUNTIME_GRANTS."""
    from alembic import command

    resolved = resolve_url(url)
    command.upgrade(alembic_config(resolved), "head")
    role = runtime_role or os.environ.get(ENV_RUNTIME_ROLE, "")
    if role and not is_sqlite(resolved):
        grant_runtime(resolved, role)


def grant_runtime(url: str, role: str) -> None:
    """Reset the runtime role's privileges to RUNTIME_GRANTS (run as the schema's owner)."""
    from sqlalchemy import text

    if not role.replace("_", "").isalnum():
        raise ValueError(f"runtime role {role!r} is not a plain identifier (letters, digits, _)")
    engine = create_engine(resolve_url(url), poolclass=NullPool)
    try:
        with engine.begin() as conn:
            tables = set(
                conn.execute(
                    text("SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'")
                ).scalars()
            )
            unknown = sorted(tables - set(RUNTIME_GRANTS))
            if unknown:
                raise ValueError(f"no runtime grant decided for {', '.join(unknown)} (db.RUNTIME_GRANTS)")
            conn.execute(text(f'REVOKE ALL ON ALL TABLES IN SCHEMA public FROM "{role}"'))
            conn.execute(text(f'GRANT USAGE ON SCHEMA public TO "{role}"'))
            conn.execute(text(f'GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO "{role}"'))
            for table in sorted(tables):
                conn.execute(text(f'GRANT {RUNTIME_GRANTS[table]} ON "{table}" TO "{role}"'))
    finally:
        engine.dispose()
