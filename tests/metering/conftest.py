"""Fixtures for the ledger tests: a fresh database per test on SQLite and on PostgreSQL.

PostgreSQL is the server at 127.0.0.1:5432 (user postgres, trust). Each test gets its own
uniquely named database, dropped afterwards, because other suites use the server at the same
time. Under CI=true an unreachable server fails the tests; elsewhere they skip with a notice.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import psycopg
import pytest

from services.metering.db import migrate
from services.metering.metering_server import RunningMetering, start_metering
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as pb_grpc
from switchyard.grpcio import ServerOptions
from tests.conftest import IN_CI

# The port can be moved (SWITCHYARD_TEST_PG_PORT) to check the unreachable case both ways.
PG_PORT = int(os.environ.get("SWITCHYARD_TEST_PG_PORT", "5432"))
PG_ADMIN = f"host=127.0.0.1 port={PG_PORT} user=postgres dbname=test connect_timeout=3"


def _pg_reason() -> str | None:
    try:
        with psycopg.connect(PG_ADMIN):
            return None
    except psycopg.Error as exc:
        return f"PostgreSQL not reachable at 127.0.0.1:{PG_PORT} ({str(exc).strip().splitlines()[0]})"


@pytest.fixture(scope="session")
def pg_unavailable() -> str | None:
    return _pg_reason()


def make_pg_database(reason: str | None, template: str = "", owner: str = "") -> str:
    if reason:
        if IN_CI:
            pytest.fail(f"{reason}; CI=true requires PostgreSQL")
        pytest.skip(f"NOTICE: {reason}; PostgreSQL tests skipped")
    name = f"sy_metering_{uuid.uuid4().hex[:12]}"
    clause = f' TEMPLATE "{template}"' if template else ""
    clause += f' OWNER "{owner}"' if owner else ""
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"{clause}')
        # Tests check behaviour, not crash durability: skip the WAL flush at each commit.
        conn.execute(f'ALTER DATABASE "{name}" SET synchronous_commit = off')
    return name


def pg_url(name: str, user: str = "postgres") -> str:
    return f"postgresql+psycopg://{user}@127.0.0.1:{PG_PORT}/{name}"


# The two database roles of a production deployment: the schema's owner runs the migrations,
# the service runs as the runtime role (services.metering.db.RUNTIME_GRANTS).
MIGRATOR, RUNTIME = "switchyard_migrator", "switchyard_runtime"


def ensure_pg_roles() -> None:
    """Create the roles once (they are cluster-wide; other runs may be creating them too)."""
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        for role in (MIGRATOR, RUNTIME):
            with contextlib.suppress(psycopg.errors.DuplicateObject, psycopg.errors.UniqueViolation):
                conn.execute(f'CREATE ROLE "{role}" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE')


@pytest.fixture
def pg_roles_db(pg_unavailable: str | None) -> Iterator[dict[str, str]]:
    """A PostgreSQL ledger owned and migrated by the migrator role, with the runtime role's
    grants applied: URLs for "migrator", "runtime" and "superuser" (a DBA, for tampering)."""
    if pg_unavailable is None:
        ensure_pg_roles()
    name = make_pg_database(pg_unavailable, owner=MIGRATOR)
    try:
        migrate(pg_url(name, MIGRATOR), runtime_role=RUNTIME)
        yield {
            "migrator": pg_url(name, MIGRATOR),
            "runtime": pg_url(name, RUNTIME),
            "superuser": pg_url(name),
        }
    finally:
        drop_pg_database(name)


@pytest.fixture(scope="session")
def migrated_templates(
    tmp_path_factory: pytest.TempPathFactory, pg_unavailable: str | None
) -> Iterator[dict[str, str]]:
    """Databases migrated once per session; each test starts from a copy (migrating ~50 fresh
    databases would dominate the run). test_migrations.py migrates fresh ones itself."""
    folder = tmp_path_factory.mktemp("ledger-template")
    sqlite_file = folder / "template.db"
    migrate(f"sqlite:///{sqlite_file}")
    out = {"sqlite": str(sqlite_file)}
    if pg_unavailable is None:
        name = make_pg_database(None)
        migrate(pg_url(name))
        out["postgres"] = name
    try:
        yield out
    finally:
        if "postgres" in out:
            drop_pg_database(out["postgres"])


def drop_pg_database(name: str) -> None:
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def fresh_db_url(request: pytest.FixtureRequest, tmp_path: Path, pg_unavailable: str | None) -> Iterator[str]:
    """An empty database (no schema) of each kind."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.db'}"
        return
    name = make_pg_database(pg_unavailable)
    try:
        yield pg_url(name)
    finally:
        drop_pg_database(name)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    pg_unavailable: str | None,
    migrated_templates: dict[str, str],
) -> Iterator[str]:
    """A database of each kind at the newest schema, private to the test."""
    if request.param == "sqlite":
        target = tmp_path / "ledger.db"
        shutil.copyfile(migrated_templates["sqlite"], target)
        yield f"sqlite:///{target}"
        return
    name = make_pg_database(pg_unavailable, migrated_templates.get("postgres", ""))
    try:
        yield pg_url(name)
    finally:
        drop_pg_database(name)


@pytest.fixture
async def metering(db_url: str) -> AsyncIterator[RunningMetering]:
    running = await start_metering(db_url, ServerOptions(port=0))
    try:
        yield running
    finally:
        await running.stop(0.5)


@pytest.fixture
async def stub(metering: RunningMetering) -> AsyncIterator[pb_grpc.MeteringAsyncStub]:
    async with grpc.aio.insecure_channel(metering.address) as channel:
        yield pb_grpc.MeteringStub(channel)
