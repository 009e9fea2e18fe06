"""`switchyard up` against PostgreSQL and a Temporal server it did not start, unchanged.

The same binaries, pointed elsewhere by two environment variables: the ledger goes to a
fresh PostgreSQL database at 127.0.0.1:5432 and the trial worker polls an already running
Temporal server, which `switchyard up` must neither start nor stop.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.local_cluster import health
from clients.local_cluster.traffic import create_team_key
from switchyard.net import free_port
from tests.conftest import IN_CI, ROOT
from tests.processes import alive, descendants

pytestmark = [pytest.mark.postgres, pytest.mark.slow]
PG_ADMIN = "host=127.0.0.1 port=5432 user=postgres dbname=test connect_timeout=3"


@pytest.fixture
def pg_database() -> Iterator[str]:
    import psycopg

    name = f"sy_cluster_{uuid.uuid4().hex[:10]}"
    try:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as exc:
        if IN_CI:
            pytest.fail(f"PostgreSQL at 127.0.0.1:5432 is required under CI: {exc}")
        pytest.skip(f"NOTICE: no PostgreSQL at 127.0.0.1:5432 ({exc}); test skipped")
    try:
        yield name
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def external_temporal(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port("127.0.0.1")
    binary = Path(sys.executable).with_name("temporal")
    argv = [str(binary), "server", "start-dev", "--ip", "127.0.0.1", "--port", str(port), "--headless"]
    argv += ["--log-level", "error", "--db-filename", str(tmp_path / "external-temporal.db")]
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    address = f"127.0.0.1:{port}"
    try:
        for _ in range(120):
            if asyncio.run(health.temporal_health(address)) == health.SERVING:
                break
            time.sleep(0.5)
        else:
            pytest.fail("the external Temporal dev server did not come up")
        yield address, proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def test_up_with_postgres_and_a_remote_temporal(
    tmp_path: Path, pg_database: str, external_temporal: tuple[str, subprocess.Popen[bytes]]
) -> None:
    import psycopg

    temporal, temporal_proc = external_temporal
    config = tmp_path / "switchyard.toml"
    config.write_text(
        f'state_dir = "{tmp_path / "state"}"\n'
        "[metering]\nport = 0\n[evaluator]\nport = 0\n[router]\nport = 0\nopenai_port = 0\n"
        '[executors.cpu]\nport = 0\nmodels = ["mlp"]\n[executors.xla]\nenabled = false\n'
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "SWITCHYARD_DATABASE_URL": f"postgresql+psycopg://postgres@127.0.0.1:5432/{pg_database}",
        "SWITCHYARD_TEMPORAL": temporal,
    }
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "clients.cli", "up", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    state_file = tmp_path / "state" / "cluster.json"
    try:
        deadline = time.monotonic() + 240
        while not state_file.exists():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        state = json.loads(state_file.read_text())
        started = descendants(proc.pid)
        assert "temporal" not in state["services"]  # nothing local: the remote one is used
        assert state["temporal_address"] == temporal
        assert temporal_proc.pid not in started
        # The worker polls the remote Temporal; metering writes to PostgreSQL.
        assert asyncio.run(health.temporal_pollers(temporal, "default", "switchyard-trials")) >= 1
        team = asyncio.run(create_team_key(state["services"]["metering"]["address"], "team-pg"))
        with psycopg.connect(f"host=127.0.0.1 port=5432 user=postgres dbname={pg_database}") as conn:
            row = conn.execute("SELECT name FROM principals WHERE name = 'team-pg'").fetchone()
        assert row == ("team-pg",) and team.key_id
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        code = proc.wait(90)
    assert code == 0, log.read_text()[-3000:]
    assert [pid for pid in started if alive(pid)] == []
    assert temporal_proc.poll() is None, "switchyard up stopped a Temporal server it did not start"
