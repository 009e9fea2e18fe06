"""Run-time route changes shared by a fleet of routers: saved per fleet, latest per model wins."""

from __future__ import annotations

import json
from typing import Any

import grpc

from switchyard.gen.switchyard.v1 import metering_pb2 as pb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as pb_grpc
from tests.metering.metering_helpers import expect_status

WHO = pb.Actor(principal="ops-admin", source="router", request_id="req-1")


def _save(previous_json: str = "", **change: Any) -> pb.SaveRouteChangeRequest:
    return pb.SaveRouteChangeRequest(change=pb.RouteChange(**change), previous_json=previous_json)


def _route(deployment: str) -> str:
    return json.dumps({"policy": "pinned", "targets": [deployment]})


async def test_latest_change_per_model_in_force_per_fleet(stub: pb_grpc.MeteringAsyncStub) -> None:
    def change(fleet: str, model: str, route_json: str = "") -> pb.SaveRouteChangeRequest:
        saved = pb.RouteChange(fleet=fleet, model=model, route_json=route_json, deleted=not route_json)
        return pb.SaveRouteChangeRequest(change=saved, actor=WHO)

    first = await stub.SaveRouteChange(change("prod", "mlp", _route("a")))
    replacing = change("prod", "mlp", _route("b"))
    replacing.previous_json = _route("a")  # as the router had it: for the audit trail
    second = await stub.SaveRouteChange(replacing)
    await stub.SaveRouteChange(change("prod", "old"))
    await stub.SaveRouteChange(change("staging", "mlp", _route("c")))
    assert second.revision > first.revision and second.principal == "ops-admin"
    assert second.changed_unix_us >= first.changed_unix_us > 0

    prod = (await stub.ListRouteChanges(pb.ListRouteChangesRequest(fleet="prod"))).changes
    assert [(c.model, c.deleted) for c in prod] == [("mlp", False), ("old", True)]
    assert json.loads(prod[0].route_json)["targets"] == ["b"] and prod[0].revision == second.revision
    assert prod[1].route_json == "" and all(c.fleet == "prod" for c in prod)
    staging = (await stub.ListRouteChanges(pb.ListRouteChangesRequest(fleet="staging"))).changes
    assert [json.loads(c.route_json)["targets"] for c in staging] == [["c"]]
    assert (await stub.ListRouteChanges(pb.ListRouteChangesRequest(fleet="none-yet"))).changes == []

    # Each change is audited in the transaction that saved it, with the old and the new route.
    sets = (await stub.QueryAudit(pb.QueryAuditRequest(action="route.set"))).records
    assert [r.resource for r in reversed(sets)] == ["route/prod/mlp", "route/prod/mlp", "route/staging/mlp"]
    detail = json.loads(sets[-2].detail_json)
    assert detail == {
        "fleet": "prod",
        "revision": second.revision,
        "old": json.loads(_route("a")),
        "new": json.loads(_route("b")),
    }
    assert sets[-2].actor.principal == "ops-admin" and sets[-2].actor.request_id == "req-1"
    (deleted,) = (await stub.QueryAudit(pb.QueryAuditRequest(action="route.delete"))).records
    assert deleted.resource == "route/prod/old" and json.loads(deleted.detail_json)["new"] is None
    assert (await stub.VerifyAudit(pb.VerifyAuditRequest())).ok


async def test_bad_route_changes_are_refused_with_what_to_fix(stub: pb_grpc.MeteringAsyncStub) -> None:
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    cases = [
        (_save(fleet="f", model="mlp", route_json="{not json"), "not valid JSON"),
        (_save(fleet="f", model="mlp", route_json="[1]"), "JSON object"),
        (_save(fleet="f", model="mlp"), "deleted = true"),
        (_save(fleet="f", model="mlp", route_json="{}", deleted=True), "deleted = true"),
        (_save(fleet="", model="mlp", route_json="{}"), "fleet name"),
        (_save(fleet="f", model="m" * 201, route_json="{}"), "model name"),
        (_save(fleet="f", model="mlp", route_json=" " * 70_000 + "{}"), "at most"),
        (_save(fleet="f", model="m", route_json="{}", previous_json="1"), "previous"),
    ]
    for request, message in cases:
        await expect_status(stub.SaveRouteChange(request), invalid, message)
    await expect_status(stub.ListRouteChanges(pb.ListRouteChangesRequest()), invalid, "fleet name")
    assert (await stub.ListRouteChanges(pb.ListRouteChangesRequest(fleet="f"))).changes == []
