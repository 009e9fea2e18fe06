"""Starting the metering service: in-process (tests, `switchyard up`) or as `switchyard metering serve`.

`start_metering(url, ServerOptions(port=0))` migrates the database to head, opens the
ledger and serves it; the returned object has `.address`, `.ledger` and `async stop()`.
While it serves, it signs the audit chain's head into the anchor file every `anchor_s`
seconds (SWITCHYARD_AUDIT_ANCHOR_S, default 10), at start and once more at stop; an anchor
that fails its check halts the ledger's writes (services/metering/integrity.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from dataclasses import dataclass, field

from services.metering.auditkey import AnchorError
from services.metering.db import resolve_url
from services.metering.guard import MeteringGuard
from services.metering.ledger import Ledger
from services.metering.metering_servicer import MeteringServicer
from switchyard import tls
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as pb_grpc
from switchyard.grpcio import OnServer, RunningServer, ServerOptions, start_server

log = logging.getLogger(__name__)
SERVICE_NAME = "switchyard.v1.Metering"
DEFAULT_PORT = 8201
ENV_ANCHOR_S = "SWITCHYARD_AUDIT_ANCHOR_S"


async def _anchor_loop(ledger: Ledger, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        try:
            await asyncio.to_thread(ledger.audit.write_anchor)
        except AnchorError:  # the ledger halted; integrity.halt logged, counted and audited it
            pass
        except Exception as exc:  # keep serving; the next round tries again
            log.warning("could not write the audit head digest to %s: %s", ledger.audit.anchor_path, exc)


async def _final_anchor(ledger: Ledger) -> None:
    try:
        await asyncio.to_thread(ledger.audit.write_anchor)
    except AnchorError:
        pass
    except Exception as exc:
        log.warning("could not write the audit head digest to %s: %s", ledger.audit.anchor_path, exc)


@dataclass
class RunningMetering(OnServer):
    server: RunningServer
    ledger: Ledger
    servicer: MeteringServicer
    anchor_task: asyncio.Task[None] | None = field(default=None)

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain (NOT_SERVING, finish in-flight calls), then release threads and connections."""
        await self.server.drain(grace_s)
        await asyncio.to_thread(self.servicer.shutdown)
        await self._stop_anchor()
        self.ledger.close()

    async def _stop_anchor(self) -> None:
        if self.anchor_task is not None:
            self.anchor_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.anchor_task
            self.anchor_task = None
            await _final_anchor(self.ledger)

    async def serve_until_signal(self, stop: asyncio.Event | None = None) -> None:
        try:
            await self.server.wait_for_signal(stop)
        finally:
            await asyncio.to_thread(self.servicer.shutdown)
            await self._stop_anchor()
            self.ledger.close()


async def start_metering(
    database_url: str | None = None, options: ServerOptions | None = None
) -> RunningMetering:
    """Migrate, open and serve the ledger at `database_url` (default: SWITCHYARD_DATABASE_URL or SQLite)."""
    options = options or ServerOptions()
    url = resolve_url(database_url)
    ledger = await asyncio.to_thread(Ledger.open, url)
    servicer = MeteringServicer(ledger)
    security = tls.resolve(options.security)
    guard = MeteringGuard(security, ledger, servicer._writer)
    options = dataclasses.replace(options, security=security, guard=guard)
    try:
        server = await start_server(
            [(pb_grpc.add_MeteringServicer_to_server, servicer, SERVICE_NAME)], options
        )
    except BaseException:
        servicer.shutdown()
        ledger.close()
        raise
    log.info("metering serving on %s (%s; %s)", server.address, ledger.engines.dialect, security.describe())
    task = None
    if ledger.audit.anchor_path is not None:
        with contextlib.suppress(AnchorError):  # a failure halts the ledger; integrity logs it
            await asyncio.to_thread(ledger.audit.write_anchor)
        every_s = float(os.environ.get(ENV_ANCHOR_S, "10"))
        task = asyncio.create_task(_anchor_loop(ledger, every_s), name="audit-anchor")
    else:
        log.warning(
            "no audit head digest file (set SWITCHYARD_AUDIT_ANCHOR): removing the newest audit rows "
            "together with the head row would go unnoticed"
        )
    return RunningMetering(server, ledger, servicer, task)
