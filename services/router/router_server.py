"""Assembles and starts the router: OIP front, admin API, executor pool, auth, usage spool.

`start_router` is the in-process entry point used by the CLI, the cluster and the tests;
`RunningRouter.stop` drains (health NOT_SERVING, in-flight calls finish), then flushes usage
to metering or to the spool, so a stop loses nothing it had accepted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from services.router import oip_servicer
from services.router.admin_servicer import AdminServicer
from services.router.administration import RouterAdministration
from services.router.admission import Admission, Limit
from services.router.auth import Authenticator
from services.router.capture import Capturer
from services.router.evaluator_client import EvaluatorComparer
from services.router.executor_pool import ExecutorPool
from services.router.fleet_limits import FleetLimits
from services.router.forwarder import Forwarder
from services.router.metering_client import MeteringClient
from services.router.openai_api import OpenAIServer
from services.router.path_registrar import PathRegistrar
from services.router.request_path import RequestPath
from services.router.route_store import RouteStore
from services.router.route_table import RouteTable
from services.router.router_config import RouterConfig, Settings
from services.router.shadow_mirror import ShadowMirror
from services.router.spool import Spool
from services.router.usage_meter import UsageMeter
from switchyard import tls
from switchyard.errors import InvalidArgument
from switchyard.gen.switchyard.v1 import router_pb2_grpc
from switchyard.grpcio import OnServer, Registration, RunningServer, ServerOptions, start_server

log = logging.getLogger(__name__)


@dataclass
class RunningRouter(OnServer):
    server: RunningServer
    router: RequestPath
    metering: MeteringClient | None
    openai: OpenAIServer | None = None  # the OpenAI-compatible HTTP API, when [router] openai_port >= 0
    fleet_limits: FleetLimits | None = None  # per-principal limits, shared through metering

    async def stop(self, grace_s: float = 5.0) -> None:
        spool = self.router.spool
        if spool is not None:
            spool.set_ready = None  # draining: the spool no longer decides readiness
        if self.openai is not None:
            await self.openai.close()
        await self.server.drain(grace_s)
        if self.fleet_limits is not None:
            await self.fleet_limits.close()
        await self.router.close()
        if spool is not None:
            await spool.close()
        await self.router.pool.close()
        if self.metering is not None:
            await self.metering.close()

    async def serve_until_signal(self, stop: asyncio.Event | None = None) -> None:
        try:
            await self.server.wait_for_signal(stop)
        finally:
            await self.stop()


async def start_router(
    config: RouterConfig,
    metering_address: str = "",
    options: ServerOptions | None = None,
    spool_dir: Path | None = None,
    security: tls.Security | None = None,
) -> RunningRouter:
    """`security`: the router's identity for its calls to metering, executors and the
    evaluator (None: the process's, from the environment). Its own port is public: callers
    bring API keys, and TLS on it comes from `options.public_tls`."""
    settings = config.settings
    security = tls.resolve(security if security is not None else (options.security if options else None))
    if settings.require_auth and not metering_address:
        raise InvalidArgument(
            "the router checks keys through metering: pass --metering HOST:PORT, or set "
            "require_auth = false under [router] for a trusted local setup"
        )
    metering = MeteringClient(metering_address, security=security) if metering_address else None
    spool_dir = spool_dir or Path(settings.spool_dir)
    spool = _start_spool(metering, settings, spool_dir)
    pool = ExecutorPool(config.deployments, settings, security)
    await pool.start()
    router = await _start_request_path(config, pool, metering, spool, spool_dir, security)
    fleet_limits = await _start_fleet_limits(router, metering, settings)
    # every servicer maps its own errors: no interceptor on the request path
    options = dataclasses.replace(
        options or ServerOptions(),
        map_errors_in_servicers=True,
        public=True,
        security=security,
        registered_methods=oip_servicer.HOT_METHODS,  # only inference: a cheaper call (grpcio)
    )
    server = await _start_fronts(router, options, fleet_limits)
    running = RunningRouter(server, router, metering, fleet_limits=fleet_limits)
    if settings.openai_port >= 0:
        running.openai = OpenAIServer(router)
        try:
            # TLS whenever the public gRPC port has it, with the same certificate
            await running.openai.start(options.host, settings.openai_port, options.public_tls)
        except OSError:
            await running.stop(0)
            raise
    return running


def _start_spool(metering: MeteringClient | None, settings: Settings, directory: Path) -> Spool | None:
    """Usage and audit events' way to metering (None without metering: not recorded)."""
    if metering is None:
        log.warning("no metering address: usage is not recorded")
        return None
    spool = Spool(
        metering,
        directory,
        settings.usage_flush_s,
        settings.usage_batch,
        max_bytes=settings.spool_max_mb << 20,
        alarm_fraction=settings.spool_alarm_fraction,
        journal_sync=settings.usage_journal_sync,
        reserve_bytes=settings.spool_reserve_kb << 10,
    )
    spool.start()
    if spool.backlog:
        log.info("replaying %d spooled usage segments from an earlier run", spool.backlog)
    return spool


async def _start_request_path(
    config: RouterConfig,
    pool: ExecutorPool,
    metering: MeteringClient | None,
    spool: Spool | None,
    spool_dir: Path,
    security: tls.Security,
) -> RequestPath:
    """The stages, started: the route table synced with the fleet, paths registering, captures."""
    settings = config.settings
    auth = (
        Authenticator(metering, settings.auth_cache_ttl_s, settings.auth_stale_s, settings.auth_cache_entries)
        if metering is not None and settings.require_auth
        else None
    )
    evaluator = EvaluatorComparer(settings.evaluator, security=security) if settings.evaluator else None
    # admin changes: kept across restarts, and shared by the fleet through metering
    store = RouteStore(spool_dir, metering, settings.fleet)
    # every deployment's ledger path, registered from what its executor describes (`path_registrar`)
    registrar = PathRegistrar(metering, config.deployments, pool.channels) if metering is not None else None
    table = RouteTable(config.routes, config.deployments, store, registrar)
    router = _request_path(config, pool, auth, spool, table, evaluator)
    if registrar is not None:
        registrar.want(d.name for d in config.deployments)
        registrar.start()
    _start_captures(router, config, Path(settings.workloads_dir))
    if metering is not None:
        await table.poller.start(settings.route_sync_s)
    return router


async def _start_fleet_limits(
    router: RequestPath, metering: MeteringClient | None, settings: Settings
) -> FleetLimits:
    """Per-principal limits set through RouterAdmin, synced with the fleet's (`fleet_limits`)."""
    fleet_limits = FleetLimits(router.admission.limits, metering, settings.fleet)
    if metering is not None:
        await fleet_limits.poller.start(settings.route_sync_s)
    return fleet_limits


async def _start_fronts(
    router: RequestPath, options: ServerOptions, fleet_limits: FleetLimits
) -> RunningServer:
    """The OIP and RouterAdmin servicers on the router's port."""
    registrations: list[Registration] = [
        (oip_servicer.add_to_server, oip_servicer.OipServicer(router), oip_servicer.SERVICE),
        (
            router_pb2_grpc.add_RouterAdminServicer_to_server,
            AdminServicer(RouterAdministration(router, fleet_limits)),
            "switchyard.v1.RouterAdmin",
        ),
    ]
    server = await start_server(registrations, options)
    spool = router.spool
    if spool is not None:
        spool.set_ready = server.set_serving  # a spool near its bound takes the router out of rotation
        if spool.under_pressure:
            await server.set_serving(False)
    log.info(
        "router serving on %s (%d routes, %d deployments; %s)",
        server.address,
        len(router.routes),
        len(router.pool.states),
        server.describe_security(),
    )
    return server


def _request_path(
    config: RouterConfig,
    pool: ExecutorPool,
    auth: Authenticator | None,
    spool: Spool | None,
    table: RouteTable,
    evaluator: EvaluatorComparer | None,
) -> RequestPath:
    """The router's stages, each given what it needs (`request_path` puts them in order)."""
    settings = config.settings
    default_limit = Limit(
        settings.principal_rate_per_s, settings.principal_burst, settings.principal_max_in_flight
    )
    forwarder = Forwarder(pool, settings)
    meter = UsageMeter(spool, pool.states)
    return RequestPath(
        settings=settings,
        pool=pool,
        admission=Admission(auth, spool, default_limit),
        table=table,
        forwarder=forwarder,
        meter=meter,
        mirror=ShadowMirror(forwarder, meter, settings, evaluator),
    )


def _start_captures(path: RequestPath, config: RouterConfig, root: Path) -> None:
    """A capture per route whose routes-file entry opts in; each start is audited."""
    for route in config.routes:
        if route.capture is None:
            continue
        capturer = Capturer(route.model, route.capture, root / route.model)
        capturer.start()
        path.captures[route.model] = capturer
        detail = json.dumps(
            {"share": route.capture.share, "max_mb": route.capture.max_mb,
             "retention_s": route.capture.retention_s, "folder": str(capturer.folder)}
        )  # fmt: skip
        path.admission.audit(None, "workload.capture", f"route/{route.model}", "ok", detail, "", "router")
