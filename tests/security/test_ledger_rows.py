"""An insider writes power rows behind metering's back; using them must fail, verify must name them.

Against the real metering service on SQLite and PostgreSQL: a role binding inserted by SQL
(`admin` on `*`, without a MAC or with another row's MAC) grants nothing; a revoked key
whose `revoked_us` is cleared does not authenticate; a key row inserted by SQL with a valid
secret hash does not authenticate; and `audit verify` names each row (problem `row`).
A key put back exactly as it was before its revocation (with that state's MAC) passes the
MAC at use, but verify names it from the chain's `key.revoke` row. A price whose rate is
changed, a price version inserted, or one deleted, and a path pointed at a cheaper price key
or inserted, by SQL: usage on it is refused at use (not charged at the forged rate) and
verify names the row; so does an example price's mark, cleared or added.
"""

from __future__ import annotations

import grpc
import pytest
from sqlalchemy import create_engine, text

from services.metering import access
from services.metering.db import resolve_url
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as mgrpc
from tests.metering.metering_helpers import HOUR, T0, event, expect_status, price_paths
from tests.metering.test_integrity import plain_sql
from tests.security.ledger_attack import Metering


def scalar(url: str, sql: str) -> str:
    engine = create_engine(resolve_url(url))
    try:
        with engine.connect() as conn:
            return str(conn.execute(text(sql)).scalar_one())
    finally:
        engine.dispose()


async def setup_alice(stub: mgrpc.MeteringAsyncStub) -> tuple[str, str]:
    """alice, who may infer on `model:mlp`: her principal id and a key."""
    who = await stub.CreatePrincipal(mpb.CreatePrincipalRequest(name="alice", kind="user"))
    await stub.GrantRole(mpb.RoleRequest(principal="alice", role="infer", scope="model:mlp"))
    key = await stub.CreateKey(mpb.CreateKeyRequest(principal="alice"))
    return who.principal_id, f"{key.key_id}.{key.secret}"


async def roles(stub: mgrpc.MeteringAsyncStub, key: str) -> set[tuple[str, str]]:
    ident = await stub.Authenticate(mpb.AuthenticateRequest(key=key))
    return {(r.role, r.scope) for r in ident.roles}


async def assert_unauthenticated(stub: mgrpc.MeteringAsyncStub, key: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Authenticate(mpb.AuthenticateRequest(key=key))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def assert_named(metering: Metering, stub: mgrpc.MeteringAsyncStub, row: str) -> None:
    verdict = await stub.VerifyAudit(mpb.VerifyAuditRequest())
    assert (verdict.ok, verdict.problem) == (False, "row"), verdict
    assert metering.running is not None
    assert row in metering.running.ledger.audit.verify().message


@pytest.mark.parametrize("mac", ["none", "copied"])
async def test_an_inserted_admin_binding_grants_nothing(metering: Metering, db_url: str, mac: str) -> None:
    stub = await metering.start()
    pid, key = await setup_alice(stub)
    assert await roles(stub, key) == {("infer", "model:mlp")}
    assert (await stub.VerifyAudit(mpb.VerifyAuditRequest())).ok
    copied = scalar(db_url, f"SELECT mac FROM role_bindings WHERE principal_id = '{pid}'")
    value = "NULL" if mac == "none" else f"'{copied}'"
    plain_sql(
        db_url,
        "INSERT INTO role_bindings (principal_id, role, scope, created_us, mac) "
        f"VALUES ('{pid}', 'admin', '*', 1, {value})",
    )
    assert await roles(stub, key) == {("infer", "model:mlp")}  # admin on * is not granted
    bad = scalar(db_url, f"SELECT id FROM role_bindings WHERE role = 'admin' AND principal_id = '{pid}'")
    await assert_named(metering, stub, f"role_binding/{bad}")


async def test_a_revoked_key_stays_revoked_when_the_column_is_cleared(
    metering: Metering, db_url: str
) -> None:
    stub = await metering.start()
    _, key = await setup_alice(stub)
    key_id = key.partition(".")[0]
    live_mac = scalar(db_url, f"SELECT mac FROM api_keys WHERE key_id = '{key_id}'")
    await stub.RevokeKey(mpb.RevokeKeyRequest(key_id=key_id))
    await assert_unauthenticated(stub, key)
    plain_sql(db_url, f"UPDATE api_keys SET revoked_us = NULL WHERE key_id = '{key_id}'")
    await assert_unauthenticated(stub, key)
    await assert_named(metering, stub, f"api_key/{key_id}")
    # Put back exactly as it was before the revocation, MAC included: the chain remembers.
    plain_sql(db_url, f"UPDATE api_keys SET mac = '{live_mac}' WHERE key_id = '{key_id}'")
    await assert_named(metering, stub, f"api_key/{key_id}")


async def test_a_key_inserted_by_sql_does_not_authenticate(metering: Metering, db_url: str) -> None:
    stub = await metering.start()
    pid, key = await setup_alice(stub)
    forged_id, secret = "sk_00000000deadbeef", "s" * 43
    plain_sql(
        db_url,
        "INSERT INTO api_keys (key_id, principal_id, secret_hash, created_us, expires_us, revoked_us, mac) "
        f"VALUES ('{forged_id}', '{pid}', '{access.secret_hash(forged_id, secret)}', 1, 0, NULL, NULL)",
    )
    await assert_unauthenticated(stub, f"{forged_id}.{secret}")
    assert await roles(stub, key) == {("infer", "model:mlp")}  # the genuine key still works
    await assert_named(metering, stub, f"api_key/{forged_id}")


# ---- money: prices -------------------------------------------------------------------------------


async def _priced(stub: mgrpc.MeteringAsyncStub) -> str:
    """cpu-std at 3.6 USD an hour from T0, on path cpu-eager@h1; the price's version."""
    await price_paths(stub, "cpu-std", ["cpu-eager@h1"])
    return f"cpu-std@{T0}"


@pytest.mark.parametrize("how", ["rate", "inserted", "deleted"])
async def test_a_price_changed_by_sql_charges_nothing_and_is_named(
    metering: Metering, db_url: str, how: str
) -> None:
    """An insider lowers a rate (or adds a cheaper version, or removes one): usage on the key is
    refused, not charged at the forged rate, and `audit verify` names the price."""
    stub = await metering.start()
    version = await _priced(stub)
    later = f"cpu-std@{T0 + HOUR}"
    await stub.RecordUsage(mpb.RecordUsageRequest(events=[event("before", T0 + 1, 1_000_000)]))
    assert (await stub.VerifyAudit(mpb.VerifyAuditRequest())).ok
    if how == "rate":
        plain_sql(db_url, f"UPDATE prices SET micros_per_hour = 1 WHERE version = '{version}'")
        named = version
    elif how == "inserted":
        mac = scalar(db_url, f"SELECT mac FROM prices WHERE version = '{version}'")  # another row's MAC
        plain_sql(
            db_url,
            "INSERT INTO prices (price_key, micros_per_hour, currency, effective_from_us, version, "
            f"created_us, mac) VALUES ('cpu-std', 1, 'USD', {T0 + HOUR}, '{later}', 1, '{mac}')",
        )
        named = later
    else:
        price = mpb.Price(
            price_key="cpu-std", micros_per_hour=7_200_000, currency="USD", effective_from_unix_us=T0 + HOUR
        )
        await stub.SetPrice(mpb.SetPriceRequest(price=price))
        plain_sql(db_url, f"DELETE FROM prices WHERE version = '{later}'")  # back to the cheaper rate
        named = later
    if how != "deleted":  # a lost row is not in the book to refuse; verify names it
        await expect_status(
            stub.RecordUsage(mpb.RecordUsageRequest(events=[event("after", T0 + 2 * HOUR, 1_000_000)])),
            grpc.StatusCode.FAILED_PRECONDITION,
            "fails its MAC",
        )
    await assert_named(metering, stub, f"price/{named}")


async def test_a_price_from_before_its_mac_holds_where_the_chain_vouches(
    metering: Metering, db_url: str
) -> None:
    """A price written before migration 0009 has no MAC: the chain's price.set vouches for it,
    and for nothing else (a rate changed along with the MAC cleared is named)."""
    stub = await metering.start()
    version = await _priced(stub)
    plain_sql(db_url, f"UPDATE prices SET mac = NULL WHERE version = '{version}'")
    await stub.RecordUsage(mpb.RecordUsageRequest(events=[event("legacy", T0 + 1, 1_000_000)]))
    assert (await stub.VerifyAudit(mpb.VerifyAuditRequest())).ok
    plain_sql(db_url, f"UPDATE prices SET micros_per_hour = 1 WHERE version = '{version}'")
    await assert_named(metering, stub, f"price/{version}")


@pytest.mark.parametrize("how", ["cleared", "added"])
async def test_an_example_mark_changed_by_sql_charges_nothing_and_is_named(
    metering: Metering, db_url: str, how: str
) -> None:
    """An insider clears an example price's mark (so its costs pass for finance's), or marks
    finance's price as an example: the MAC covers the mark, so usage on it is refused and
    `audit verify` names the price."""
    stub = await metering.start()
    marked = how == "cleared"
    price = mpb.Price(
        price_key="cpu-std",
        micros_per_hour=3_600_000,
        currency="USD",
        effective_from_unix_us=T0,
        example=marked,
    )
    await stub.SetPrice(mpb.SetPriceRequest(price=price))
    info = mpb.PathInfo(path="cpu-eager@h1", backend="cpu", resource_class="cpu-16", price_key="cpu-std")
    await stub.RegisterPath(mpb.RegisterPathRequest(path_info=info))
    await stub.RecordUsage(mpb.RecordUsageRequest(events=[event("before", T0 + 1, 1_000_000)]))
    assert (await stub.VerifyAudit(mpb.VerifyAuditRequest())).ok
    flag = "false" if marked else "true"
    plain_sql(db_url, f"UPDATE prices SET example = {flag} WHERE version = 'cpu-std@{T0}'")
    await expect_status(
        stub.RecordUsage(mpb.RecordUsageRequest(events=[event("after", T0 + 2, 1_000_000)])),
        grpc.StatusCode.FAILED_PRECONDITION,
        "fails its MAC",
    )
    await assert_named(metering, stub, f"price/cpu-std@{T0}")


# ---- money: paths --------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["repointed", "inserted", "legacy"])
async def test_a_path_changed_by_sql_charges_nothing_and_is_named(
    metering: Metering, db_url: str, how: str
) -> None:
    """A path points at the price key it is charged at: pointed at a cheaper key by SQL, or
    inserted by SQL, usage on it is refused and verify names it. One from before migration 0010
    (no MAC) holds as its chained path.register says."""
    stub = await metering.start()
    await _priced(stub)
    cheap = mpb.Price(price_key="cheap", micros_per_hour=1, currency="USD", effective_from_unix_us=T0)
    await stub.SetPrice(mpb.SetPriceRequest(price=cheap))
    path = "cpu-eager@h1"
    if how == "repointed":
        plain_sql(db_url, f"UPDATE paths SET price_key = 'cheap' WHERE path = '{path}'")
    elif how == "inserted":
        path = "sneaky@h1"
        plain_sql(
            db_url,
            "INSERT INTO paths (path, backend, resource_class, price_key, host, created_us, mac) "
            f"VALUES ('{path}', 'cpu', 'cpu-16', 'cheap', 'h1', 1, NULL)",
        )
    else:
        plain_sql(db_url, f"UPDATE paths SET mac = NULL WHERE path = '{path}'")
    usage = stub.RecordUsage(mpb.RecordUsageRequest(events=[event("u1", T0 + 1, 1_000_000, path=path)]))
    if how == "legacy":
        assert (await usage).accepted == 1
        assert (await stub.VerifyAudit(mpb.VerifyAuditRequest())).ok
        plain_sql(db_url, f"UPDATE paths SET price_key = 'cheap' WHERE path = '{path}'")
    else:
        await expect_status(usage, grpc.StatusCode.FAILED_PRECONDITION, "fails its MAC")
    await assert_named(metering, stub, f"path/{path}")
