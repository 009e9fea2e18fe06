"""An insider writes a fleet's limit or route changes behind metering's back: the routers must
not get them, and verify must name them.

Against the real metering service on SQLite and PostgreSQL. A per-principal limit raised by SQL
UPDATE, or a limit row inserted by SQL (without a MAC, or with another row's MAC, to put an
older, looser limit back in force), is left out of ListLimitChanges (what every router of the
fleet polls), which serves the newest genuine change instead and logs the row; `audit verify`
names it (`limit_change/<id>`). The same for a route change pointed at another deployment
(`route_change/<id>`), and for a change deleted by SQL. A change from before migration 0014
(no MAC) holds where the chain's audit row for its revision says the same, and is refused
once changed; no caller can append such a vouching row through AppendAudit.
"""

from __future__ import annotations

import json

import grpc
import pytest

from services.metering import rowmac
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as mgrpc
from tests.metering.test_integrity import plain_sql
from tests.security.ledger_attack import Metering
from tests.security.test_ledger_rows import assert_named, scalar

WHO = mpb.Actor(principal="ops-admin", source="router", request_id="req-1")
FLEET = "prod"


async def set_limit(stub: mgrpc.MeteringAsyncStub, rate: float, burst: int) -> int:
    change = mpb.LimitChange(fleet=FLEET, principal_id="alice", rate_per_s=rate, burst=burst)
    return int((await stub.SaveLimitChange(mpb.SaveLimitChangeRequest(change=change, actor=WHO))).revision)


async def served_limits(stub: mgrpc.MeteringAsyncStub) -> dict[str, tuple[float, int, int]]:
    """What the fleet's routers get: principal -> (rate, burst, revision)."""
    reply = await stub.ListLimitChanges(mpb.ListLimitChangesRequest(fleet=FLEET))
    return {c.principal_id: (c.rate_per_s, c.burst, c.revision) for c in reply.changes}


async def limited(stub: mgrpc.MeteringAsyncStub) -> tuple[int, int]:
    """alice at 2/s (burst 4), then lowered to 0.5/s (burst 1): both revisions."""
    first = await set_limit(stub, 2.0, 4)
    second = await set_limit(stub, 0.5, 1)
    assert await served_limits(stub) == {"alice": (0.5, 1, second)}
    assert (await stub.VerifyAudit(mpb.VerifyAuditRequest())).ok
    return first, second


async def test_a_limit_raised_by_sql_is_not_served(
    metering: Metering, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    stub = await metering.start()
    first, second = await limited(stub)
    plain_sql(db_url, f"UPDATE limit_changes SET rate_per_s = 1000, burst = 1000 WHERE id = {second}")
    # The raised row is left out; the newest genuine change below it is served (a router that
    # applied revision `second` keeps it, as it only takes newer revisions).
    assert await served_limits(stub) == {"alice": (2.0, 4, first)}
    assert f"limit_changes row {second}" in caplog.text and "fails its MAC" in caplog.text
    await assert_named(metering, stub, f"limit_change/{second}")
    third = await set_limit(stub, 0.25, 1)  # an operator's next change is served again
    assert await served_limits(stub) == {"alice": (0.25, 1, third)}


@pytest.mark.parametrize("mac", ["none", "copied"])
async def test_a_limit_inserted_by_sql_is_not_served(metering: Metering, db_url: str, mac: str) -> None:
    stub = await metering.start()
    first, second = await limited(stub)
    # The looser first limit, inserted again above the newest (with its own MAC, or none).
    copied = scalar(db_url, f"SELECT mac FROM limit_changes WHERE id = {first}")
    value = "NULL" if mac == "none" else f"'{copied}'"
    forged = second + 10
    plain_sql(
        db_url,
        "INSERT INTO limit_changes (id, fleet, principal_id, rate_per_s, burst, max_in_flight, reset, "
        f"changed_us, principal, request_id, mac) SELECT {forged}, fleet, principal_id, rate_per_s, burst, "
        f"max_in_flight, reset, changed_us, principal, request_id, {value} "
        f"FROM limit_changes WHERE id = {first}",
    )
    assert await served_limits(stub) == {"alice": (0.5, 1, second)}
    await assert_named(metering, stub, f"limit_change/{forged}")


async def test_a_limit_change_deleted_by_sql_is_named(metering: Metering, db_url: str) -> None:
    stub = await metering.start()
    _, second = await limited(stub)
    plain_sql(db_url, f"DELETE FROM limit_changes WHERE id = {second}")
    await assert_named(metering, stub, f"limit_change/{second}")  # the chain audited it


async def test_a_limit_from_before_its_mac_holds_until_changed(metering: Metering, db_url: str) -> None:
    stub = await metering.start()
    _, second = await limited(stub)
    plain_sql(db_url, "UPDATE limit_changes SET mac = NULL")  # as written before migration 0014
    assert await served_limits(stub) == {"alice": (0.5, 1, second)}  # the chain vouches for it
    assert (await stub.VerifyAudit(mpb.VerifyAuditRequest())).ok
    plain_sql(db_url, f"UPDATE limit_changes SET burst = 1000 WHERE id = {second}")
    assert (await served_limits(stub))["alice"][2] != second
    await assert_named(metering, stub, f"limit_change/{second}")


async def test_no_caller_can_vouch_for_a_row_it_wrote_by_sql(metering: Metering, db_url: str) -> None:
    stub = await metering.start()
    _, second = await limited(stub)
    forged = second + 5
    plain_sql(
        db_url,
        "INSERT INTO limit_changes (id, fleet, principal_id, rate_per_s, burst, max_in_flight, reset, "
        f"changed_us, principal, request_id, mac) VALUES ({forged}, '{FLEET}', 'alice', 1000, 1000, 0, "
        "false, 1, 'ops-admin', 'x', NULL)",
    )
    said = {"fleet": FLEET, "revision": forged, "rate_per_s": 1000.0, "burst": 1000, "max_in_flight": 0}
    for action in sorted(rowmac.METERING_ONLY_ACTIONS):
        voucher = mpb.AppendAuditRequest(
            action=action,
            resource="principal/alice",
            outcome="ok",
            detail_json=json.dumps(said | {"reset": False}),
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.AppendAudit(voucher)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, action
    assert await served_limits(stub) == {"alice": (0.5, 1, second)}
    await assert_named(metering, stub, f"limit_change/{forged}")


def _route(deployment: str) -> str:
    return json.dumps({"policy": "pinned", "targets": [deployment]})


async def test_a_route_pointed_elsewhere_by_sql_is_not_served(metering: Metering, db_url: str) -> None:
    stub = await metering.start()
    saved = mpb.RouteChange(fleet=FLEET, model="mlp", route_json=_route("mlp-a"))
    genuine = (await stub.SaveRouteChange(mpb.SaveRouteChangeRequest(change=saved, actor=WHO))).revision
    copied = scalar(db_url, f"SELECT mac FROM route_changes WHERE id = {genuine}")
    # Another team's deployment (charged at its path), inserted above with the genuine MAC.
    plain_sql(
        db_url,
        "INSERT INTO route_changes (id, fleet, model, route_json, changed_us, principal, request_id, mac) "
        f"VALUES ({genuine + 1}, '{FLEET}', 'mlp', '{_route('other-team')}', 1, 'ops-admin', 'x', "
        f"'{copied}')",
    )
    served = (await stub.ListRouteChanges(mpb.ListRouteChangesRequest(fleet=FLEET))).changes
    assert [(c.revision, json.loads(c.route_json)["targets"]) for c in served] == [(genuine, ["mlp-a"])]
    await assert_named(metering, stub, f"route_change/{genuine + 1}")
