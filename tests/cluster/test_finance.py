"""The main job's finance and access steps against a real metering service (SQLite, port 0)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from clients.local_cluster import demo_finance as finance
from clients.local_cluster.principal_keys import create_principal_key
from clients.local_cluster.traffic import create_team_key
from services.metering.metering_server import RunningMetering, start_metering
from switchyard.gen.switchyard.v1 import metering_pb2, metering_pb2_grpc
from switchyard.grpcio import ServerOptions
from tests.metering.metering_helpers import event


@pytest.fixture
async def metering(tmp_path: Path) -> AsyncIterator[RunningMetering]:
    running = await start_metering(f"sqlite:///{tmp_path / 'ledger.db'}", ServerOptions(port=0))
    try:
        yield running
    finally:
        await running.stop(0)


def _address(m: RunningMetering) -> str:
    return m.address


async def test_team_key_authenticates_with_the_infer_role(metering: RunningMetering) -> None:
    team = await create_team_key(_address(metering), "team-a", models=("mlp",))
    async with grpc.aio.insecure_channel(_address(metering)) as channel:
        stub = metering_pb2_grpc.MeteringStub(channel)
        who = await stub.Authenticate(metering_pb2.AuthenticateRequest(key=team.key))
    assert who.principal.principal_id == team.principal_id
    assert [(r.role, r.scope) for r in who.roles] == [("infer", "model:mlp")]


async def test_an_existing_principal_gets_a_new_key_only_when_asked(metering: RunningMetering) -> None:
    """`switchyard up` makes the Temporal UI principal's key again when its key file went."""
    actor = metering_pb2.Actor(source="test")
    grants = [("trials:run", "*")]
    first = await create_principal_key(_address(metering), "temporal-ui", grants, actor, kind="service")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await create_principal_key(_address(metering), "temporal-ui", grants, actor, kind="service")
    assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
    again = await create_principal_key(
        _address(metering), "temporal-ui", grants, actor, kind="service", existing_ok=True
    )
    assert again.key_id != first.key_id
    async with grpc.aio.insecure_channel(_address(metering)) as channel:
        stub = metering_pb2_grpc.MeteringStub(channel)
        for made in (first, again):
            who = await stub.Authenticate(metering_pb2.AuthenticateRequest(key=made.key))
            assert who.principal.name == "temporal-ui"
            assert [(r.role, r.scope) for r in who.roles] == [("trials:run", "*")]


async def test_priced_reserved_window_reports_cost_per_completed_job_and_idle(
    metering: RunningMetering, tmp_path: Path
) -> None:
    address = _address(metering)
    executors = {"cpu": "127.0.0.1:1"}  # no executor runs: prices fall back to local keys
    paths = {"cpu": "cpu-eager@test"}
    await finance.ensure_prices(address, executors, paths)
    start = int(time.time() * 1_000_000) - 10_000_000
    reservations = await finance.open_reservations(address, paths, "t1", start)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = metering_pb2_grpc.MeteringStub(channel)
        events = [
            event(f"req-{i}", start + i * 1_000_000, 500_000, "cpu-eager@test", team="team-a", kind="request")
            for i in range(4)
        ]
        await stub.RecordUsage(metering_pb2.RecordUsageRequest(events=events))
    await finance.close_reservations(address, reservations)
    rows = {r.path: r for r in await finance.report(address, start)}
    cpu = rows["cpu-eager@test"]
    assert cpu.jobs_completed == 4
    assert cpu.total_micros > 0 and cpu.idle_micros > 0
    assert abs(cpu.cost_per_completed_job_micros - cpu.total_micros / 4) <= 0.5  # rounded once, to the micro
    assert 0 < cpu.idle_share < 1
    table = finance.format_table(list(rows.values()))
    head, _rule, line = table.splitlines()[:3]
    assert line.split()[:2] == ["cpu-eager@test", "4"]
    assert head.index("per completed job") == line.index(finance.money(cpu.cost_per_completed_job_micros))
    assert head.index("idle share") == line.index(f"{cpu.idle_share:.1%}")
    html = await finance.write_html(address, tmp_path / "finance.html", start)
    assert "cpu-eager@test" in html.read_text()


def test_money_is_exact() -> None:
    assert finance.money(1) == "0.000001"
    assert finance.money(-2_500_000) == "-2.500000"
    assert finance.money(123_456_789_012) == "123456.789012"
