"""Channels to the executors, the raw-bytes inference call, and health watching.

Inference goes over long-lived `ModelStreamInfer` streams, one request at a time on each: a
stream is taken from the deployment's idle set (or opened), the request written, the answer
read, and the stream put back. A message on an open stream costs about half a unary call's
round trip here (no per-call stream set-up, headers or trailers), which is most of what a
Python hop adds. What a unary call carried per call travels in request parameters instead:
the remaining deadline as Triton's `timeout` (microseconds; the executor drops the request
from its queue when it passes, and the router cancels the stream then too) and the trace
context. A stream whose request timed out or whose caller went away is cancelled, never
reused (its late answer would belong to nobody); the executor then drops the queued work.
An executor's error comes back in `error_message` as "STATUS: why" and keeps its status
(switchyard.inband_status reads it into an `UpstreamError`).

Each deployment gets one channel with short reconnect back-off (so a restarted executor is
found again within a second or two) and a watcher task that asks `grpc.health.v1` every
`health_interval_s`: a failing executor is ejected with a cooldown that doubles per
consecutive ejection, and re-admitted by the first passing probe after the cooldown. A
call that meets UNAVAILABLE ejects its deployment at once (passive health). The watcher also
asks ExecutorControl.GetLoad, so least-loaded routing has fresh numbers for deployments
that have not answered a request within the interval.

Where the executor offers framed inference (switchyard.frames: its Describe names the port)
and `executor_transport` is "frames", requests go over one frame connection per deployment
instead: the same messages, several times cheaper per hop. The watcher opens it after a
passing probe and opens it again after it breaks (a restarted executor has a new port);
until then, or when the executor offers none, requests take the streams. An executor that
offers none, or whose port does not connect, is asked again after FRAMES_RETRY_S or once it
has been ejected, not at every probe. A broken connection fails its requests with UNAVAILABLE,
as a broken stream does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.router import wire
from services.router.config import Deployment, Settings
from services.router.policies import DeploymentState
from switchyard import frames, inband_status, net, oip_params, telemetry, tls
from switchyard.errors import Status, UpstreamError
from switchyard.gen.inference import grpc_service_pb2 as pb
from switchyard.gen.switchyard.v1 import executor_pb2, executor_pb2_grpc
from switchyard.grpcio import status_of

log = logging.getLogger(__name__)

STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"
FRAMES_RETRY_S = 30.0  # a deployment offering no frames, or whose port failed, is asked again after this
MAX_IDLE_STREAMS = 64  # per deployment; more concurrent requests open more, closed when idle
_STREAM_FIELDS = frozenset((wire.STREAM_ERROR, wire.STREAM_RESPONSE))
# A stream that ends with one of these was broken under the request (the executor killed or
# stopped, the connection lost: grpc reports "Internal error from Core" for a write on a dead
# connection): UNAVAILABLE, so the router ejects the deployment and retries elsewhere.
_BROKEN = frozenset((grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN))
_EXPIRED = "deadline exceeded waiting for the executor"
_CLOSED = "the executor closed the stream"


def _stream_broke(exc: grpc.aio.AioRpcError) -> UpstreamError:
    """The executor's status for a stream call that ended with `exc`: a broken stream is
    UNAVAILABLE (the executor answers its own errors in-band, never by ending the stream)."""
    code, details = exc.code(), exc.details() or exc.code().name
    if code in _BROKEN:
        return UpstreamError(Status.UNAVAILABLE, f"the stream to the executor broke: {details}")
    return UpstreamError(status_of(code), details)


CHANNEL_OPTIONS: list[tuple[str, int]] = [
    *net.CHANNEL_OPTIONS,
    # Find a restarted peer quickly instead of after the default back-off (up to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class ExecutorPool:
    def __init__(
        self, deployments: Sequence[Deployment], settings: Settings, security: tls.Security | None = None
    ) -> None:
        self._settings = settings
        self.security = tls.resolve(security)
        self._frames_tls = tls.client_ssl_context(self.security)
        self.states: dict[str, DeploymentState] = {d.name: DeploymentState(d) for d in deployments}
        self.channels: dict[str, grpc.aio.Channel] = {
            d.name: tls.aio_channel(d.address, CHANNEL_OPTIONS, self.security) for d in deployments
        }
        # Identity (de)serialisers: request and response stay bytes end to end.
        self._open_stream: dict[str, Any] = {
            name: ch.stream_stream(STREAM_METHOD) for name, ch in self.channels.items()
        }
        self._idle: dict[str, list[Any]] = {name: [] for name in self.channels}
        self._frames: dict[str, frames.FrameChannel] = {}
        self._frames_retry_at: dict[str, float] = {}  # after a failed connect, not before (monotonic)
        self._no_get_load: set[str] = set()  # executors that do not implement GetLoad
        self._tasks: list[asyncio.Task[None]] = []
        self._tracing = telemetry.enabled()  # set up before the router starts, as the CLI does

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
        for calls in self._idle.values():
            for call in calls:
                call.cancel()
            calls.clear()
        for connection in self._frames.values():
            connection.close()
        for channel in self.channels.values():
            await channel.close()

    def _open_frames(self, deployment: str) -> frames.FrameChannel | None:
        channel = self._frames.get(deployment)
        return channel if channel is not None and channel.is_open else None

    def transport(self, deployment: str) -> str:
        """How the next request to `deployment` travels: "frames" or "grpc"."""
        return "grpc" if self._open_frames(deployment) is None else "frames"

    async def infer(self, deployment: str, parts: Sequence[bytes], timeout_s: float) -> bytes:
        """One ModelInferRequest (the concatenated `parts`) to the deployment, over its frame
        connection or one of its streams; returns the serialized ModelInferResponse or raises
        UpstreamError."""
        params: dict[str, wire.Param] = {
            oip_params.TIMEOUT: max(1, int(timeout_s * 1e6)),
            oip_params.UNARY: True,  # one answer, even from a decoupled (generative) model
            oip_params.STATS: True,  # load and device time: the router routes and meters by them
        }
        if self._tracing:
            params.update(telemetry.trace_parameters())
        message = (*parts, wire.parameters_field(params))  # later map entries win
        channel = self._open_frames(deployment)
        if channel is not None:
            try:
                reply = await channel.request(message, timeout_s)
            except frames.FrameTimeout:
                raise UpstreamError(Status.DEADLINE_EXCEEDED, _EXPIRED) from None
            except frames.FrameClosed as exc:
                broke = f"the connection to the executor broke: {exc}"
                raise UpstreamError(Status.UNAVAILABLE, broke) from None
        else:
            reply = await self._stream_infer(deployment, b"".join(message), timeout_s)
        fields = wire.scan_fields(reply, _STREAM_FIELDS)
        if wire.STREAM_ERROR in fields:
            start, stop = fields[wire.STREAM_ERROR][-1]
            raise inband_status.parse(reply[start:stop].decode(errors="replace"))
        start, stop = fields[wire.STREAM_RESPONSE][-1] if wire.STREAM_RESPONSE in fields else (0, 0)
        return reply[start:stop]

    async def _stream_infer(self, deployment: str, message: bytes, timeout_s: float) -> bytes:
        """One message on one of the deployment's streams; returns the ModelStreamInferResponse."""
        idle = self._idle[deployment]
        call = None
        while idle and call is None:
            call = idle.pop()
            if call.done():  # ended while idle (executor restarted or drained)
                call = None
        if call is None:
            call = self._open_stream[deployment]()
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            call.cancel()

        timer = asyncio.get_running_loop().call_later(timeout_s, expire)
        try:
            await call.write(message)
            answer = await call.read()
        except (asyncio.CancelledError, grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            call.cancel()  # it owes an answer that would belong to nobody: never reuse it
            if expired:
                raise UpstreamError(Status.DEADLINE_EXCEEDED, _EXPIRED) from None
            if isinstance(exc, asyncio.CancelledError):
                raise  # the caller went away
            if isinstance(exc, grpc.aio.AioRpcError):
                raise _stream_broke(exc) from None
            # InvalidStateError: the stream ended between the check above and the write
            raise UpstreamError(Status.UNAVAILABLE, _CLOSED) from None
        finally:
            timer.cancel()
        if answer is grpc.aio.EOF:
            raise UpstreamError(Status.UNAVAILABLE, _CLOSED)
        if len(idle) < MAX_IDLE_STREAMS:
            idle.append(call)
        else:
            await call.done_writing()
        reply: bytes = answer
        return reply

    async def stream(
        self, deployment: str, parts: Sequence[bytes], timeout_s: float
    ) -> AsyncIterator[pb.ModelInferResponse]:
        """One request on a ModelStreamInfer call of its own: each response until the one flagged
        `triton_final_response` (a decoupled model's many), or the only one of another model.
        Leaving early cancels the call, and with it the executor's work (its slot is freed)."""
        params: dict[str, wire.Param] = {oip_params.TIMEOUT: max(1, int(timeout_s * 1e6))}
        if self._tracing:
            params.update(telemetry.trace_parameters())
        call = self._open_stream[deployment]()
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            call.cancel()

        timer = asyncio.get_running_loop().call_later(timeout_s, expire)
        answered = False
        try:
            try:
                await call.write(b"".join((*parts, wire.parameters_field(params))))
                await call.done_writing()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                raise UpstreamError(Status.UNAVAILABLE, _CLOSED) from None
            while True:
                try:
                    answer = await call.read()
                except grpc.aio.AioRpcError as exc:
                    if expired:
                        raise UpstreamError(Status.DEADLINE_EXCEEDED, _EXPIRED) from None
                    raise _stream_broke(exc) from None
                if answer is grpc.aio.EOF:
                    if not answered:
                        raise UpstreamError(Status.UNAVAILABLE, _CLOSED)
                    return
                message = pb.ModelStreamInferResponse.FromString(answer)
                if message.error_message:
                    raise inband_status.parse(message.error_message)
                answered = True
                response = message.infer_response
                yield response
                final = response.parameters.get(oip_params.FINAL)
                if final is None or final.bool_param:
                    return
        finally:
            timer.cancel()
            call.cancel()  # done (a no-op) or given up on: nothing more is owed to anyone

    def eject(self, deployment: str, reason: str) -> None:
        state = self.states[deployment]
        was_admitted = state.admitted()
        state.eject(reason, self._settings)
        self._frames_retry_at.pop(deployment, None)
        if was_admitted:
            log.warning("ejected deployment %s: %s", deployment, reason)

    async def _probe(self, name: str) -> str:
        """'' when healthy, else why not."""
        channel = self.channels[name]
        timeout = self._settings.health_timeout_s
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
        except grpc.aio.AioRpcError as exc:
            return f"health check failed: {exc.code().name}"
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return f"health status {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
        return ""

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

    async def _connect_frames(self, name: str) -> None:
        """Opens the deployment's frame connection if it offers one and none is open."""
        if self._open_frames(name) is not None or time.monotonic() < self._frames_retry_at.get(name, 0.0):
            return
        self._frames.pop(name, None)
        host = frames_host(self.states[name].deployment.address)
        if host is None:
            return  # an address form (unix:, ipv4:, ...) frames do not reach: streams only
        timeout = self._settings.health_timeout_s
        try:
            described = await executor_pb2_grpc.ExecutorControlStub(self.channels[name]).Describe(
                executor_pb2.DescribeRequest(), timeout=timeout
            )
            if not described.frames_port:
                # frames off, or an older executor: no Describe per interval, but again after
                # FRAMES_RETRY_S or an ejection (what comes back may offer them)
                self._frames_retry_at[name] = time.monotonic() + FRAMES_RETRY_S
                return
            port = described.frames_port
            channel = await frames.FrameChannel.connect(
                host, port, net.MAX_MESSAGE_BYTES, timeout, self._frames_tls
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
            self._frames_retry_at[name] = time.monotonic() + FRAMES_RETRY_S
            return
        self._frames[name] = channel
        log.info("deployment %s: inference over frames on %s:%d", name, host, port)

    async def _check(self, name: str) -> None:
        problem = await self._probe(name)
        if problem:
            self.eject(name, problem)
            return
        if self.states[name].probe_succeeded():
            log.info("re-admitted deployment %s after its cooldown", name)
        if self._settings.executor_transport == "frames":
            await self._connect_frames(name)
        await self._refresh_load(name)

    async def _watch(self, name: str) -> None:
        while True:
            await asyncio.sleep(self._settings.health_interval_s)
            await self._check(name)


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
