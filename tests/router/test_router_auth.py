"""tritonclient.grpc through the router with a key; each kind of refusal gets its own status.

Real metering (SQLite), real CPU executors and a real router, all on port 0. tritonclient's
synchronous client runs in a thread so the servers keep running on this event loop.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from services.executor.executor_server import RunningExecutor
from services.router.router_config import RouterConfig
from services.router.router_server import start_router
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
from switchyard.gen.switchyard.v1 import router_pb2 as rpb
from switchyard.gen.switchyard.v1 import router_pb2_grpc as rgrpc
from switchyard.grpcio import ServerOptions
from tests.router.conftest import (
    Metering,
    RouterFactory,
    prepared_ledger_key,
    routes_config,
    start_metering_at,
)

pytestmark = pytest.mark.asyncio(loop_scope="session")


def _infer(address: str, x: np.ndarray, key: str | None, model: str = "mlp") -> Any:
    client = triton.InferenceServerClient(address)
    try:
        inp = triton.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        headers = {"authorization": f"Bearer {key}"} if key is not None else None
        return client.infer(model, [inp], headers=headers, client_timeout=30)
    finally:
        client.close()


async def _status(address: str, x: np.ndarray, key: str | None, model: str = "mlp") -> tuple[str, str]:
    try:
        await asyncio.to_thread(_infer, address, x, key, model)
    except InferenceServerException as exc:
        return str(exc.status()), str(exc.message())
    return "OK", ""


async def _with_client(address: str, use: Callable[[Any], Any]) -> Any:
    """`use(client)` with a tritonclient gRPC client of `address`, in a thread (it blocks)."""

    def run() -> Any:
        client = triton.InferenceServerClient(address)
        try:
            return use(client)
        finally:
            client.close()

    return await asyncio.to_thread(run)


def _x(rows: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 64)).astype(np.float32)


async def test_tritonclient_through_the_router_equals_the_executor_and_names_the_path(
    metering: Metering, executors: list[RunningExecutor], make_router: RouterFactory
) -> None:
    cfg = routes_config({"a": executors[0].address}, {"mlp": {"policy": "pinned", "targets": ["a"]}})
    router = await make_router(cfg, metering.running.address)
    key, _ = await metering.key("svc-triton", "search", "infer", "model:mlp")
    x = _x(3)
    direct = await asyncio.to_thread(_infer, executors[0].address, x, None)
    routed = await asyncio.to_thread(_infer, router.address, x, key)
    assert np.array_equal(routed.as_numpy("y"), direct.as_numpy("y"))  # bytes passed through untouched
    params = routed.get_response().parameters
    assert params["path"].string_param == "cpu-a"
    assert 0 <= params["router_overhead_us"].int64_param < 1_000_000
    assert params["compute_us"].int64_param > 0  # the executor's own parameters survive
    assert routed.get_response().model_name == "mlp"

    headers = {"authorization": f"Bearer {key}"}
    meta, conf, live, ready = await _with_client(
        router.address,
        lambda c: (
            c.get_model_metadata("mlp", headers=headers),
            c.get_model_config("mlp", headers=headers),
            c.is_server_live(),
            c.is_model_ready("mlp", headers=headers),
        ),
    )
    assert meta.name == "mlp" and meta.inputs[0].name == "x" and conf.config.name == "mlp"
    assert live and ready

    # the serving executor's own counters
    stats = await _with_client(router.address, lambda c: c.get_inference_statistics("mlp", headers=headers))
    assert stats.model_stats[0].name == "mlp" and stats.model_stats[0].inference_count >= 2
    await router.router.spool.drain(5.0)
    assert metering.usage_counts({routed.get_response().parameters["request_id"].string_param}) == {
        routed.get_response().parameters["request_id"].string_param: 1
    }


def _stream(address: str, key: str | None, requests: list[tuple[str, np.ndarray]], answers: int) -> list[Any]:
    """Sends `requests` on one tritonclient stream; returns the first `answers` (result, error)."""
    client = triton.InferenceServerClient(address)
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    headers = {"authorization": f"Bearer {key}"} if key is not None else None
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)), headers=headers)
        for i, (model, x) in enumerate(requests):
            inp = triton.InferInput("x", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            try:
                client.async_stream_infer(model, [inp], request_id=str(i))
            except InferenceServerException:  # the stream already ended: its error is in `results`
                break
        return [results.get(timeout=30) for _ in range(answers)]
    finally:
        client.stop_stream()
        client.close()


def _mlp_and_mlp_b(address: str, **settings: Any) -> RouterConfig:
    """Routes `mlp` and `mlp-b` (the same model on the same executor, by another name: a key
    scoped to model:mlp may not call it), both pinned to the executor at `address`."""
    routes = {
        "mlp": {"policy": "pinned", "targets": ["a"]},
        "mlp-b": {"policy": "pinned", "targets": [{"deployment": "a", "model": "mlp"}]},
    }
    return routes_config({"a": address}, routes, **settings)


async def test_model_stream_infer_is_routed_in_order_with_errors_in_band(
    metering: Metering, executors: list[RunningExecutor], make_router: RouterFactory
) -> None:
    cfg = _mlp_and_mlp_b(executors[0].address)
    router = await make_router(cfg, metering.running.address)
    key, _ = await metering.key("svc-stream", "search", "infer", "model:mlp")
    models = ["mlp", "mlp", "nope", "mlp", "mlp-b", "mlp"] * 4  # an unknown model, one out of scope
    requests = [(model, _x(2, seed)) for seed, model in enumerate(models)]
    answers = await asyncio.to_thread(_stream, router.address, key, requests, len(requests))
    served = []
    for i, ((model, x), (result, error)) in enumerate(zip(requests, answers, strict=True)):
        if model == "nope":
            assert result is None and "NOT_FOUND" in str(error) and "unknown model 'nope'" in str(error)
        elif model == "mlp-b":
            assert result is None and "PERMISSION_DENIED" in str(error)
        else:
            assert error is None, error
            response = result.get_response()
            assert response.id == str(i)  # answered in request order
            assert response.parameters["path"].string_param == "cpu-a"
            direct = await asyncio.to_thread(_infer, executors[0].address, x, None)
            # close, not equal: a stream's requests run at once, so the executor batches them
            np.testing.assert_allclose(result.as_numpy("y"), direct.as_numpy("y"), rtol=1e-5, atol=1e-5)
            served.append(response.parameters["request_id"].string_param)
    assert len(served) == 16
    assert router.router.spool is not None and await router.router.spool.drain(5.0)
    assert metering.usage_counts(set(served)) == dict.fromkeys(served, 1)  # each routed request once

    # Without a valid key the stream itself is refused.
    for bad in (None, "sk-not-a-key"):
        ((result, error),) = await asyncio.to_thread(_stream, router.address, bad, requests[:1], 1)
        assert result is None and "UNAUTHENTICATED" in str(error.status())


async def test_refusals_each_get_their_status_and_are_audited(
    metering: Metering, executors: list[RunningExecutor], make_router: RouterFactory
) -> None:
    cfg = _mlp_and_mlp_b(executors[0].address, auth_cache_ttl_s=1.0)
    router = await make_router(cfg, metering.running.address)
    key, key_id = await metering.key("svc-scoped", "ads", "infer", "model:mlp")
    x = _x()
    assert (await _status(router.address, x, key))[0] == "OK"
    code, message = await _status(router.address, x, None)
    assert code == "StatusCode.UNAUTHENTICATED" and "Bearer" in message
    code, message = await _status(router.address, x, key + "x")
    assert code == "StatusCode.UNAUTHENTICATED" and "revoked" in message
    code, message = await _status(router.address, x, key, model="mlp-b")
    assert code == "StatusCode.PERMISSION_DENIED" and "mlp-b" in message
    wide_key, _ = await metering.key("svc-wide", "ads", "infer", "*")

    wide = {"authorization": f"Bearer {wide_key}"}
    # answered by the deployment's `mlp`, named as asked
    meta = await _with_client(router.address, lambda c: c.get_model_metadata("mlp-b", headers=wide))
    assert meta.name == "mlp-b" and meta.inputs[0].name == "x"
    code, message = await _status(router.address, x, key, model="no-such-model")
    assert code == "StatusCode.NOT_FOUND" and "no-such-model" in message

    async with grpc.aio.insecure_channel(router.address) as channel:  # bytes that are not a protobuf
        garbage: Any = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.aio.AioRpcError) as malformed:
            await garbage(b"\x0a\xff\x01", metadata=[("authorization", f"Bearer {key}")], timeout=10)
    assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (await _status(router.address, x, key))[0] == "OK"  # and it keeps serving

    await metering.stub.RevokeKey(mpb.RevokeKeyRequest(key_id=key_id))
    revoked_at = time.monotonic()
    while (await _status(router.address, x, key))[0] == "OK":
        assert time.monotonic() - revoked_at < 5.0, "a revoked key kept working for 5 s"
        await asyncio.sleep(0.2)
    assert (await _status(router.address, x, key))[0] == "StatusCode.UNAUTHENTICATED"

    assert router.router.spool is not None and await router.router.spool.drain(5.0)
    audit = await metering.stub.QueryAudit(mpb.QueryAuditRequest(action="request.denied", limit=100))
    reasons = [
        json.loads(r.detail_json)["status"] for r in audit.records if r.actor.source.startswith("router")
    ]
    assert reasons.count("PERMISSION_DENIED") >= 1 and reasons.count("UNAUTHENTICATED") >= 3


async def test_admin_api_changes_routes_only_for_admins_and_audits_them(
    metering: Metering, executors: list[RunningExecutor], make_router: RouterFactory
) -> None:
    cfg = routes_config(
        {"a": executors[0].address, "b": executors[1].address},
        {"mlp": {"policy": "pinned", "targets": ["a"]}},
    )
    router = await make_router(cfg, metering.running.address)
    admin_key, _ = await metering.key("ops-admin", "ops", "admin", "*")
    user_key, _ = await metering.key("ops-user", "ops", "infer", "*")
    async with grpc.aio.insecure_channel(router.address) as channel:
        admin = rgrpc.RouterAdminStub(channel)
        new = rpb.Route(model="mlp", policy="pinned", targets=[rpb.Target(deployment="b")])
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await admin.SetRoute(
                rpb.SetRouteRequest(route=new), metadata=[("authorization", f"Bearer {user_key}")]
            )
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        bad = rpb.Route(model="mlp", policy="pinned", targets=[rpb.Target(deployment="gpu")])
        with pytest.raises(grpc.aio.AioRpcError) as invalid:
            await admin.SetRoute(
                rpb.SetRouteRequest(route=bad), metadata=[("authorization", f"Bearer {admin_key}")]
            )
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "gpu" in (
            invalid.value.details() or ""
        )
        await admin.SetRoute(
            rpb.SetRouteRequest(route=new), metadata=[("authorization", f"Bearer {admin_key}")]
        )
        routes = await admin.ListRoutes(
            rpb.ListRoutesRequest(), metadata=[("authorization", f"Bearer {user_key}")]
        )
        assert [t.deployment for t in routes.routes[0].targets] == ["b"]
        listed = await admin.ListDeployments(
            rpb.ListDeploymentsRequest(), metadata=[("authorization", f"Bearer {admin_key}")]
        )
        states = {d.name: d for d in listed.deployments}
        assert states["a"].address == executors[0].address and states["b"].path == "cpu-b"
        assert all(d.healthy and d.transport == "frames" for d in listed.deployments)
    served = await asyncio.to_thread(_infer, router.address, _x(), user_key)
    assert served.get_response().parameters["path"].string_param == "cpu-b"
    assert router.router.spool is not None and await router.router.spool.drain(5.0)
    audit = await metering.stub.QueryAudit(mpb.QueryAuditRequest(action="route.set", limit=10))
    assert any(json.loads(r.detail_json)["new"]["targets"][0]["deployment"] == "b" for r in audit.records)


async def test_route_changes_survive_a_restart_and_a_deleted_route_stays_deleted(
    metering: Metering, executors: list[RunningExecutor], tmp_path: Path
) -> None:
    cfg = routes_config(
        {"a": executors[0].address, "b": executors[1].address},
        {"mlp": {"policy": "pinned", "targets": ["a"]}, "mlp-old": {"policy": "pinned", "targets": ["a"]}},
    )
    admin_key, _ = await metering.key("ops-keeper", "ops", "admin", "*")
    auth = [("authorization", f"Bearer {admin_key}")]
    state = tmp_path / "state"
    first = await start_router(cfg, metering.running.address, ServerOptions(), state)
    try:
        async with grpc.aio.insecure_channel(first.address) as channel:
            admin = rgrpc.RouterAdminStub(channel)
            new = rpb.Route(model="mlp", policy="weighted", targets=[rpb.Target(deployment="b", weight=2.0)])
            await admin.SetRoute(rpb.SetRouteRequest(route=new), metadata=auth)
            await admin.DeleteRoute(rpb.DeleteRouteRequest(model="mlp-old"), metadata=auth)
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await admin.DeleteRoute(rpb.DeleteRouteRequest(model="mlp-old"), metadata=auth)
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await first.stop(0)
    second = await start_router(cfg, metering.running.address, ServerOptions(), state)  # same file config
    try:
        routes = second.router.routes
        assert sorted(routes) == ["mlp"]  # the deletion was kept
        assert routes["mlp"].policy.value == "weighted" and routes["mlp"].targets[0].deployment == "b"
        assert routes["mlp"].targets[0].weight == 2.0
        served = await asyncio.to_thread(_infer, second.address, _x(), admin_key)
        assert served.get_response().parameters["path"].string_param == "cpu-b"
    finally:
        await second.stop(0)


async def test_a_route_change_that_cannot_be_kept_is_refused_and_changes_nothing(
    executors: list[RunningExecutor], tmp_path: Path
) -> None:
    # Without metering the state file is where changes are kept: one it cannot write is refused.
    deployments = {"a": executors[0].address, "b": executors[1].address}
    cfg = routes_config(deployments, {"mlp": {"targets": ["a"]}}, require_auth=False)
    state = tmp_path / "state"
    (state / "routes-state.tmp").mkdir(parents=True)  # where the new state would be written: unwritable
    running = await start_router(cfg, "", ServerOptions(), state)
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            new = rpb.Route(model="mlp", policy="pinned", targets=[rpb.Target(deployment="b")])
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await rgrpc.RouterAdminStub(channel).SetRoute(rpb.SetRouteRequest(route=new))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "could not save the route change" in (refused.value.details() or "")
        assert running.router.routes["mlp"].targets[0].deployment == "a"
    finally:
        await running.stop(0)


async def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_route_changes_reach_every_router_of_the_fleet_and_no_other(
    executors: list[RunningExecutor], tmp_path: Path
) -> None:
    shared = await start_metering_at(f"sqlite:///{tmp_path / 'fleet.db'}")  # stopped below
    key = await prepared_ledger_key(shared.address, "fleet-ops", "user", "ops", ("admin", "infer"))
    auth = [("authorization", f"Bearer {key}")]
    deployments = {"a": executors[0].address, "b": executors[1].address}
    routes = {"mlp": {"policy": "pinned", "targets": ["a"]}, "mlp-old": {"targets": ["a"]}}
    cfg = routes_config(deployments, routes, route_sync_s=0.2)
    elsewhere = routes_config(deployments, routes, route_sync_s=0.2)  # another fleet
    one, two, other = [
        await start_router(c, shared.address, ServerOptions(), tmp_path / name)
        for c, name in ((cfg, "one"), (cfg, "two"), (elsewhere, "other"))
    ]
    metering_up = True
    try:
        async with grpc.aio.insecure_channel(one.address) as channel:
            new = rpb.Route(model="mlp", policy="pinned", targets=[rpb.Target(deployment="b")])
            await rgrpc.RouterAdminStub(channel).SetRoute(rpb.SetRouteRequest(route=new), metadata=auth)
        await _wait_for(lambda: two.router.routes["mlp"].targets[0].deployment == "b", "the change on two")
        served = await asyncio.to_thread(_infer, two.address, _x(), key)
        assert served.get_response().parameters["path"].string_param == "cpu-b"
        async with grpc.aio.insecure_channel(two.address) as channel:
            await rgrpc.RouterAdminStub(channel).DeleteRoute(
                rpb.DeleteRouteRequest(model="mlp-old"), metadata=auth
            )
        await _wait_for(lambda: "mlp-old" not in one.router.routes, "the deletion on one")
        await asyncio.sleep(0.5)  # a few of the other fleet's polls
        assert other.router.routes["mlp"].targets[0].deployment == "a" and "mlp-old" in other.router.routes
        late = await start_router(cfg, shared.address, ServerOptions(), tmp_path / "late")
        try:  # a router that joins later starts with the fleet's changes
            assert sorted(late.router.routes) == ["mlp"]
            assert late.router.routes["mlp"].targets[0].deployment == "b"
        finally:
            await late.stop(0)

        await shared.stop(0)  # metering down: changes are refused, the cached ones still apply
        metering_up = False
        async with grpc.aio.insecure_channel(one.address) as channel:
            back = rpb.Route(model="mlp", policy="pinned", targets=[rpb.Target(deployment="a")])
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await rgrpc.RouterAdminStub(channel).SetRoute(rpb.SetRouteRequest(route=back), metadata=auth)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "could not save the route change in metering" in (refused.value.details() or "")
        assert one.router.routes["mlp"].targets[0].deployment == "b"
        await two.stop(0)
        two = await start_router(cfg, shared.address, ServerOptions(), tmp_path / "two")  # same state dir
        assert sorted(two.router.routes) == ["mlp"] and two.router.routes["mlp"].targets[0].deployment == "b"
    finally:
        for running in (one, two, other):
            await running.stop(0)
        if metering_up:
            await shared.stop(0)


async def _switchyard(repo_root: Path, key: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(repo_root)}
    env.pop("SWITCHYARD_API_KEY", None)
    if key is not None:
        env["SWITCHYARD_API_KEY"] = key
    command = [sys.executable, "-m", "clients.cli", *args]
    return await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, cwd=repo_root, env=env, timeout=120
    )


async def test_operator_commands_change_routes_and_infer_through_the_router(
    metering: Metering,
    executors: list[RunningExecutor],
    make_router: RouterFactory,
    tmp_path: Path,
    repo_root: Path,
) -> None:
    deployments = {"a": executors[0].address, "b": executors[1].address}
    cfg = routes_config(deployments, {"mlp": {"policy": "pinned", "targets": ["a"]}})
    router = await make_router(cfg, metering.running.address)
    admin_key, _ = await metering.key("ops-cli", "ops", "admin", "*")
    await metering.stub.GrantRole(mpb.RoleRequest(principal="ops-cli", role="infer", scope="*"))
    at = ("--address", router.address)

    weighted = ("--policy", "weighted", "--target", "a:1", "--target", "b:3")
    done = await _switchyard(repo_root, admin_key, "router", "set-route", "mlp", *weighted, *at)
    assert done.returncode == 0, done.stderr
    assert [t["weight"] for t in json.loads(done.stdout)["targets"]] == [1.0, 3.0]
    listed = json.loads((await _switchyard(repo_root, admin_key, "router", "routes", *at)).stdout)
    assert listed["routes"][0]["policy"] == "weighted"
    states = json.loads((await _switchyard(repo_root, admin_key, "router", "deployments", *at)).stdout)
    assert sorted(d["name"] for d in states["deployments"]) == ["a", "b"]

    np.save(tmp_path / "x.npy", _x(2))
    inferred = await _switchyard(
        repo_root, admin_key, "infer", "--model", "mlp", "--input", str(tmp_path / "x.npy"), *at
    )
    assert inferred.returncode == 0, inferred.stderr
    assert json.loads(inferred.stdout)["parameters"]["path"] in ("cpu-a", "cpu-b")

    assert (await _switchyard(repo_root, admin_key, "router", "delete-route", "mlp", *at)).returncode == 0
    assert "mlp" not in router.router.routes
    for key, status in ((None, "UNAUTHENTICATED"), (admin_key, "NOT_FOUND")):
        refused = await _switchyard(repo_root, key, "router", "delete-route", "mlp", *at)
        assert refused.returncode == 1 and refused.stderr.startswith(f"switchyard router: {status}: ")
        assert "Traceback" not in refused.stderr
    bad = await _switchyard(repo_root, admin_key, "router", "set-route", "mlp", "--target", "a:lots", *at)
    assert bad.returncode == 2 and "the weight after ':' must be a number" in bad.stderr
