"""Faults under load: an executor killed mid-traffic, metering stopped and restarted, a full route.

Every request either succeeds or gets a clear status, none hangs, and the ledger holds each
request exactly once, counted straight from its SQL table.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import grpc
import numpy as np
import pytest
from sqlalchemy import func, select

from services.executor.executor_server import RunningExecutor
from services.metering.schema import LINES
from switchyard.gen.inference import grpc_service_pb2 as pb
from switchyard.gen.inference import grpc_service_pb2_grpc as pbgrpc
from tests.router.conftest import (
    Metering,
    RouterFactory,
    prepared_ledger_key,
    routes_config,
    spawn_executor,
    start_metering_at,
    until,
)

pytestmark = pytest.mark.asyncio(loop_scope="session")

CLEAR = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}


def _request(rows: int = 2) -> pb.ModelInferRequest:
    x = np.random.default_rng(rows).standard_normal((rows, 64)).astype(np.float32)
    req = pb.ModelInferRequest(model_name="mlp")
    req.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    req.raw_input_contents.append(x.tobytes())
    return req


async def _load(
    address: str,
    key: str,
    total: int,
    concurrency: int,
    on_progress: asyncio.Event | None = None,
    progress_at: int = 0,
) -> tuple[list[str], list[str], list[grpc.StatusCode]]:
    """Send `total` requests from `concurrency` clients; returns (request ids and paths served, errors)."""
    served: list[str] = []
    paths: list[str] = []
    errors: list[grpc.StatusCode] = []
    queue = iter(range(total))
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pbgrpc.GRPCInferenceServiceStub(channel)
        request = _request()
        metadata = [("authorization", f"Bearer {key}")]

        async def client() -> None:
            for _ in queue:
                try:
                    reply = await stub.ModelInfer(request, metadata=metadata, timeout=10)
                    served.append(reply.parameters["request_id"].string_param)
                    paths.append(reply.parameters["path"].string_param)
                except grpc.aio.AioRpcError as exc:
                    errors.append(exc.code())
                if on_progress is not None and len(served) + len(errors) == progress_at:
                    on_progress.set()

        await asyncio.wait_for(asyncio.gather(*(client() for _ in range(concurrency))), 60)
    return served, paths, errors


async def test_executor_killed_during_concurrent_load(
    metering: Metering, executors: list[RunningExecutor], make_router: RouterFactory
) -> None:
    victim, victim_address = await spawn_executor()
    try:
        cfg = routes_config(
            {"survivor": executors[0].address, "victim": victim_address},
            {"mlp": {"policy": "weighted", "targets": ["survivor", "victim"]}},
            health_interval_s=0.2,
        )
        router = await make_router(cfg, metering.running.address)
        key, _ = await metering.key("svc-chaos", "chaos")
        halfway = asyncio.Event()
        traffic = asyncio.create_task(_load(router.address, key, 240, 16, halfway, 60))
        await asyncio.wait_for(halfway.wait(), 60)
        victim.send_signal(signal.SIGKILL)  # no drain, no goodbye
        served, paths, errors = await traffic  # wait_for inside: nothing may hang
    finally:
        if victim.returncode is None:
            victim.kill()
        await victim.wait()
    assert len(served) + len(errors) == 240
    assert paths.count("cpu-b") > 10, paths  # the victim took its share before the kill
    assert paths[-20:].count("cpu-b") == 0, paths  # and none after
    assert set(errors) <= CLEAR, errors
    assert len(served) >= 200, f"only {len(served)} served; retry-once should absorb a kill ({errors})"
    states = {s.deployment.name: s for s in router.router.pool.states.values()}
    assert not states["victim"].admitted()  # ejected, not tried on every request
    assert router.router.spool is not None and await router.router.spool.drain(10.0)
    counts = metering.usage_counts(set(served))
    missing = set(served) - set(counts)
    assert not missing and set(counts.values()) == {1}, (missing, counts)  # each completed request once


async def test_killed_executor_is_ejected_and_readmitted_when_it_returns(
    metering: Metering, executors: list[RunningExecutor], make_router: RouterFactory
) -> None:
    first, address = await spawn_executor()
    cfg = routes_config(
        {"preferred": address, "backup": executors[0].address},
        {"mlp": {"policy": "failover", "targets": ["preferred", "backup"]}},
        health_interval_s=0.1,
        eject_base_s=0.5,
        # the cooldown doubles on every failed probe while the executor is down; capped, the
        # re-admission follows its return within a second however long the respawn took (the
        # respawn takes 1.5 s here, so a cap of 2 s made the test wait out up to 2 s more;
        # it stays out until a probe passes, whatever the cap: `DeploymentState.admitted`)
        eject_max_s=1.0,
    )
    router = await make_router(cfg, metering.running.address)
    pool = router.router.pool
    assert pool.transport("preferred") == "frames"  # connected before the router served
    key, _ = await metering.key("svc-return", "ops")
    _, paths, _ = await _load(router.address, key, 5, 1)
    assert set(paths) == {"cpu-a"}  # failover order: the preferred deployment serves
    first.kill()
    await first.wait()
    _, paths, errors = await _load(router.address, key, 20, 2)
    assert errors == [] and set(paths) == {"cpu-b"}  # retried on the backup, then routed around
    state = pool.states["preferred"]
    assert not state.admitted() and state.last_error  # ejected, with the reason kept
    assert pool.transport("preferred") == "grpc"  # its frame connection went with it
    second, _ = await spawn_executor(int(address.rsplit(":", 1)[1]))  # the same executor comes back
    try:
        # generous: past FRAMES_RETRY_S, should a loaded host fail the first frame connect
        loop = asyncio.get_running_loop()
        until = loop.time() + 90
        while not (state.admitted() and pool.transport("preferred") == "frames"):
            assert loop.time() < until, (state, pool.transport("preferred"))
            await asyncio.sleep(0.05)
        assert pool.transport("preferred") == "frames"  # the new process's frame port, found again
        _, paths, errors = await _load(router.address, key, 5, 1)
        assert errors == [] and set(paths) == {"cpu-a"}  # re-admitted after its cooldown
    finally:
        second.kill()
        await second.wait()


async def test_metering_stopped_and_restarted_during_traffic(
    tmp_path: Path, executors: list[RunningExecutor], make_router: RouterFactory
) -> None:
    url = f"sqlite:///{tmp_path / 'restart.db'}"
    first = await start_metering_at(url)
    port = first.port
    key = await prepared_ledger_key(first.address, "svc-restart")
    cfg = routes_config({"a": executors[0].address}, {"mlp": {"policy": "pinned", "targets": ["a"]}})
    router = await make_router(cfg, first.address)
    spool = router.router.spool
    assert spool is not None
    traffic = asyncio.create_task(_load(router.address, key, 300, 4))
    await asyncio.sleep(0.5)
    await first.stop(0)  # metering goes away mid-traffic
    await asyncio.sleep(1.0)
    assert spool.backlog > 0  # usage is on disk while metering is down
    second = await start_metering_at(url, port)
    try:
        served, _, errors = await traffic
        assert errors == [] and len(served) == 300  # the router kept serving throughout
        assert await spool.drain(15.0), "spool did not drain after metering came back"
        with second.ledger.engines.write.connect() as conn:
            rows = conn.execute(
                select(LINES.c.idempotency_key, func.count())
                .where(LINES.c.arm == "primary")
                .group_by(LINES.c.idempotency_key)
            ).all()
        counts = {str(k): int(n) for k, n in rows}
        assert sorted(counts) == sorted(served) and set(counts.values()) == {1}
        assert spool.stats.spooled_events > 0 and spool.stats.replayed_events > 0
    finally:
        await second.stop(0)


async def test_full_route_answers_resource_exhausted_early(
    metering: Metering, executors: list[RunningExecutor], make_router: RouterFactory
) -> None:
    cfg = routes_config(
        {"a": executors[0].address}, {"mlp": {"policy": "pinned", "targets": ["a"], "max_in_flight": 2}}
    )
    router = await make_router(cfg, metering.running.address)
    key, _ = await metering.key("svc-burst", "burst")
    served, _, errors = await _load(router.address, key, 64, 16)
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in errors and served
    assert set(errors) == {grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest.mark.parametrize(
    ("router_wants", "executor_offers", "transport"),
    [("frames", True, "frames"), ("grpc", True, "grpc"), ("frames", False, "grpc")],
)
async def test_deadline_and_cancellation_reach_the_executor_queue(
    metering: Metering, make_router: RouterFactory, router_wants: str, executor_offers: bool, transport: str
) -> None:
    """Both upstream transports carry the caller's remaining deadline (Triton's `timeout`
    parameter): work still queued when it passes is dropped by the executor, not computed. A
    caller who goes away cancels the upstream request (a CANCEL frame, or the stream), and
    that work is dropped too. The router then goes on serving. Frames are used when the router
    wants them and the executor offers them; otherwise streams."""
    from services.executor.executor_config import ExecutorConfig
    from services.executor.executor_server import start_executor

    slow = await start_executor(
        ExecutorConfig(models=("mlp",), max_queue_delay_us=400_000, frames_port=0 if executor_offers else -1)
    )
    try:
        model = slow.executor.find("mlp", "")
        assert model.batcher is not None
        counters = model.batcher.counters
        cfg = routes_config(
            {"slow": slow.address},
            {"mlp": {"policy": "pinned", "targets": ["slow"]}},
            executor_transport=router_wants,
        )
        router = await make_router(cfg, metering.running.address)
        assert router.router.pool.transport("slow") == transport
        key, _ = await metering.key(f"svc-deadline-{router_wants}-{executor_offers}", "deadline")
        metadata = [("authorization", f"Bearer {key}")]
        async with grpc.aio.insecure_channel(router.address) as channel:
            stub = pbgrpc.GRPCInferenceServiceStub(channel)
            executions = counters.executions
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ModelInfer(_request(), metadata=metadata, timeout=0.15)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.sleep(0.1)  # well before the 400 ms batching delay ends
            assert counters.expired_in_queue + counters.cancelled_in_queue >= 1
            assert counters.executions == executions  # never computed

            dropped = counters.cancelled_in_queue
            call = stub.ModelInfer(_request(), metadata=metadata, timeout=30)
            await asyncio.sleep(0.1)  # queued on the executor, waiting out the delay
            call.cancel()
            # the batch forms when the delay ends: the request is gone (the counter moves then,
            # `_drop_dead`; waited for, not slept past: 0.6 s was 0.2 s over the delay)
            await until(lambda: counters.cancelled_in_queue >= dropped + 1)
            assert counters.cancelled_in_queue == dropped + 1
            assert counters.executions == executions

            stream = stub.ModelStreamInfer(metadata=metadata, timeout=30)  # a stream left mid-way
            for _ in range(3):
                await stream.write(_request())
            await asyncio.sleep(0.1)
            stream.cancel()
            await until(lambda: counters.cancelled_in_queue >= dropped + 4)
            assert counters.cancelled_in_queue == dropped + 4  # its queued requests dropped too
            assert counters.executions == executions

            reply = await stub.ModelInfer(_request(), metadata=metadata, timeout=10)
            assert reply.parameters["path"].string_param == "cpu-a"
            assert counters.executions == executions + 1
    finally:
        await slow.stop(0)
