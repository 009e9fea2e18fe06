"""The migrations: `alembic upgrade head` and `alembic check` clean on SQLite and PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.exc import DBAPIError

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


def test_lines_written_before_0005_hold_zero_tokens(fresh_db_url: str) -> None:
    """0005 adds the token columns to a journal that already has lines (append-only triggers in
    place): the old lines read 0 tokens, and new lines carry theirs."""
    cfg = alembic_config(fresh_db_url)
    command.upgrade(cfg, "0004")
    engine = create_engine(resolve_url(fresh_db_url))
    line = (
        "INSERT INTO ledger_lines (idempotency_key, content_hash, basis, at_us, end_us, quantity_us, "
        "amount_micros, path, model, team, trial_id, arm, tags_json, recorded_us{extra}) VALUES "
        "(:key, 'h', 'busy', 1, 2, 1, 5, 'p', 'm', 't', '', '', '{{}}', 3{values})"
    )
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO paths VALUES ('p', 'cpu', 'c', 'k', 'h', 0)"))
        conn.execute(text(line.format(extra="", values="")), {"key": "old"})
    command.upgrade(cfg, "head")
    with engine.begin() as conn:
        conn.execute(
            text(line.format(extra=", prompt_tokens, output_tokens", values=", 7, 9")), {"key": "new"}
        )
        got = conn.execute(
            text("SELECT idempotency_key, prompt_tokens, output_tokens FROM ledger_lines ORDER BY id")
        ).all()
        assert [tuple(r) for r in got] == [("old", 0, 0), ("new", 7, 9)]
        with pytest.raises(DBAPIError):  # still append-only
            conn.execute(text("UPDATE ledger_lines SET output_tokens = 1"))
    engine.dispose()
    command.downgrade(cfg, "0004")
    with engine.connect() as conn:
        assert "output_tokens" not in {c["name"] for c in inspect(conn).get_columns("ledger_lines")}
    engine.dispose()
