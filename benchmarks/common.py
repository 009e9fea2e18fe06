"""What several benchmarks share: scratch PostgreSQL databases and the JSON report."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine

ROOT = Path(__file__).resolve().parent.parent
PG_HOST = "postgresql+psycopg://postgres@127.0.0.1:5432"


@contextlib.contextmanager
def postgres_databases(prefix: str, count: int) -> Iterator[list[str] | None]:
    """`count` new, uniquely named databases on the local PostgreSQL as URLs, dropped
    afterwards (other suites share the server); None, with a printed notice, when the server
    cannot be reached: reachable or not is reported, never hidden."""
    names = [f"{prefix}_{uuid.uuid4().hex[:8]}" for _ in range(count)]
    admin = create_engine(f"{PG_HOST}/test", isolation_level="AUTOCOMMIT")
    try:
        try:
            with admin.connect() as conn:
                for name in names:
                    conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        except Exception as exc:
            print(f"NOTICE: PostgreSQL not reachable, skipped ({exc.__class__.__name__})")
            yield None
            return
        try:
            yield [f"{PG_HOST}/{name}" for name in names]
        finally:
            with admin.connect() as conn:
                for name in names:
                    conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()


def write_report(name: str, report: Any) -> Path:
    """out/bench/<name>.json, announced."""
    out = ROOT / "out" / "bench" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return out
