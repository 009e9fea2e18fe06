"""Starting an executor: in process (`start_executor`, for tests and the cluster) or as a CLI.

`start_executor(config)` selects the backend, loads the configured models (each warmed for
every bucket; health stays NOT_SERVING until then, so a readiness probe or a router sends
nothing to a replica that is still compiling), and starts a grpc.aio server with the OIP and
control services, health, reflection and explicit message limits. The returned `RunningExecutor` has `.port`,
`.address`, `.executor` and async `stop()` (drain: NOT_SERVING, refuse new work, finish
in-flight, stop) and `serve_until_signal()` (SIGTERM/SIGINT -> the same drain).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from services.executor.control import ControlServicer
from services.executor.data_plane import DataPlane
from services.executor.device import select_backend
from services.executor.executor_config import GENERATION_ENGINES, ExecutorConfig
from services.executor.executor_runtime import Executor
from services.executor.executor_servicer import InferenceServicer
from services.executor.frame_server import FrameServer
from switchyard import authz, tls
from switchyard.errors import InvalidArgument
from switchyard.gen.inference import grpc_service_pb2_grpc
from switchyard.gen.switchyard.v1 import executor_pb2_grpc
from switchyard.grpcio import OnServer, RunningServer, ServerOptions, start_server
from switchyard.models.repository import Repository, default_repository

log = logging.getLogger(__name__)

OIP_SERVICE = "inference.GRPCInferenceService"
CONTROL_SERVICE = "switchyard.v1.ExecutorControl"
# Control methods that change nothing: the operator's status table may ask them too.
READ_ONLY_CONTROL = ("Describe", "ModelStatus", "GetLoad")
MUTATING_CONTROL = ("LoadModel", "Unload", "Train")
OIP_METHODS = (
    "ModelInfer",
    "ModelStreamInfer",
    "ModelMetadata",
    "ModelConfig",
    "ModelReady",
    "ServerLive",
    "ServerReady",
    "ServerMetadata",
    "ModelStatistics",
)
# registered with gRPC's core; every other method is found by the generic handlers
# (ServerOptions.registered_methods: grpc.aio waits on one pending call per registered method)
HOT_METHODS = frozenset(f"/{OIP_SERVICE}/{m}" for m in ("ModelInfer", "ModelStreamInfer"))


def executor_guard(
    config: ExecutorConfig, security: tls.Security, audit: authz.AuditSink | None
) -> authz.ServiceGuard:
    """Control from the router and the worker (reads also from the operator); inference
    straight here only from `config.oip_identities`."""
    rules: dict[str, tuple[str, ...]] = {m: (tls.ROUTER, tls.WORKER) for m in MUTATING_CONTROL}
    rules.update({m: (tls.ROUTER, tls.WORKER, tls.OPERATOR) for m in READ_ONLY_CONTROL})
    rules.update({m: config.oip_identities for m in OIP_METHODS})
    return authz.ServiceGuard(security, rules, (tls.ROUTER, tls.WORKER), audit, "an executor")


@dataclass
class RunningExecutor(OnServer):
    executor: Executor
    server: RunningServer
    plane: DataPlane  # what every inference transport answers through
    frames: FrameServer | None = None
    audit: authz.MeteringAudit | None = None

    async def stop(self, grace_s: float | None = None) -> None:
        """Drains, then stops.

        Health turns NOT_SERVING and new work is refused with UNAVAILABLE ("draining") while
        the port stays open, so routers see why; requests already inside (queued or computing)
        finish within the grace period; then the server stops.
        """
        grace = self.server.options.drain_grace_s if grace_s is None else grace_s
        self.executor.draining = True
        await self.server.set_serving(False)
        loop = asyncio.get_running_loop()
        until = loop.time() + grace
        # polling: in_flight is a plain counter, and a drain happens once per process
        while self.executor.in_flight > 0 and loop.time() < until:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        if self.frames is not None:
            await self.frames.close()
        await self.server.server.stop(max(0.0, until - loop.time()))
        await self.server.stop_health()
        await self.executor.close()
        if self.audit is not None:
            await self.audit.close()

    async def serve_until_signal(self, stop: asyncio.Event | None = None) -> None:
        """Serves until SIGTERM or SIGINT (or `stop` from `stop_signal()`), then drains as `stop` does."""
        await self.server.wait_for_signal(stop, self.stop)


def _server_options(
    config: ExecutorConfig, security: tls.Security, audit: authz.MeteringAudit | None
) -> ServerOptions:
    guard = None if security.insecure else executor_guard(config, security, audit)
    return ServerOptions(
        host=config.host,
        port=config.port,
        max_receive_bytes=config.max_message_bytes,
        max_send_bytes=config.max_message_bytes,
        drain_grace_s=config.drain_grace_s,
        map_errors_in_servicers=True,  # no per-call interceptor on the hot path
        security=security,
        guard=guard,
        registered_methods=HOT_METHODS,  # only inference: a cheaper call (grpcio)
    )


async def _frames_and_models(
    running: RunningExecutor, config: ExecutorConfig, security: tls.Security
) -> None:
    """The frame server (unless off), then every configured model, loaded and warmed."""
    executor = running.executor
    if config.frames_port >= 0:
        running.frames = FrameServer(
            running.plane,
            config.max_message_bytes,
            security,
            config.oip_identities,
            running.audit,
            config.frames_max_in_flight,
        )
        executor.frames_port = await running.frames.start(config.host, config.frames_port)
    for entry in config.models:
        name, _, version = entry.partition(":")
        await executor.load_model(name, version, executor.default_options(name, version))


async def start_executor(config: ExecutorConfig, security: tls.Security | None = None) -> RunningExecutor:
    """`security`: mTLS identity, or explicit plaintext (None: the process's, from the environment)."""
    security = tls.resolve(security)
    if config.gil_switch_interval_us < 1:  # refused before any process-wide setting changes
        raise InvalidArgument(
            f"gil_switch_interval_us is {config.gil_switch_interval_us}; use 1 or more (microseconds)"
        )
    if config.generation_engine not in GENERATION_ENGINES:
        raise InvalidArgument(
            f"generation_engine is {config.generation_engine!r}; use one of {list(GENERATION_ENGINES)}"
        )
    backend = select_backend(config.backend, config.cpu_threads)
    sys.setswitchinterval(config.gil_switch_interval_us / 1e6)
    root = Path(config.model_repository) if config.model_repository else default_repository()
    executor = Executor(config, backend, Repository(root.resolve(), config.allowed_factories))
    audit = (
        authz.MeteringAudit(config.metering, security, f"executor {config.backend}")
        if config.metering and not security.insecure
        else None
    )
    options = _server_options(config, security, audit)
    plane = DataPlane(executor)
    server = await start_server(
        [
            (
                grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server,
                InferenceServicer(plane),
                OIP_SERVICE,
            ),
            (
                executor_pb2_grpc.add_ExecutorControlServicer_to_server,
                ControlServicer(executor),
                CONTROL_SERVICE,
            ),
        ],
        options,
        serving=False,  # NOT_SERVING until every configured model is loaded and warm
    )
    if not config.executor_id:
        executor.executor_id = f"{executor.executor_id}:{server.port}"
    running = RunningExecutor(executor, server, plane, audit=audit)
    try:
        await _frames_and_models(running, config, security)
    except BaseException:
        await running.stop(0)
        raise
    await server.set_serving(True)
    log.info(
        "executor %s (%s) serving %s on %s (frames on port %s; %s)",
        executor.executor_id,
        backend.name,
        config.models,
        running.address,
        executor.frames_port or "off",
        security.describe(),
    )
    return running
