"""Per-principal limits at a real router, the bounded auth cache and its timeout fallback.

Real metering, CPU executors and router (tests/router/conftest.py): a principal over its rate
or its in-flight limit gets RESOURCE_EXHAUSTED with `retry-after-ms` in the trailers, other
principals are unaffected, nothing reaches the ledger for a refusal, and RouterAdmin changes
the limit at run time.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import numpy as np
import pytest

from services.executor.executor_server import RunningExecutor
from services.router.admission import Limit, PrincipalLimits
from services.router.auth import Authenticator, Identity
from switchyard.errors import DeadlineExceeded, RateLimited, Unauthenticated, Unavailable
from switchyard.gen.inference import grpc_service_pb2 as ipb
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
from switchyard.gen.switchyard.v1 import router_pb2 as rpb
from switchyard.gen.switchyard.v1 import router_pb2_grpc as rgrpc
from tests.router.conftest import Metering, RouterFactory, routes_config

pytestmark = pytest.mark.asyncio(loop_scope="session")


def _request() -> ipb.ModelInferRequest:
    req = ipb.ModelInferRequest(model_name="mlp")
    req.inputs.add(name="x", datatype="FP32", shape=[1, 64])
    req.raw_input_contents.append(np.ones((1, 64), dtype=np.float32).tobytes())
    return req


async def _infer(channel: grpc.aio.Channel, key: str) -> tuple[grpc.StatusCode, str, dict[str, Any]]:
    call = channel.unary_unary(
        "/inference.GRPCInferenceService/ModelInfer",
        request_serializer=ipb.ModelInferRequest.SerializeToString,
        response_deserializer=ipb.ModelInferResponse.FromString,
    )
    try:
        reply = await call(_request(), metadata=(("authorization", f"Bearer {key}"),), timeout=20)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or "", dict(exc.trailing_metadata() or ())
    return grpc.StatusCode.OK, reply.parameters["request_id"].string_param, {}


async def test_rate_and_in_flight_limits_per_principal(
    metering: Metering, executors: list[RunningExecutor], make_router: RouterFactory
) -> None:
    cfg = routes_config(
        {"a": executors[0].address},
        {"mlp": {"policy": "pinned", "targets": ["a"]}},
        principal_rate_per_s=2.0,
        principal_burst=3,
        usage_flush_s=0.05,
    )
    router = await make_router(cfg, metering.running.address)
    lines_before = len(metering.usage_counts())
    admitted: list[str] = []

    async def infer(channel: grpc.aio.Channel, key: str) -> tuple[grpc.StatusCode, str, dict[str, Any]]:
        result = await _infer(channel, key)
        if result[0] == grpc.StatusCode.OK:
            admitted.append(result[1])
        return result

    hog, _ = await metering.key("limit-hog", "t", "infer")
    other, _ = await metering.key("limit-other", "t", "infer")
    admin, _ = await metering.key("limit-admin", "t", "admin")
    async with grpc.aio.insecure_channel(router.address) as channel:
        results = [await infer(channel, hog) for _ in range(6)]
        ok = [detail for code, detail, _ in results if code == grpc.StatusCode.OK]
        refused = [
            (detail, trailers)
            for code, detail, trailers in results
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED
        ]
        assert len(ok) == 3 and len(refused) == 3, results  # the burst, then the rate
        for detail, trailers in refused:
            assert "over its rate" in detail
            assert 1 <= int(trailers["retry-after-ms"]) <= 1000
        assert (await infer(channel, other))[0] == grpc.StatusCode.OK  # one tenant does not starve another
        await asyncio.sleep(0.6)  # one token back at 2/s
        assert (await infer(channel, hog))[0] == grpc.StatusCode.OK

        admin_stub = rgrpc.RouterAdminStub(channel)
        auth = (("authorization", f"Bearer {admin}"),)
        listed = await admin_stub.ListPrincipalLimits(rpb.ListPrincipalLimitsRequest(), metadata=auth)
        assert listed.default_limit.rate_per_s == 2.0 and listed.refused == 3
        assert router.router.admission.auth is not None
        principal = (await router.router.admission.auth.identify(hog)).principal_id
        with pytest.raises(grpc.aio.AioRpcError) as denied:  # changing a limit needs role admin
            await admin_stub.SetPrincipalLimit(
                rpb.SetPrincipalLimitRequest(limit=rpb.PrincipalLimit(principal_id=principal)),
                metadata=(("authorization", f"Bearer {other}"),),
            )
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        await admin_stub.SetPrincipalLimit(
            rpb.SetPrincipalLimitRequest(limit=rpb.PrincipalLimit(principal_id=principal, rate_per_s=1000)),
            metadata=auth,
        )
        for _ in range(8):
            assert (await infer(channel, hog))[0] == grpc.StatusCode.OK
        # in flight: one at a time, the second of two concurrent requests is refused
        await admin_stub.SetPrincipalLimit(
            rpb.SetPrincipalLimitRequest(limit=rpb.PrincipalLimit(principal_id=principal, max_in_flight=1)),
            metadata=auth,
        )
        codes = await asyncio.gather(*(infer(channel, hog) for _ in range(6)))
        statuses = {code for code, _, _ in codes}
        assert grpc.StatusCode.OK in statuses and grpc.StatusCode.RESOURCE_EXHAUSTED in statuses
        assert all(
            t["retry-after-ms"] == "50" for c, _, t in codes if c == grpc.StatusCode.RESOURCE_EXHAUSTED
        )
    await router.stop(1)  # flushes usage
    counts = metering.usage_counts()
    # one ledger line per admitted request; none for the refusals
    assert all(counts.get(request_id) == 1 for request_id in admitted)
    assert len(counts) - lines_before == len(admitted)


async def test_a_limit_set_on_one_router_holds_on_every_router_of_its_fleet(
    metering: Metering, executors: list[RunningExecutor], make_router: RouterFactory
) -> None:
    """SetPrincipalLimit goes to metering first (audited there once, as limit.set), and each
    router of the fleet applies it within route_sync_s; a reset goes the same way."""
    cfg = routes_config(
        {"a": executors[0].address}, {"mlp": {"policy": "pinned", "targets": ["a"]}}, route_sync_s=0.1
    )
    first = await make_router(cfg, metering.running.address)
    second = await make_router(cfg, metering.running.address)
    elsewhere = await make_router(  # another fleet: untouched
        routes_config(
            {"a": executors[0].address}, {"mlp": {"policy": "pinned", "targets": ["a"]}}, route_sync_s=0.1
        ),
        metering.running.address,
    )
    hog, _ = await metering.key("fleet-hog", "t", "infer")
    admin, _ = await metering.key("fleet-admin", "t", "admin")
    auth = (("authorization", f"Bearer {admin}"),)
    assert second.router.admission.auth is not None
    principal = (await second.router.admission.auth.identify(hog)).principal_id
    async with grpc.aio.insecure_channel(first.address) as channel:
        await rgrpc.RouterAdminStub(channel).SetPrincipalLimit(
            rpb.SetPrincipalLimitRequest(
                limit=rpb.PrincipalLimit(principal_id=principal, rate_per_s=0.01, burst=1)
            ),
            metadata=auth,
        )
    async with grpc.aio.insecure_channel(second.address) as channel:
        stub = rgrpc.RouterAdminStub(channel)
        for _ in range(100):  # the next poll of the second router
            listed = await stub.ListPrincipalLimits(rpb.ListPrincipalLimitsRequest(), metadata=auth)
            if listed.overrides:
                break
            await asyncio.sleep(0.05)
        assert [(o.principal_id, o.rate_per_s, o.burst) for o in listed.overrides] == [(principal, 0.01, 1)]
        assert (await _infer(channel, hog))[0] == grpc.StatusCode.OK  # the burst of one
        code, detail, trailers = await _infer(channel, hog)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "over its rate of 0.01" in detail
        assert int(trailers["retry-after-ms"]) > 1000
        await stub.SetPrincipalLimit(  # a reset on the second router reaches the first
            rpb.SetPrincipalLimitRequest(limit=rpb.PrincipalLimit(principal_id=principal), reset=True),
            metadata=auth,
        )
    for _ in range(100):
        if principal not in first.router.admission.limits.overrides:
            break
        await asyncio.sleep(0.05)
    assert principal not in first.router.admission.limits.overrides
    assert principal not in elsewhere.router.admission.limits.overrides
    audit = await metering.stub.QueryAudit(mpb.QueryAuditRequest(action="limit.set", limit=1000))
    mine = sorted((r for r in audit.records if r.resource == f"principal/{principal}"), key=lambda r: r.seq)
    assert [json.loads(r.detail_json)["reset"] for r in mine] == [False, True]  # once per change


async def test_token_bucket_and_in_flight_units() -> None:
    limits = PrincipalLimits(Limit(rate_per_s=10, burst=2, max_in_flight=0))
    limits.acquire("p")
    limits.acquire("p")
    with pytest.raises(RateLimited) as over:
        limits.acquire("p")
    assert 1 <= over.value.retry_after_ms <= 101 and over.value.trailers[0][0] == "retry-after-ms"
    limits.set("p", Limit(max_in_flight=1))
    assert limits.acquire("p") is True
    with pytest.raises(RateLimited):
        limits.acquire("p")
    limits.release("p")
    assert limits.acquire("p") is True
    assert limits.refused == 2


class _Port:
    """What metering would answer; the cache around it is what is tested."""

    def __init__(self) -> None:
        self.fail: Exception | None = None
        self.calls = 0

    async def authenticate(self, key: str) -> Identity:
        self.calls += 1
        if self.fail is not None:
            raise self.fail
        if key.startswith("bad"):
            raise Unauthenticated("unknown key")
        return Identity(f"p-{key}", key, "", key, (("infer", "*"),))


async def test_auth_cache_is_bounded_and_survives_a_metering_timeout() -> None:
    port = _Port()
    auth = Authenticator(port, ttl_s=0.05, stale_s=60, max_entries=100)
    for i in range(1000):  # made-up keys do not grow the cache past its bound
        with pytest.raises(Unauthenticated):
            await auth.identify(f"bad-{i}")
    assert len(auth) == 100
    assert (await auth.identify("good")).principal_id == "p-good"
    await asyncio.sleep(0.06)
    port.fail = DeadlineExceeded("metering took too long")
    assert (await auth.identify("good")).principal_id == "p-good"  # the last answer, within auth_stale_s
    with pytest.raises(Unavailable):
        await auth.identify("never-seen")  # unknown and unverifiable: no guess
    await auth.close()
