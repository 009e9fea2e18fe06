"""gRPC edge shared by every service: error mapping, server start-up, health and drain.

This is the one place where `switchyard.errors` become gRPC status codes (docs/architecture.md#errors,
#code-style).
An unexpected exception becomes INTERNAL with a reference id; the traceback goes to the
log, never to the caller.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from switchyard import allocator, authz, net, telemetry, tls
from switchyard.errors import InvalidArgument, Status, SwitchyardError
from switchyard.gen import _pool

# The type of a servicer method's `context` argument, for every servicer.
ServicerContext = grpc.aio.ServicerContext[Any, Any]

log = logging.getLogger(__name__)

HEALTH_PORT_ENV = "SWITCHYARD_HEALTH_PORT"
GRPC_CODE: dict[Status, grpc.StatusCode] = {s: getattr(grpc.StatusCode, s.value) for s in Status}
_STATUS_OF: dict[grpc.StatusCode, Status] = {code: status for status, code in GRPC_CODE.items()}


def grpc_code(error: SwitchyardError) -> grpc.StatusCode:
    return GRPC_CODE[error.status]


def status_of(code: grpc.StatusCode) -> Status:
    """The status named as a gRPC code is (UNKNOWN for OK, which is no error)."""
    return _STATUS_OF.get(code, Status.UNKNOWN)


def internal_error(exc: BaseException, method: str) -> str:
    """Logs an unexpected exception with a reference id; returns the message for the caller,
    which names the reference and never the traceback."""
    ref = uuid.uuid4().hex[:12]
    log.exception("internal error in %s (reference %s)", method, ref, exc_info=exc)
    return f"internal error (reference {ref}); see the server log"


async def _abort_for(context: ServicerContext, exc: BaseException, method: str) -> None:
    if isinstance(exc, SwitchyardError):
        trailers = getattr(exc, "trailers", None)  # e.g. retry-after-ms on RESOURCE_EXHAUSTED
        if trailers:
            context.set_trailing_metadata(trailers)
        await context.abort(grpc_code(exc), str(exc))
    await context.abort(grpc.StatusCode.INTERNAL, internal_error(exc, method))


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps SwitchyardError to its status and anything unexpected to INTERNAL, for all RPCs."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                _wrap_stream(handler.stream_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


class ErrorMappedServicer:
    """A servicer whose RPC methods map errors as ErrorInterceptor does (and are traced, with
    tracing on: `map_errors`), bound once.

    The same mapping without an interceptor in the call path: an aio interceptor costs an
    extra coroutine and a new method handler on every call (about 15% of a small RPC here).
    The generated `add_*_to_server` reads each method once, so the wrapping happens once.
    """

    def __init__(self, servicer: Any, service: str, guard: authz.Guard | None = None) -> None:
        self._servicer = servicer
        self._service = service
        self._guard = guard

    def __getattr__(self, name: str) -> Any:
        behavior = getattr(self._servicer, name)
        if not callable(behavior) or not name[:1].isupper():
            return behavior
        return map_errors(behavior, f"/{self._service}/{name}", self._guard)


def map_errors(
    behavior: Callable[..., Any], method: str, guard: authz.Guard | None = None
) -> Callable[..., Any]:
    """`behavior` (an RPC method: coroutine or async generator) with errors mapped to statuses
    as ErrorInterceptor maps them, after `guard` admitted the caller; for handlers registered
    by hand with `map_errors_in_servicers`. With tracing on, the call is also a span
    (`telemetry.traced`) around the guard and the mapping, so it ends with the call's status."""
    if inspect.isasyncgenfunction(behavior):
        return telemetry.traced(_wrap_stream(behavior, method, guard), method)
    return telemetry.traced(_wrap_unary(behavior, method, guard), method)


def _wrap_unary(
    behavior: Callable[..., Any], method: str, guard: authz.Guard | None = None
) -> Callable[..., Any]:
    async def wrapper(request: Any, context: ServicerContext) -> Any:
        try:
            if guard is not None:
                await guard.admit(method, context)
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort_for(context, exc, method)

    return wrapper


def _wrap_stream(
    behavior: Callable[..., Any], method: str, guard: authz.Guard | None = None
) -> Callable[..., Any]:
    async def wrapper(request: Any, context: ServicerContext) -> AsyncIterator[Any]:
        try:
            if guard is not None:
                await guard.admit(method, context)
            async for item in behavior(request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort_for(context, exc, method)

    return wrapper


@dataclass(frozen=True)
class ServerOptions:
    """Explicit limits every switchyard server runs with."""

    host: str = "127.0.0.1"
    port: int = 0
    max_receive_bytes: int = net.MAX_MESSAGE_BYTES
    max_send_bytes: int = net.MAX_MESSAGE_BYTES
    drain_grace_s: float = 10.0
    # Map errors by wrapping each servicer's RPC methods once instead of by an interceptor on
    # every call (cheaper); only for servicers whose RPCs are plain `async def Name(request,
    # context)` methods registered through generated `add_*_to_server` functions.
    map_errors_in_servicers: bool = False
    # Internal ports: mutual TLS with this identity, or plaintext where it is explicitly
    # insecure; None = the process's (switchyard.tls.current: the environment).
    security: tls.Security | None = None
    # A port for callers outside the cluster (the router's front): no client certificate is
    # asked for; TLS from `public_tls` (certificate chain PEM, private key PEM) when given.
    public: bool = False
    public_tls: tuple[bytes, bytes] | None = None
    # Asked before every RPC of the registered services (not health or reflection).
    guard: authz.Guard | None = None
    # A second, plaintext port with grpc.health.v1 only, for probes that cannot show a client
    # certificate (the kubelet's gRPC probes); None = SWITCHYARD_HEALTH_PORT, unset = none.
    health_port: int | None = None
    # The full method names ("/pkg.Service/Method") registered with gRPC's core; None = every
    # method, as generated code registers them. grpc.aio's server keeps one pending call per
    # registered method (plus one for all others) and waits on all of them with
    # `asyncio.wait` for every incoming call: on the router's 20 methods that wait cost about
    # 55 us more per call than over 3 (on this 2-core host, loaded). The others are found by
    # the generic handlers, as an unregistered method always is.
    registered_methods: frozenset[str] | None = None

    def channel_options(self) -> list[tuple[str, int]]:
        # and the keepalive pings the internal clients send (switchyard.net.KEEPALIVE_OPTIONS)
        limits = net.message_options(self.max_receive_bytes, self.max_send_bytes)
        return [*limits, *net.KEEPALIVE_PERMIT_OPTIONS]


# gRPC sets SO_REUSEPORT on Linux by default, so a second server (ours or anyone's of the same
# user) may bind a port a service holds, and the kernel then splits new connections between
# the two: half of a service's callers reach another server ("Method not found!"). Off, a
# port already held fails the bind, loudly.
NO_PORT_SHARING = ("grpc.so_reuseport", 0)

# (add_XServicer_to_server, servicer, full service name)
Registration = tuple[Callable[[Any, Any], None], Any, str]


T = TypeVar("T")


def run_service(main: Coroutine[Any, Any, T]) -> T:
    """Run a service process's main coroutine on uvloop.

    grpc.aio hands every completed operation to the event loop, so a request costs several
    loop wake-ups and callbacks, and uvloop's are cheaper than asyncio's own loop: about 0.1 to
    0.2 ms less added latency through the router at p50 here. benchmarks/bench_router.py compares
    the router as deployed (this loop, the transport of switchyard/transport.py) with
    one on stock settings in the same run. SWITCHYARD_LOOP=asyncio runs the standard loop.
    Tests run the same services in-process on pytest's asyncio loop.
    """
    choice = os.environ.get("SWITCHYARD_LOOP", "uvloop")
    try:
        if choice not in ("uvloop", "asyncio"):
            raise InvalidArgument(f"SWITCHYARD_LOOP={choice!r}: use uvloop (the default) or asyncio")
        allocator.keep_freed_memory()  # large messages without a page fault per page (see there)
    except InvalidArgument:
        main.close()  # refused before it ran: not left un-awaited
        raise
    return asyncio.run(main) if choice == "asyncio" else uvloop.run(main)


def stop_signal() -> asyncio.Event:
    """An event that SIGTERM or SIGINT sets.

    Call it before a server starts or announces its address: a signal arriving between the
    announcement and a later handler would kill the process without draining.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: Any  # grpc_health aio HealthServicer
    services: Sequence[str]
    options: ServerOptions
    security: tls.Security = field(default_factory=tls.Security.plaintext)
    health_server: grpc.aio.Server | None = None
    health_port: int = 0
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def address(self) -> str:
        return f"{self.options.host}:{self.port}"

    def describe_security(self) -> str:
        """For the service's start line: how its port is protected."""
        if self.options.public:
            front = "TLS" if self.options.public_tls is not None else "plaintext"
            return f"public port: {front}; internal calls: {self.security.describe()}"
        return self.security.describe()

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.services):
            await self.health.set(name, status)

    async def drain(self, grace_s: float | None = None) -> None:
        """Report NOT_SERVING, let in-flight calls finish within the grace period, stop."""
        await self.set_serving(False)
        await self.server.stop(self.options.drain_grace_s if grace_s is None else grace_s)
        await self.stop_health()
        self._stopped.set()

    async def stop_health(self) -> None:
        if self.health_server is not None:
            await self.health_server.stop(0)
            self.health_server = None

    async def wait_for_signal(
        self, stop: asyncio.Event | None = None, drain: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        """Serve until SIGTERM or SIGINT (or `stop` from `stop_signal()`), then drain (with
        `drain` where the service drains more than its server)."""
        stop = stop or stop_signal()
        waiter = asyncio.ensure_future(self.server.wait_for_termination())
        signalled = asyncio.ensure_future(stop.wait())
        await asyncio.wait({waiter, signalled}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            log.info("signal received: draining %s", self.address)
            await (drain or self.drain)()
        waiter.cancel()
        signalled.cancel()


class OnServer:
    """The address and port of a running service, from its `server` (a RunningServer)."""

    server: RunningServer

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def port(self) -> int:
        return self.server.port


class _Registering:
    """The server as `add_*_to_server` sees it: every handler is added, but only the methods
    named in `registered` are registered with gRPC's core (ServerOptions.registered_methods)."""

    def __init__(self, server: grpc.aio.Server, registered: frozenset[str]) -> None:
        self._server = server
        self._registered = registered

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        kept = {m: h for m, h in handlers.items() if f"/{service}/{m}" in self._registered}
        if kept:
            self._server.add_registered_method_handlers(service, kept)


async def start_server(
    registrations: Sequence[Registration],
    options: ServerOptions,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    serving: bool = True,
) -> RunningServer:
    """Start a grpc.aio server with health, reflection, limits and error mapping.

    Health is SERVING from the start unless `serving` is False: then NOT_SERVING until the
    caller's `set_serving(True)` (an executor, once its models are warm).

    When a tracer provider is installed (`switchyard.telemetry.setup`), every RPC of the
    registered services is also a span parented on the caller's trace context, made where
    its servicer method is wrapped (`map_errors`), not by an interceptor; health checks and
    reflection are not traced. Without one nothing extra is wrapped.
    """
    # With map_errors_in_servicers, servicers map their own errors (ErrorMappedServicer) and
    # the interceptor stays only to map errors that caller-supplied interceptors raise.
    # A guard wraps each servicer's methods (as map_errors_in_servicers does), so it runs
    # where the method runs and the caller it admits is in authz.CALLER there; so does
    # tracing, which has no interceptor (telemetry.traced).
    guard = options.guard
    in_servicers = options.map_errors_in_servicers or guard is not None or telemetry.enabled()
    mapping = [] if in_servicers and not interceptors else [ErrorInterceptor()]
    server = grpc.aio.server(
        interceptors=[*interceptors, *mapping] or None, options=[*options.channel_options(), NO_PORT_SHARING]
    )
    names = []
    hot = options.registered_methods
    target = server if hot is None else _Registering(server, hot)
    for add, servicer, name in registrations:
        add(ErrorMappedServicer(servicer, name, guard) if in_servicers else servicer, target)
        names.append(name)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, target)
    reflection.enable_server_reflection(  # the real server: it checks for an aio one
        [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server, pool=_pool.POOL
    )
    security = tls.resolve(options.security)
    port = _bind(server, options, security, names)
    await server.start()
    running = RunningServer(server, port, health_servicer, names, options, security)
    await _start_health_port(running)
    await running.set_serving(serving)
    return running


def _bind(server: grpc.aio.Server, options: ServerOptions, security: tls.Security, names: list[str]) -> int:
    """The port, bound as the service's security says: the public port on its own TLS (or
    plaintext), every other one on mutual TLS, or plaintext where security is off."""
    address = f"{options.host}:{options.port}"
    if options.public:
        if options.public_tls is not None:
            cert, key = options.public_tls
            port = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
        else:
            port = server.add_insecure_port(address)
    elif security.insecure:
        log.warning("%s on %s: %s", ", ".join(names), address, security.describe())
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, tls.server_credentials(security))
    if port == 0:
        raise OSError(f"could not bind {options.host}:{options.port}")
    return int(port)


async def _start_health_port(running: RunningServer) -> None:
    """The plaintext health-only port (ServerOptions.health_port, else $SWITCHYARD_HEALTH_PORT)
    for probes that hold no certificate; none when neither is set."""
    options = running.options
    health_port = options.health_port
    if health_port is None and os.environ.get(HEALTH_PORT_ENV, "").strip():
        try:
            health_port = int(os.environ[HEALTH_PORT_ENV])
        except ValueError:
            raise InvalidArgument(
                f"{HEALTH_PORT_ENV}={os.environ[HEALTH_PORT_ENV]!r}: give a port number"
            ) from None
    if health_port is None or health_port < 0:
        return
    probe = grpc.aio.server(options=[NO_PORT_SHARING])
    health_pb2_grpc.add_HealthServicer_to_server(running.health, probe)
    running.health_port = probe.add_insecure_port(f"{options.host}:{health_port}")
    if running.health_port == 0:
        await running.server.stop(0)
        raise OSError(f"could not bind the health port {options.host}:{health_port}")
    await probe.start()
    running.health_server = probe
