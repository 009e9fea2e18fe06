"""An insider writes ledger lines behind metering's back; using them must fail, verify must name them.

Against the real metering service on SQLite and PostgreSQL (services/metering/rowmac.py): a
line inserted by SQL (the runtime role may INSERT into the journal), without a MAC or with
another line's, or one whose amount is changed once the append-only triggers are dropped (the
schema's owner can), is refused wherever it is used: a job's cost, a cost report, an export,
a reservation's close, and the idempotency check of the real event whose key it took (so a
forged "duplicate" cannot swallow real usage). `audit verify` names each (`line/<key>`).
Lines from before migration 0013 carry no MAC: the chain records them once, and a change to
one of them is named (`line/legacy`).
"""

from __future__ import annotations

import hashlib
import hmac
import json

import grpc
import pytest
from sqlalchemy import create_engine

from services.metering import audit, rowmac
from services.metering.db import make_engines
from services.metering.ledger import Ledger
from services.metering.records import Actor, UsageEvent
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as mgrpc
from tests.metering.metering_helpers import HOUR, T0, event, expect_status, price_paths
from tests.metering.test_integrity import plain_sql
from tests.security.ledger_attack import KEY, Metering
from tests.security.test_ledger_rows import assert_named, scalar

COLUMNS = (
    "idempotency_key, content_hash, basis, at_us, end_us, quantity_us, amount_micros, currency, "
    "price_version, method, path, reservation_id, job_id, model, team, trial_id, arm, tags_json, "
    "recorded_us, prompt_tokens, output_tokens, mac"
)


def drop_line_guards(url: str) -> None:
    """The schema's owner lifts the journal's append-only triggers."""
    if url.startswith("sqlite"):
        plain_sql(url, "DROP TRIGGER ledger_lines_no_update", "DROP TRIGGER ledger_lines_no_delete")
    else:
        plain_sql(url, "DROP TRIGGER ledger_lines_append_only ON ledger_lines")


def forged_insert(url: str, key: str, job: str, mac: str | None) -> None:
    """A busy line of 1 micro-unit for `job`, as the runtime role can INSERT one."""
    value = "NULL" if mac is None else f"'{mac}'"
    plain_sql(
        url,
        f"INSERT INTO ledger_lines ({COLUMNS}) VALUES ('{key}', '{'0' * 64}', 'busy', {T0 + 10}, {T0 + 11}, "
        f"1, 1, 'USD', 'cpu-std@{T0}', NULL, 'cpu-eager@h1', NULL, '{job}', 'mlp', 'search', '', '', '{{}}', "
        f"{T0 + 11}, 0, 0, {value})",
    )


async def _charged(stub: mgrpc.MeteringAsyncStub) -> None:
    """cpu-std at 3.6 USD an hour from T0 on cpu-eager@h1, and one honest job `real` on it."""
    await price_paths(stub, "cpu-std", ["cpu-eager@h1"])
    await stub.RecordUsage(mpb.RecordUsageRequest(events=[event("real", T0 + 1, 1_000_000)]))
    assert (await stub.VerifyAudit(mpb.VerifyAuditRequest())).ok


async def _refused_everywhere(stub: mgrpc.MeteringAsyncStub, job: str) -> None:
    for call in (
        stub.GetJobCost(mpb.GetJobCostRequest(job_id=job)),
        stub.CostReport(mpb.CostReportRequest(group_by=["path"])),
    ):
        await expect_status(call, grpc.StatusCode.FAILED_PRECONDITION, "fails its MAC")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        [c async for c in stub.Export(mpb.ExportRequest(format="csv"))]
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "fails its MAC" in str(
        err.value.details()
    )


@pytest.mark.parametrize("how", ["no-mac", "copied-mac", "amount-changed"])
async def test_a_line_written_by_sql_is_refused_at_use_and_named(
    metering: Metering, db_url: str, how: str
) -> None:
    stub = await metering.start()
    await _charged(stub)
    if how == "amount-changed":  # a cheaper job: its amount lowered, its MAC kept
        drop_line_guards(db_url)
        plain_sql(db_url, "UPDATE ledger_lines SET amount_micros = 1 WHERE idempotency_key = 'real'")
        key, job = "real", "real"
    else:
        mac = scalar(db_url, "SELECT mac FROM ledger_lines WHERE idempotency_key = 'real'")
        key, job = "forged", "real"  # a second line on the honest job: its cost doubled
        forged_insert(db_url, key, job, None if how == "no-mac" else mac)
    await _refused_everywhere(stub, job)
    await assert_named(metering, stub, f"line/{key}")


async def test_a_forged_duplicate_does_not_swallow_the_real_event(metering: Metering, db_url: str) -> None:
    """An insider inserts a line under the key a router will send next: the real event is not
    counted as a duplicate of it (it would be billed at the forger's amount, or not at all)."""
    stub = await metering.start()
    await _charged(stub)
    forged_insert(db_url, "next", "next", None)
    await expect_status(
        stub.RecordUsage(mpb.RecordUsageRequest(events=[event("next", T0 + 2, 1_000_000)])),
        grpc.StatusCode.FAILED_PRECONDITION,
        "fails its MAC",
    )
    await assert_named(metering, stub, "line/next")


async def test_a_reservation_does_not_close_over_a_forged_line(metering: Metering, db_url: str) -> None:
    stub = await metering.start()
    await price_paths(stub, "cpu-std", ["cpu-eager@h1"])
    res = await stub.OpenReservation(
        mpb.OpenReservationRequest(idempotency_key="r", path="cpu-eager@h1", start_unix_us=T0)
    )
    await stub.RecordUsage(mpb.RecordUsageRequest(events=[event("inside", T0 + 1, 1_000_000)]))
    forged_insert(db_url, "forged", "inside", None)
    close = mpb.CloseReservationRequest(reservation_id=res.reservation_id, end_unix_us=T0 + HOUR)
    await expect_status(stub.CloseReservation(close), grpc.StatusCode.FAILED_PRECONDITION, "fails its MAC")


async def test_lines_from_before_their_macs_hold_and_a_change_to_one_is_named(
    metering: Metering, db_url: str
) -> None:
    """A ledger written before migration 0013: its lines have no MAC and the chain has no
    record of them (here: lines written without a metering start, their MACs then cleared).
    The service's first start records them; they are used as before and verify is ok; one of
    them changed after that is named as a legacy line, and one forged without a MAC later is
    named as itself."""
    ledger = Ledger(make_engines(db_url), anchor_path=None)  # no service start: no record yet
    try:
        ledger.set_price(Actor("test"), "cpu-std", 3_600_000, "USD", T0)
        ledger.register_path(Actor("test"), "cpu-eager@h1", "cpu", "cpu-16", "cpu-std", "h1")
        ledger.record_usage([OLD])
    finally:
        ledger.close()
    drop_line_guards(db_url)
    plain_sql(db_url, "UPDATE ledger_lines SET mac = NULL")
    stub = await metering.start()
    assert (await stub.GetJobCost(mpb.GetJobCostRequest(job_id="old"))).total_micros == 1000
    assert (await stub.VerifyAudit(mpb.VerifyAuditRequest())).ok
    recorded = json.loads(
        scalar(db_url, "SELECT detail_json FROM audit_log WHERE action = 'ledger.lines_signed'")
    )
    assert (recorded["count"], recorded["through_id"]) == (1, 1), recorded
    plain_sql(db_url, "UPDATE ledger_lines SET amount_micros = 1 WHERE idempotency_key = 'old'")
    await assert_named(metering, stub, "line/legacy")
    forged_insert(db_url, "late", "old", None)  # after the record: not a legacy line
    await expect_status(
        stub.GetJobCost(mpb.GetJobCostRequest(job_id="old")),
        grpc.StatusCode.FAILED_PRECONDITION,
        "fails its MAC",
    )


OLD = UsageEvent(
    idempotency_key="old", path="cpu-eager@h1", model="mlp", team="search", status="completed",
    met_quality=True, busy_us=1_000_000, started_us=T0 + 1, ended_us=T0 + 1_000_001,
)  # fmt: skip


def test_a_line_mac_is_hmac_sha256_of_its_json_fields() -> None:
    """Lines signed by an earlier metering must still pass: the signer's shortcuts (copied keyed
    state, one encoder per batch) give the plain HMAC-SHA256 of the fields' compact JSON."""
    engine = create_engine("sqlite://")
    try:
        with engine.connect() as conn:
            audit.bind_key(conn, KEY.encode())
            sign = rowmac.line_signer(conn)
            key = hmac.new(KEY.encode(), rowmac.ROW_INFO, hashlib.sha256).digest()
            for values in (("k-1", None, 3, "USD", "{}", 0), ("ü-2", 1.5, -7, None, '{"a": 1}', 1 << 40)):
                body = json.dumps(["ledger_line", *values], separators=(",", ":")).encode()
                assert sign(values) == hmac.new(key, body, hashlib.sha256).hexdigest()
                assert sign(values) == sign(values)  # the keyed state is copied, never updated
    finally:
        engine.dispose()
