"""Keys, roles and the audit trail, against the real service and database."""

from __future__ import annotations

import grpc
import pytest
from sqlalchemy import create_engine, text

from services.metering.audit import row_hash
from services.metering.db import resolve_url
from services.metering.metering_server import RunningMetering
from services.metering.records import Actor
from switchyard.gen.switchyard.v1 import metering_pb2 as pb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as pb_grpc
from tests.metering.metering_helpers import expect_status, setup_path


def plain_sql(db_url: str, *statements: str) -> None:
    """Someone with database access, bypassing the service."""
    engine = create_engine(resolve_url(db_url))
    with engine.begin() as conn:
        for stmt in statements:
            conn.execute(text(stmt))
    engine.dispose()


def drop_audit_triggers(db_url: str) -> None:
    if db_url.startswith("sqlite"):
        plain_sql(db_url, "DROP TRIGGER audit_log_no_update", "DROP TRIGGER audit_log_no_delete")
    else:
        plain_sql(db_url, "DROP TRIGGER audit_log_append_only ON audit_log")


async def admin_actions(stub: pb_grpc.MeteringAsyncStub, n: int = 3) -> None:
    who = pb.Actor(principal="root", source="test", request_id="req-1", trace_id="ab" * 16)
    for i in range(n):
        await stub.CreatePrincipal(
            pb.CreatePrincipalRequest(name=f"user{i}", kind="user", team="ml", actor=who)
        )


async def test_keys_are_never_stored_in_clear_and_revocation_stops_them(
    metering: RunningMetering, stub: pb_grpc.MeteringAsyncStub, db_url: str
) -> None:
    await stub.CreatePrincipal(pb.CreatePrincipalRequest(name="svc-router", kind="service", team="platform"))
    await stub.GrantRole(pb.RoleRequest(principal="svc-router", role="infer", scope="model:mlp"))
    await stub.GrantRole(pb.RoleRequest(principal="svc-router", role="ledger:read", scope="*"))
    made = await stub.CreateKey(pb.CreateKeyRequest(principal="svc-router"))
    assert made.key == f"{made.key_id}.{made.secret}" and len(made.secret) >= 40
    who = await stub.Authenticate(pb.AuthenticateRequest(key=made.key))
    assert who.principal.name == "svc-router" and who.key_id == made.key_id
    assert {(r.role, r.scope) for r in who.roles} == {("infer", "model:mlp"), ("ledger:read", "*")}
    # Nowhere in the database, in any table or column, is the secret.
    engine = create_engine(resolve_url(db_url))
    with engine.connect() as conn:
        tables = ["api_keys", "audit_log", "principals", "role_bindings"]
        dump = " ".join(str(tuple(row)) for t in tables for row in conn.execute(text(f"SELECT * FROM {t}")))
    engine.dispose()
    assert made.key_id in dump and made.secret not in dump
    wrong = made.key[:-2] + ("xx" if not made.key.endswith("xx") else "yy")
    await expect_status(stub.Authenticate(pb.AuthenticateRequest(key=wrong)), grpc.StatusCode.UNAUTHENTICATED)
    await stub.RevokeKey(pb.RevokeKeyRequest(key_id=made.key_id))
    await expect_status(
        stub.Authenticate(pb.AuthenticateRequest(key=made.key)), grpc.StatusCode.UNAUTHENTICATED
    )
    await stub.RevokeRole(pb.RoleRequest(principal="svc-router", role="infer", scope="model:mlp"))
    second = await stub.CreateKey(pb.CreateKeyRequest(principal="svc-router"))
    again = await stub.Authenticate(pb.AuthenticateRequest(key=second.key))
    assert [(r.role, r.scope) for r in again.roles] == [("ledger:read", "*")]
    actions = [r.action for r in (await stub.QueryAudit(pb.QueryAuditRequest(limit=50))).records]
    assert {"key.create", "key.revoke", "role.grant", "role.revoke", "auth.denied"} <= set(actions)


@pytest.mark.parametrize("tamper", ["altered", "deleted", "inserted"])
async def test_audit_verify_names_the_first_tampered_row(
    metering: RunningMetering, stub: pb_grpc.MeteringAsyncStub, db_url: str, tamper: str
) -> None:
    # the rows the service wrote as it started (its record of legacy lines, its first anchoring)
    base = (await stub.VerifyAudit(pb.VerifyAuditRequest())).rows_checked
    await admin_actions(stub, 5)
    ok = await stub.VerifyAudit(pb.VerifyAuditRequest())
    assert ok.ok and ok.rows_checked == base + 5
    # The table refuses edits outright...
    with pytest.raises(Exception, match="append-only"):
        plain_sql(db_url, f"UPDATE audit_log SET outcome = 'denied' WHERE seq = {base + 3}")
    # ...so the tamperer drops the triggers first, then edits with plain SQL.
    drop_audit_triggers(db_url)
    if tamper == "altered":
        plain_sql(db_url, f"UPDATE audit_log SET resource = 'principal/mallory' WHERE seq = {base + 3}")
        expected = base + 3
    elif tamper == "deleted":
        plain_sql(db_url, f"DELETE FROM audit_log WHERE seq = {base + 2}")
        expected = base + 2
    else:
        # A forged row with a correct HMAC (an insider with the key), linked to the last real
        # row: only the head betrays it.
        last = (await stub.QueryAudit(pb.QueryAuditRequest(limit=1))).records[0]
        forged = row_hash(
            metering.ledger.tx.audit_key,
            base + 6,
            last.at_unix_us + 1,
            Actor("root"),
            "price.set",
            "price/gpu",
            "ok",
            "{}",
            last.hash,
        )
        plain_sql(
            db_url,
            "INSERT INTO audit_log (seq, at_us, principal, source, request_id, trace_id, action, resource, "
            f"outcome, detail_json, prev_hash, hash) VALUES ({base + 6}, {last.at_unix_us + 1}, 'root', "
            f"'', '', '', 'price.set', 'price/gpu', 'ok', '{{}}', '{last.hash}', '{forged}')",
        )
        expected = base + 6
    bad = await stub.VerifyAudit(pb.VerifyAuditRequest())
    assert (bad.ok, bad.first_broken_seq, bad.problem) == (False, expected, tamper)


async def test_admin_changes_are_audited_with_actor_and_chain(stub: pb_grpc.MeteringAsyncStub) -> None:
    await setup_path(stub)
    await admin_actions(stub, 1)
    rec = await stub.AppendAudit(
        pb.AppendAuditRequest(
            actor=pb.Actor(principal="alice", source="router", request_id="r-9", trace_id="cd" * 16),
            action="request.denied",
            resource="model/mlp",
            outcome="denied",
            detail_json='{"reason": "no infer role"}',
        )
    )
    records = (await stub.QueryAudit(pb.QueryAuditRequest(limit=10))).records
    actions = ["request.denied", "principal.create", "path.register", "price.set"]
    assert [r.action for r in records][:4] == actions
    assert records[0].prev_hash == records[1].hash and rec.seq == records[0].seq
    denied = (await stub.QueryAudit(pb.QueryAuditRequest(action="request.denied"))).records
    assert denied[0].actor.trace_id == "cd" * 16 and denied[0].actor.source == "router"
    await expect_status(
        stub.AppendAudit(pb.AppendAuditRequest(action="x", outcome="maybe")), grpc.StatusCode.INVALID_ARGUMENT
    )


def test_an_expired_key_stops_authenticating(db_url: str) -> None:
    """With a controllable clock (a fake, not a patch): valid until its expiry, then refused."""
    from services.metering.db import make_engines
    from services.metering.ledger import Ledger
    from services.metering.metering_errors import AuthFailed

    now = [T_KEY]
    ledger = Ledger(make_engines(db_url), clock=lambda: now[0])
    try:
        ledger.access.create_principal(Actor("root"), "temp-contractor", "user", "ml")
        key = ledger.access.create_key(Actor("root"), "temp-contractor", T_KEY + 60_000_000)
        assert ledger.access.authenticate(key.key).principal.name == "temp-contractor"
        now[0] = T_KEY + 60_000_000
        with pytest.raises(AuthFailed):
            ledger.access.authenticate(key.key)
        assert ledger.audit.query("auth.denied", "", 0, 0, 10)[0].resource == f"key/{key.key_id}"
    finally:
        ledger.close()


T_KEY = 1_767_225_600_000_000


async def test_audit_rows_take_the_trace_id_from_the_call(stub: pb_grpc.MeteringAsyncStub) -> None:
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    rec = await stub.AppendAudit(
        pb.AppendAuditRequest(
            actor=pb.Actor(principal="bob", source="router"), action="route.change", outcome="ok"
        ),
        metadata=[("traceparent", f"00-{trace}-00f067aa0ba902b7-01")],
    )
    assert rec.actor.trace_id == trace
    named = await stub.AppendAudit(
        pb.AppendAuditRequest(actor=pb.Actor(trace_id="ab" * 16), action="route.change", outcome="ok"),
        metadata=[("traceparent", f"00-{trace}-00f067aa0ba902b7-01")],
    )
    assert named.actor.trace_id == "ab" * 16  # the caller's own word wins
