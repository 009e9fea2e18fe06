"""The executors the router sends to: their channels, health watching, and the transport choice.

`ExecutorPool` is the router's `ExecutorTransport` (`executor_transport`): inference goes over
a deployment's frame connection where one is open (`FrameTransport`, here) and over its pooled
ModelStreamInfer streams otherwise (`executor_streams`); generations and the small metadata
RPCs always take gRPC. An executor's error comes back in-band as "STATUS: why" and keeps its
status (services.inband_status).

Frame connections (services.frames) follow the pool's health watching, so they are kept here:
where the executor offers framed inference (its Describe names the port) and
`executor_transport` is "frames", requests go over one frame connection per deployment instead
of the gRPC streams: the same messages, several times cheaper per hop. The watcher opens it
after a passing probe and opens it again after it breaks (a restarted executor has a new
port); until then, or when the executor offers none, requests take the streams. An executor
that offers none, or whose port does not connect, is asked again after FRAMES_RETRY_S or once
it has been ejected, not at every probe. A broken connection fails its requests with
UNAVAILABLE, as a broken stream does. Frames carry one answer per request: generations (many
answers) always take a stream.

Each deployment gets one channel with short reconnect back-off (so a restarted executor is
found again within a second or two) and a watcher task that asks `grpc.health.v1` every
`health_interval_s`: an executor that answers with a failure (UNAVAILABLE: refused or
unreachable; a status other than SERVING) is ejected at once, one whose probes time out only
after `health_timeouts_to_eject` in a row (a long XLA compile or a big batch makes a live
executor answer late; a passing probe resets the count), or once it has answered neither a
probe nor a request for `eject_unanswered_s` (default 2 s): a blackholed host drops every
packet and sends no RST, so nothing but time says it is gone. Each probe's deadline is cut to
end at that bound, and a silent ejection also aborts the deployment's frame connection, so
the requests waiting on it fail with UNAVAILABLE and the forwarder sends them elsewhere;
gRPC streams find the same through keepalive pings (KEEPALIVE). The cooldown doubles per
consecutive ejection; the first passing probe after it re-admits. A call that meets
UNAVAILABLE ejects its deployment at once (passive health, `forwarder`). The
watcher also asks ExecutorControl.GetLoad, so least-loaded routing has fresh numbers for
deployments that have not answered a request within the interval, and (re)opens the frame
connection after a passing probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import AsyncIterator, Mapping, Sequence

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services import frames
from services.router.executor_streams import GrpcStreamTransport
from services.router.executor_transport import Reply, request_parameters, unwrap_answer
from services.router.policies import DeploymentState
from services.router.router_config import Deployment, Settings
from switchyard import net, telemetry, tls
from switchyard.errors import Status, UpstreamError
from switchyard.gen.inference import grpc_service_pb2 as pb
from switchyard.gen.switchyard.v1 import executor_pb2, executor_pb2_grpc

log = logging.getLogger(__name__)

FRAMES_RETRY_S = 30.0  # a deployment offering no frames, or whose port failed, is asked again after this

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    *net.CHANNEL_OPTIONS,
    # Find a restarted peer quickly instead of after the default back-off (up to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    *net.KEEPALIVE_OPTIONS,
]


class ExecutorPool:
    def __init__(
        self, deployments: Sequence[Deployment], settings: Settings, security: tls.Security | None = None
    ) -> None:
        self._settings = settings
        self.security = tls.resolve(security)
        self.states: dict[str, DeploymentState] = {d.name: DeploymentState(d) for d in deployments}
        self.channels: dict[str, grpc.aio.Channel] = {
            d.name: tls.aio_channel(d.address, CHANNEL_OPTIONS, self.security, expect=tls.EXECUTOR)
            for d in deployments
        }
        self._streams = GrpcStreamTransport(self.channels)
        addresses = {d.name: d.address for d in deployments}
        frames_tls = tls.client_ssl_context(self.security)
        self._frames = FrameTransport(self.channels, addresses, net.MAX_MESSAGE_BYTES, frames_tls)
        self._no_get_load: set[str] = set()  # executors that do not implement GetLoad
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """One round of health checks (and frame connections) on every deployment, at most
        `health_timeout_s` or two, so the router starts knowing which executors serve and
        how to reach them; then a watcher per deployment."""
        await asyncio.gather(*(self._check(name) for name in self.states))
        for name in self.states:
            self._tasks.append(asyncio.create_task(self._watch(name), name=f"health-{name}"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._streams.close()
        self._frames.close()
        for channel in self.channels.values():
            await channel.close()

    def transport(self, deployment: str) -> str:
        """How the next request to `deployment` travels: "frames" or "grpc"."""
        return "frames" if self._frames.is_open(deployment) else "grpc"

    # ---- ExecutorTransport --------------------------------------------------------------------
    async def send_tensor(self, deployment: str, parts: Sequence[bytes], timeout_s: float) -> bytes:
        """One ModelInferRequest (the concatenated `parts`) to the deployment, over its frame
        connection or one of its streams; returns the serialized ModelInferResponse or raises
        UpstreamError."""
        if self._frames.is_open(deployment):
            return await self._frames.send_framed(deployment, parts, timeout_s)
        return await self._streams.send_streamed(deployment, parts, timeout_s)

    def stream(
        self, deployment: str, parts: Sequence[bytes], timeout_s: float
    ) -> AsyncIterator[pb.ModelInferResponse]:
        return self._streams.stream(deployment, parts, timeout_s)

    async def call(
        self, deployment: str, method: str, request: Message, reply_type: type[Reply], timeout_s: float
    ) -> Reply:
        return await self._streams.call(deployment, method, request, reply_type, timeout_s)

    # ---- health -------------------------------------------------------------------------------
    def eject(self, deployment: str, reason: str, silent: bool = False) -> None:
        """`silent`: it stopped answering; its frame connection is aborted, not left to wait."""
        state = self.states[deployment]
        was_admitted = state.admitted()
        state.eject(reason, self._settings)
        self._frames.retry_soon(deployment)
        if silent:
            self._frames.abort(deployment, reason)
        if was_admitted:
            log.warning("ejected deployment %s: %s", deployment, reason)

    def _probe_timeout(self, name: str) -> float:
        """health_timeout_s, cut so a probe of a silent admitted deployment times out when it
        has been silent for eject_unanswered_s (the bound holds whatever the probe phase)."""
        state, settings = self.states[name], self._settings
        if not state.admitted() or not state.answered_at:
            return settings.health_timeout_s
        left = settings.eject_unanswered_s - state.silent_for(time.monotonic())
        return max(0.05, min(settings.health_timeout_s, left))

    async def _probe(self, name: str) -> tuple[str, bool]:
        """('', False) when healthy, else why not and whether it merely timed out."""
        channel = self.channels[name]
        timeout = self._probe_timeout(name)
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
        except grpc.aio.AioRpcError as exc:
            timed_out = exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            return f"health check failed: {exc.code().name}", timed_out
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return f"health status {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}", False
        return "", False

    def _probe_failed(self, name: str, problem: str, timed_out: bool) -> None:
        """Ejects on a definite failure at once, on timeouts once enough come in a row."""
        state = self.states[name]
        if not timed_out:
            self.eject(name, problem)
            return
        silent = state.silent_for(time.monotonic())
        if state.probe_timed_out(self._settings):
            self.eject(name, f"{problem} ({state.probe_timeouts} probes in a row)", silent=True)
        elif silent >= self._settings.eject_unanswered_s:
            self.eject(name, f"{problem}: no answer for {silent:.1f} s", silent=True)
        else:
            limit = self._settings.health_timeouts_to_eject
            log.info("deployment %s: %s, %d of %d in a row", name, problem, state.probe_timeouts, limit)

    async def _refresh_load(self, name: str) -> None:
        fresh = time.monotonic() - self.states[name].load_at < self._settings.health_interval_s
        if name in self._no_get_load or fresh:
            return  # its answers reported the load within the interval: no RPC on the serving loop
        try:
            load = await executor_pb2_grpc.ExecutorControlStub(self.channels[name]).GetLoad(
                executor_pb2.GetLoadRequest(), timeout=self._settings.health_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._no_get_load.add(name)
            return
        self.states[name].report_load(load.in_flight, load.queue_depth)

    async def _check(self, name: str) -> None:
        problem, timed_out = await self._probe(name)
        if problem:
            self._probe_failed(name, problem, timed_out)
            return
        if self.states[name].probe_succeeded():
            log.info("re-admitted deployment %s after its cooldown", name)
        if self._settings.executor_transport == "frames":
            await self._frames.connect(name, self._settings.health_timeout_s)
        await self._refresh_load(name)

    async def _watch(self, name: str) -> None:
        while True:
            await asyncio.sleep(self._settings.health_interval_s)
            await self._check(name)


class FrameTransport:
    """The open frame connections, and opening them where the executor offers one."""

    def __init__(
        self,
        channels: Mapping[str, grpc.aio.Channel],
        addresses: Mapping[str, str],
        limit: int,
        tls_context: ssl.SSLContext | None,
    ) -> None:
        self._channels = channels  # the executors' gRPC channels, to ask Describe for the port
        self._addresses = addresses
        self._limit = limit
        self._tls = tls_context
        self._open: dict[str, frames.FrameChannel] = {}
        self._retry_at: dict[str, float] = {}  # after a failed connect, not before (monotonic)
        self._tracing = telemetry.enabled()  # set up before the router starts, as the CLI does

    def is_open(self, deployment: str) -> bool:
        channel = self._open.get(deployment)
        return channel is not None and channel.is_open

    def close(self) -> None:
        for connection in self._open.values():
            connection.close()

    def retry_soon(self, deployment: str) -> None:
        """Asks again at the next passing probe (after an ejection: what comes back may differ)."""
        self._retry_at.pop(deployment, None)

    def abort(self, deployment: str, reason: str) -> None:
        """Drops the connection at once (no flush to a host that stopped answering): its
        waiting requests fail with UNAVAILABLE and may be tried elsewhere."""
        connection = self._open.pop(deployment, None)
        if connection is not None:
            connection.abort(reason)

    async def send_framed(self, deployment: str, parts: Sequence[bytes], timeout_s: float) -> bytes:
        message = (*parts, request_parameters(timeout_s, True, self._tracing))
        try:
            reply = await self._open[deployment].request(message, timeout_s)
        except frames.FrameTimeout:
            raise UpstreamError(
                Status.DEADLINE_EXCEEDED, "deadline exceeded waiting for the executor"
            ) from None
        except frames.FrameClosed as exc:
            broke = f"the connection to the executor broke: {exc}"
            raise UpstreamError(Status.UNAVAILABLE, broke) from None
        return unwrap_answer(reply)

    async def connect(self, name: str, timeout_s: float) -> None:
        """Opens the deployment's frame connection if it offers one and none is open."""
        if self.is_open(name) or time.monotonic() < self._retry_at.get(name, 0.0):
            return
        self._open.pop(name, None)
        host = frames_host(self._addresses[name])
        if host is None:
            return  # an address form (unix:, ipv4:, ...) frames do not reach: streams only
        try:
            described = await executor_pb2_grpc.ExecutorControlStub(self._channels[name]).Describe(
                executor_pb2.DescribeRequest(), timeout=timeout_s
            )
            if not described.frames_port:
                # frames off, or an older executor: no Describe per interval, but again after
                # FRAMES_RETRY_S or an ejection (what comes back may offer them)
                self._retry_at[name] = time.monotonic() + FRAMES_RETRY_S
                return
            port = described.frames_port
            channel = await frames.FrameChannel.connect(
                host, port, self._limit, timeout_s, self._tls, tls.service_name(tls.EXECUTOR)
            )
            if not channel.is_open:
                raise OSError(channel.closed_because or "closed as it opened")
        except (grpc.aio.AioRpcError, OSError, TimeoutError) as exc:
            # health passed, so the port is what fails (a firewall, another network): streams
            # serve meanwhile, and the watcher does not wait on it every interval
            log.warning(
                "deployment %s: no frame connection (%s); gRPC streams for %.0f s",
                name, exc, FRAMES_RETRY_S,
            )  # fmt: skip
            self._retry_at[name] = time.monotonic() + FRAMES_RETRY_S
            return
        self._open[name] = channel
        log.info("deployment %s: inference over frames on %s:%d", name, host, port)


def frames_host(address: str) -> str | None:
    """The host of a gRPC target "host:port" (or "dns:///host:port", "[v6]:port"), where the
    executor's frame port is; None for target forms that name no TCP host."""
    target = address.removeprefix("dns:///")
    if "://" in target or target.startswith(("unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")):
        return None
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.removeprefix("[").removesuffix("]")
