"""The framed `ExecutorTransport` half: inference on one frame connection per deployment.

Where the executor offers framed inference (services.frames: its Describe names the port)
and `executor_transport` is "frames", requests go over one frame connection per deployment
instead of the gRPC streams: the same messages, several times cheaper per hop. The pool's
watcher opens it after a passing probe and opens it again after it breaks (a restarted executor
has a new port); until then, or when the executor offers none, requests take the streams. An
executor that offers none, or whose port does not connect, is asked again after FRAMES_RETRY_S
or once it has been ejected, not at every probe. A broken connection fails its requests with
UNAVAILABLE, as a broken stream does. Frames carry one answer per request: generations
(many answers) always take a stream.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Mapping, Sequence

import grpc

from services import frames
from services.router.executor_transport import request_parameters, unwrap_answer
from switchyard import telemetry, tls
from switchyard.errors import Status, UpstreamError
from switchyard.gen.switchyard.v1 import executor_pb2, executor_pb2_grpc

log = logging.getLogger(__name__)

FRAMES_RETRY_S = 30.0  # a deployment offering no frames, or whose port failed, is asked again after this


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
