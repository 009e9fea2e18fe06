"""Starting the metering service: in-process (tests, `switchyard up`) or as `switchyard metering serve`.

`start_metering(url, ServerOptions(port=0))` migrates the database to head, opens the
ledger and serves it; the returned object has `.address`, `.ledger` and `async stop()`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from services.metering.db import resolve_url
from services.metering.ledger import Ledger
from services.metering.servicer import MeteringServicer
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as pb_grpc
from switchyard.grpcio import RunningServer, ServerOptions, start_server

log = logging.getLogger(__name__)
SERVICE_NAME = "switchyard.v1.Metering"
DEFAULT_PORT = 8201


@dataclass
class RunningMetering:
    server: RunningServer
    ledger: Ledger
    servicer: MeteringServicer

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def port(self) -> int:
        return self.server.port

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain (NOT_SERVING, finish in-flight calls), then release threads and connections."""
        await self.server.drain(grace_s)
        await asyncio.to_thread(self.servicer.shutdown)
        self.ledger.close()

    async def serve_until_signal(self, stop: asyncio.Event | None = None) -> None:
        try:
            await self.server.wait_for_signal(stop)
        finally:
            await asyncio.to_thread(self.servicer.shutdown)
            self.ledger.close()


async def start_metering(
    database_url: str | None = None, options: ServerOptions | None = None
) -> RunningMetering:
    """Migrate, open and serve the ledger at `database_url` (default: SWITCHYARD_DATABASE_URL or SQLite)."""
    options = options or ServerOptions()
    url = resolve_url(database_url)
    ledger = await asyncio.to_thread(Ledger.open, url)
    servicer = MeteringServicer(ledger)
    try:
        server = await start_server(
            [(pb_grpc.add_MeteringServicer_to_server, servicer, SERVICE_NAME)], options
        )
    except BaseException:
        servicer.shutdown()
        ledger.close()
        raise
    log.info("metering serving on %s (%s)", server.address, ledger.engines.dialect)
    return RunningMetering(server, ledger, servicer)
