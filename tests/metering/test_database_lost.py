"""Metering when its PostgreSQL connection is lost: UNAVAILABLE while the database cannot be
reached (a status the router's spool keeps and retries, where INTERNAL would be dead-lettered),
and the same writes stored once as soon as it can be reached again.

The database is the shared server at 127.0.0.1:5432, reached through a TCP relay in this test
that can cut every connection and refuse new ones, as a server restart or a lost link does;
the server itself cannot be restarted here, since other suites use it
(tests/faults/ restarts a server of its own under load).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import psycopg
import pytest

from services.metering.db import SERVER_CONNECT, make_engines
from services.metering.metering_server import start_metering
from switchyard.gen.switchyard.v1 import metering_pb2 as pb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as pb_grpc
from switchyard.grpcio import ServerOptions
from tests.metering.conftest import PG_PORT, drop_pg_database, make_pg_database
from tests.metering.metering_helpers import HOUR, T0, event, expect_status, setup_path

pytestmark = pytest.mark.postgres


class Relay:
    """127.0.0.1:<port> -> the PostgreSQL server; `cut` closes every connection and refuses
    new ones (the listener is closed), `restore` listens again on the same port."""

    def __init__(self) -> None:
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def restore(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()
        for writer in list(self._writers):
            writer.transport.abort()  # an RST, as a server's host going away sends

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", PG_PORT)
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers -= {writer, up_writer}


@pytest.fixture
async def relayed(pg_unavailable: str | None) -> AsyncIterator[tuple[Relay, str]]:
    name = make_pg_database(pg_unavailable)
    relay = Relay()
    await relay.restore()
    try:
        yield relay, f"postgresql+psycopg://postgres@127.0.0.1:{relay.port}/{name}"
    finally:
        with contextlib.suppress(AssertionError):
            await relay.cut()
        drop_pg_database(name)


def _batch(tag: str, n: int = 5) -> pb.RecordUsageRequest:
    return pb.RecordUsageRequest(events=[event(f"{tag}-{i}", T0 + i * HOUR // 100, 1000) for i in range(n)])


async def test_lost_database_is_unavailable_then_the_retried_write_is_stored_once(
    relayed: tuple[Relay, str], caplog: pytest.LogCaptureFixture
) -> None:
    relay, url = relayed
    running = await start_metering(url, ServerOptions(port=0))
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = pb_grpc.MeteringStub(channel)
            await setup_path(stub)
            first = await stub.RecordUsage(_batch("before"))
            assert first.accepted == 5
            await relay.cut()  # the pooled connections die, and new ones are refused
            for call in (stub.RecordUsage(_batch("during")), stub.CostReport(pb.CostReportRequest())):
                details = await expect_status(call, grpc.StatusCode.UNAVAILABLE, "cannot be reached")
                assert "internal error" not in details
            await relay.restore()
            with caplog.at_level("WARNING", logger="services.metering.db"):
                again = await stub.RecordUsage(_batch("during"))  # the spool's retry, after the restart
            assert (again.accepted, again.duplicates) == (5, 0)
            assert running.ledger.tx.reach.refused == 2 and running.ledger.tx.reach.lost_at is None
            assert "answers again, after" in caplog.text
            replay = await stub.RecordUsage(_batch("during"))
            assert (replay.accepted, replay.duplicates) == (0, 5)
    finally:
        await running.stop(0.5)
    with psycopg.connect(url.replace("+psycopg", "").replace(f":{relay.port}", f":{PG_PORT}")) as conn:
        stored = conn.execute("SELECT count(*) FROM ledger_lines WHERE basis = 'busy'").fetchone()
    assert stored is not None and stored[0] == 10


def test_connections_give_up_on_a_silent_server_and_the_url_can_say_otherwise(
    pg_unavailable: str | None,
) -> None:
    """libpq's timeouts (db.SERVER_CONNECT) are on every pooled connection, and a setting the
    URL names itself is kept: what the blackholed-metering fault in tests/faults/ relies on."""
    name = make_pg_database(pg_unavailable)
    engines = make_engines(f"postgresql+psycopg://postgres@127.0.0.1:{PG_PORT}/{name}?connect_timeout=2")
    try:
        raw = engines.write.raw_connection()
        try:
            params = raw.driver_connection.info.get_parameters()  # type: ignore[union-attr]
        finally:
            raw.close()
    finally:
        engines.dispose()
        drop_pg_database(name)
    assert params["connect_timeout"] == "2"
    assert params["tcp_user_timeout"] == str(SERVER_CONNECT["tcp_user_timeout"])
    assert params["keepalives"] == "1" and params["keepalives_idle"] == str(SERVER_CONNECT["keepalives_idle"])
