"""Tampering with the audit trail, and the database roles, on SQLite and PostgreSQL.

The tamperer has the database (drops triggers, edits rows with plain SQL, resets the head
row) but not the audit key, which lives outside the database, nor the signed head digest
file. Each kind of tampering must be detected and named by `verify`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, select, text

from services.metering import audit
from services.metering.auditkey import AnchorError
from services.metering.db import make_engines, resolve_url
from services.metering.ledger import Ledger
from services.metering.limit_changes import PrincipalLimit
from services.metering.records import Actor, UsageEvent
from services.metering.schema import AUDIT
from tests.metering.metering_helpers import HOUR, T0

KEY = b"k" * 40
ACTOR = Actor("root", "test")


def plain_sql(url: str, *statements: str) -> None:
    """Someone with database access, bypassing the service."""
    engine = create_engine(resolve_url(url))
    try:
        with engine.begin() as conn:
            for stmt in statements:
                conn.execute(text(stmt))
    finally:
        engine.dispose()


def drop_guards(url: str) -> None:
    if url.startswith("sqlite"):
        plain_sql(
            url,
            "DROP TRIGGER audit_log_no_update",
            "DROP TRIGGER audit_log_no_delete",
            "DROP TRIGGER audit_head_no_delete",
        )
    else:
        plain_sql(
            url,
            "DROP TRIGGER audit_log_append_only ON audit_log",
            "DROP TRIGGER audit_log_no_truncate ON audit_log",
            "DROP TRIGGER audit_head_no_truncate ON audit_head",
        )


@pytest.fixture
def ledger(db_url: str, tmp_path: Path) -> Iterator[Ledger]:
    led = Ledger(make_engines(db_url), audit_key=KEY, anchor_path=tmp_path / "anchor.json")
    try:
        yield led
    finally:
        led.close()


def rows(led: Ledger) -> list[audit.AuditRecord]:
    return audit.query(led.engines.read, limit=100)[::-1]


def set_head(url: str, seq: int, digest: str) -> None:
    plain_sql(url, f"UPDATE audit_head SET seq = {seq}, hash = '{digest}' WHERE id = 1")


@pytest.mark.parametrize("tamper", ["altered", "deleted-middle", "deleted-tail", "truncated", "unkeyed"])
def test_each_kind_of_tampering_is_detected_and_named(ledger: Ledger, db_url: str, tamper: str) -> None:
    for i in range(6):
        ledger.audit.append(ACTOR, "test.action", f"thing/{i}", "ok", {"i": i})
    assert ledger.audit.write_anchor()  # the periodic head digest, outside the database
    assert ledger.audit.verify().ok
    if db_url.startswith("postgresql"):
        with pytest.raises(Exception, match="cannot be truncated"):
            plain_sql(db_url, "TRUNCATE audit_log")
    with pytest.raises(Exception, match="append-only"):
        plain_sql(db_url, "DELETE FROM audit_log")
    drop_guards(db_url)
    chain = rows(ledger)
    if tamper == "altered":
        plain_sql(db_url, "UPDATE audit_log SET resource = 'thing/forged' WHERE seq = 3")
        expected = ("altered", 3)
    elif tamper == "deleted-middle":
        plain_sql(db_url, "DELETE FROM audit_log WHERE seq = 3")
        expected = ("deleted", 3)
    elif tamper == "deleted-tail":
        # The newest rows go, and the head row is put back to match: only the anchor knows.
        plain_sql(db_url, "DELETE FROM audit_log WHERE seq > 4")
        set_head(db_url, 4, chain[3].hash)
        expected = ("deleted", 5)
    elif tamper == "truncated":
        plain_sql(
            db_url, "TRUNCATE audit_log" if db_url.startswith("postgresql") else "DELETE FROM audit_log"
        )
        set_head(db_url, 0, audit.GENESIS)
        expected = ("truncated", 1)
    else:
        # Rewrite a row and recompute the whole chain as a forger without the key would.
        prev = audit.GENESIS
        for rec in chain:
            resource = "thing/forged" if rec.seq == 2 else rec.resource
            forged = audit.AuditRecord(
                rec.seq, rec.at_us, rec.actor, rec.action, resource, rec.outcome, rec.detail_json, prev, ""
            )
            digest = audit.unkeyed_hash(forged)
            plain_sql(
                db_url,
                f"UPDATE audit_log SET resource = '{resource}', prev_hash = '{prev}', hash = '{digest}' "
                f"WHERE seq = {rec.seq}",
            )
            prev = digest
        set_head(db_url, chain[-1].seq, prev)
        expected = ("unkeyed", 1)
    verdict = ledger.audit.verify()
    assert (verdict.ok, verdict.problem, verdict.first_broken_seq) == (False, *expected), verdict
    assert verdict.message


def test_a_forged_anchor_is_named(ledger: Ledger, tmp_path: Path) -> None:
    ledger.audit.append(ACTOR, "test.action", "thing/1", "ok", {})
    assert ledger.audit.write_anchor()
    assert ledger.audit.anchor_path is not None
    forged = json.loads(ledger.audit.anchor_path.read_text()) | {"seq": 9}
    ledger.audit.anchor_path.write_text(json.dumps(forged))
    verdict = ledger.audit.verify()
    assert (verdict.ok, verdict.problem) == (False, "anchor")


def test_the_anchor_never_moves_back(ledger: Ledger, db_url: str) -> None:
    for i in range(3):
        ledger.audit.append(ACTOR, "test.action", f"thing/{i}", "ok", {})
    assert ledger.audit.write_anchor()  # the first anchoring appends its `audit.anchor` row
    assert ledger.audit.write_anchor() and not ledger.audit.write_anchor()  # unchanged head: not rewritten
    assert ledger.audit.anchor_path is not None
    anchored = ledger.audit.anchor_path.read_bytes()
    drop_guards(db_url)
    plain_sql(db_url, "DELETE FROM audit_log WHERE seq >= 3")
    set_head(db_url, 2, rows(ledger)[1].hash)
    with pytest.raises(AnchorError, match="below the anchored seq"):
        ledger.audit.write_anchor()  # a head put back halts the ledger, never re-signs the digest
    assert ledger.audit.anchor_path.read_bytes() == anchored
    assert ledger.audit.verify().problem == "deleted"


def test_a_ledger_with_another_key_finds_the_chain_altered(db_url: str, tmp_path: Path) -> None:
    first = Ledger(make_engines(db_url), audit_key=KEY, anchor_path=None)
    other = Ledger(make_engines(db_url), audit_key=b"x" * 40, anchor_path=None)
    try:
        first.audit.append(ACTOR, "test.action", "thing/1", "ok", {})
        assert first.audit.verify().ok
        assert (other.audit.verify().problem, other.audit.verify().first_broken_seq) == ("altered", 1)
    finally:
        first.close()
        other.close()


@pytest.mark.postgres
def test_the_runtime_role_can_run_the_ledger_but_not_rewrite_it(
    pg_roles_db: dict[str, str], tmp_path: Path
) -> None:
    runtime = Ledger(make_engines(pg_roles_db["runtime"]), audit_key=KEY, anchor_path=tmp_path / "a.json")
    try:
        # Everything the service does works as the runtime role...
        runtime.set_price(ACTOR, "cpu-std", 3_600_000, "USD", T0)
        runtime.register_path(ACTOR, "cpu@h1", "cpu", "cpu-16", "cpu-std", "h1")
        res = runtime.open_reservation(ACTOR, "res-1", "cpu@h1", T0, "trial-1")
        runtime.record_usage([UsageEvent("e1", "cpu@h1", job_id="j1", busy_us=1000, started_us=T0 + 10)])
        runtime.record_usage([UsageEvent("e2", "cpu@h1", job_id="j2", busy_us=500, started_us=T0 + 20)])
        runtime.reverse_usage(ACTOR, "fix-1", "e2", "test")
        closed = runtime.close_reservation(ACTOR, res.reservation_id, T0 + HOUR)
        assert closed.cost_micros == 3_600_000
        runtime.access.create_principal(ACTOR, "alice", "user", "ml")
        runtime.access.grant_role(ACTOR, "alice", "infer", "*")
        runtime.access.revoke_role(ACTOR, "alice", "infer", "*")
        key = runtime.access.create_key(ACTOR, "alice", 0)
        runtime.access.revoke_key(ACTOR, key.key_id)
        limit = runtime.save_limit_change(ACTOR, "prod", PrincipalLimit("alice", 1.0, 2, 0, False))
        runtime.save_route_change(ACTOR, "prod", "mlp", '{"targets": ["a"]}', "")
        assert [r.id for r in runtime.limit_changes("prod")] == [limit.id]  # its MAC holds
        assert runtime.audit.write_anchor() and runtime.audit.verify().ok
    finally:
        runtime.close()
    # ...but the journal and the audit trail take only INSERT and SELECT.
    for stmt in (
        "UPDATE ledger_lines SET amount_micros = 0",
        "DELETE FROM ledger_lines",
        "TRUNCATE ledger_lines",
        "UPDATE audit_log SET outcome = 'denied'",
        "DELETE FROM audit_log",
        "TRUNCATE audit_log",
        "DROP TRIGGER audit_log_append_only ON audit_log",
        "ALTER TABLE audit_log DISABLE TRIGGER ALL",
        "DELETE FROM audit_head",
        "UPDATE limit_changes SET rate_per_s = 0",  # the change tables too: only a MAC'd INSERT
        "DELETE FROM limit_changes",
        "UPDATE route_changes SET route_json = NULL",
    ):
        with pytest.raises(Exception, match=r"permission denied|must be owner"):
            plain_sql(pg_roles_db["runtime"], stmt)
    # The owner may not TRUNCATE either (the trigger), nor change rows (append-only).
    for stmt in ("TRUNCATE ledger_lines", "TRUNCATE audit_log", "TRUNCATE audit_head"):
        with pytest.raises(Exception, match="cannot be truncated"):
            plain_sql(pg_roles_db["migrator"], stmt)
    with pytest.raises(Exception, match="append-only"):
        plain_sql(pg_roles_db["migrator"], "DELETE FROM ledger_lines")
    engine = create_engine(resolve_url(pg_roles_db["runtime"]))
    try:
        with engine.connect() as conn:
            assert conn.execute(select(AUDIT.c.seq)).all()  # reads are allowed
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_the_migrate_command_applies_the_runtime_grants(pg_unavailable: str | None) -> None:
    import subprocess
    import sys

    from tests.conftest import ROOT
    from tests.metering.conftest import (
        MIGRATOR,
        RUNTIME,
        drop_pg_database,
        ensure_pg_roles,
        make_pg_database,
        pg_url,
    )

    if pg_unavailable is None:
        ensure_pg_roles()
    name = make_pg_database(pg_unavailable, owner=MIGRATOR)
    try:
        args = ["metering", "migrate", "--db", pg_url(name, MIGRATOR), "--runtime-role", RUNTIME]
        done = subprocess.run(
            [sys.executable, "-m", "clients.cli", *args], cwd=ROOT, capture_output=True, timeout=120
        )
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        plain_sql(
            pg_url(name, RUNTIME), "SELECT COUNT(*) FROM ledger_lines", "SELECT COUNT(*) FROM audit_log"
        )
        with pytest.raises(Exception, match="permission denied"):
            plain_sql(pg_url(name, RUNTIME), "DELETE FROM audit_log")
    finally:
        drop_pg_database(name)
