"""The migrations: `alembic upgrade head` and `alembic check` clean on SQLite and PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from alembic import command
from sqlalchemy import create_engine, inspect, text

from services.metering.db import alembic_config, resolve_url

ROOT = Path(__file__).resolve().parents[2]


def alembic_cli(db_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The command an operator runs, from the repository root."""
    exe = Path(sys.executable).parent / "alembic"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [str(exe), "-x", f"db={db_url}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_alembic_upgrade_head_and_check_are_clean(fresh_db_url: str) -> None:
    db_url = fresh_db_url
    up = alembic_cli(db_url, "upgrade", "head")
    assert up.returncode == 0, up.stderr
    check = alembic_cli(db_url, "check")
    assert check.returncode == 0, check.stderr + check.stdout
    assert "No new upgrade operations detected" in check.stdout + check.stderr
    engine = create_engine(resolve_url(db_url))
    with engine.connect() as conn:
        names = set(inspect(conn).get_view_names())
        assert {"v_cost_per_completed_job", "v_idle_by_path"} <= names
        assert conn.execute(text("SELECT COUNT(*) FROM v_cost_per_completed_job")).scalar() == 0
    engine.dispose()


def test_downgrade_to_base_and_back(fresh_db_url: str) -> None:
    db_url = fresh_db_url
    cfg = alembic_config(db_url)
    command.upgrade(cfg, "head")
    command.downgrade(cfg, "base")
    engine = create_engine(resolve_url(db_url))
    with engine.connect() as conn:
        assert set(inspect(conn).get_table_names()) <= {"alembic_version"}
    engine.dispose()
    command.upgrade(cfg, "head")
    command.check(cfg)
