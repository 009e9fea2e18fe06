"""The executor's end of framed inference (services.frames): requests answered on its event loop.

An adapter over the data plane (`data_plane.py`), as the gRPC servicer is: each REQUEST frame
becomes a task running `DataPlane.answer`, the code that answers each request of a
ModelStreamInfer, and its REPLY goes back when done, in any order. CANCEL cancels that task
(the batcher drops the request if it is still queued), and so does the connection closing.
A malformed request gets INVALID_ARGUMENT and an oversized one RESOURCE_EXHAUSTED in its
reply; the connection goes on. A frame of a kind the executor does not take closes the
connection: the peer does not speak this protocol.

Flow control: with `max_in_flight` requests of a connection unanswered, the executor stops
reading it (requests already read wait, unstarted, for a slot), and it stops as well while
its replies are not being read (the transport's write buffer is over its high-water mark);
reading resumes when both clear. With TLS, a peer whose certificate names an identity the
executor does not serve inference to gets its first request answered PERMISSION_DENIED
(UNAUTHENTICATED without a switchyard identity), the refusal audited once for the connection,
and the connection closed.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import ssl
from collections.abc import Collection
from typing import Protocol, cast

from google.protobuf.message import DecodeError

from services import frames, inband_status
from switchyard import authz, tls
from switchyard.errors import Status
from switchyard.gen.inference import grpc_service_pb2 as pb

log = logging.getLogger(__name__)


class Answerer(Protocol):
    """What answers a request: `DataPlane.answer`, as on a ModelStreamInfer stream."""

    async def answer(
        self, request: pb.ModelInferRequest, time_remaining: float | None, /
    ) -> pb.ModelStreamInferResponse: ...


def _error_reply(status: Status, why: str) -> bytes:
    return inband_status.error_response(inband_status.encode(status, why)).SerializeToString()


class _Connection(asyncio.Protocol):
    def __init__(self, server: FrameServer) -> None:
        self._server = server
        self._reader = frames.FrameReader(server.limit)
        self._backlog: collections.deque[frames.Frame] = collections.deque()  # read, not yet taken
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._transport: asyncio.Transport | None = None
        self._tls = False
        self._refusal: tuple[Status, str] | None = None  # the status and why of a peer refused inference
        self._writing_paused = False
        self._reading_paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._tls = frames.is_tls(transport)
        self._server.connections.add(self)
        self._refusal = self._server.admit(self._transport)

    def pause_writing(self) -> None:
        self._writing_paused = True
        self._flow()

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._flow()

    def _flow(self) -> None:
        """Reads while requests in flight are under the bound and replies are being taken."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        hold = self._writing_paused or bool(self._backlog) or len(self._tasks) >= self._server.max_in_flight
        if hold and not self._reading_paused:
            transport.pause_reading()
            self._reading_paused = True
        elif not hold and self._reading_paused:
            transport.resume_reading()
            self._reading_paused = False

    def data_received(self, data: bytes) -> None:
        self._backlog.extend(self._reader.feed(data))
        self._serve()
        self._flow()

    def _serve(self) -> None:
        """Takes frames in order; a request waits here while the bound is reached (one read
        may carry many frames, and the bound holds for each of them)."""
        backlog = self._backlog
        while backlog:
            number, kind, payload = backlog[0]
            if (
                kind == frames.REQUEST
                and payload is not None
                and len(self._tasks) >= self._server.max_in_flight
            ):
                return
            backlog.popleft()
            if self._refusal is not None:
                if kind == frames.REQUEST:
                    self._reply(number, _error_reply(*self._refusal))
                self.close()
                return
            if kind == frames.CANCEL:
                task = self._tasks.pop(number, None)
                if task is not None:
                    task.cancel()
            elif kind != frames.REQUEST:
                log.warning("closing a frame connection: frame kind %d is not a request", kind)
                self.close()
                return
            elif payload is None:
                limit = self._server.limit
                self._reply(number, _error_reply(Status.RESOURCE_EXHAUSTED, f"request exceeds {limit} bytes"))
            else:
                task = asyncio.create_task(self._answer(number, payload))
                self._tasks[number] = task
                task.add_done_callback(functools.partial(self._done, number))

    def _done(self, number: int, task: asyncio.Task[None]) -> None:
        if self._tasks.get(number) is task:
            del self._tasks[number]
        self._serve()
        self._flow()

    async def _answer(self, number: int, payload: bytes) -> None:
        try:
            request = pb.ModelInferRequest.FromString(payload)
        except DecodeError as exc:
            self._reply(number, _error_reply(Status.INVALID_ARGUMENT, f"not a ModelInferRequest: {exc}"))
            return
        reply = await self._server.plane.answer(request, None)
        self._reply(number, reply.SerializeToString())

    def _reply(self, number: int, data: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            frames.send(self._transport, (frames.header(len(data), number, frames.REPLY), data), self._tls)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        self._backlog.clear()
        for task in self._tasks.values():
            task.cancel()  # nobody is left to answer
        self._tasks.clear()

    def close(self) -> None:
        self._backlog.clear()
        if self._transport is not None:
            self._transport.close()


class FrameServer:
    """Listens for frame connections next to the executor's gRPC port."""

    def __init__(
        self,
        plane: Answerer,
        limit: int,
        security: tls.Security | None = None,
        allowed: Collection[str] = (tls.ROUTER, tls.WORKER),
        audit: authz.AuditSink | None = None,
        max_in_flight: int = 256,
    ) -> None:
        self.plane = plane
        self.limit = limit
        self.security = tls.resolve(security)
        self.allowed = frozenset(allowed)
        self.audit = audit
        self.max_in_flight = max_in_flight
        self.connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    def admit(self, transport: asyncio.Transport) -> tuple[Status, str] | None:
        """None when the peer may send inference; else the status and why it gets (audited here, once)."""
        if self.security.insecure:
            return None
        identity = tls.transport_identity(transport)
        service = identity.removeprefix(tls.SPIFFE_PREFIX) if authz.known(identity) else ""
        if service in self.allowed:
            return None
        peer = transport.get_extra_info("peername")
        if service:
            status = Status.PERMISSION_DENIED
            why = (
                f"{identity} may not send inference over frames (allowed: {', '.join(sorted(self.allowed))})"
            )
        else:
            status = Status.UNAUTHENTICATED
            why = f"frames need a switchyard service certificate; got {authz.cap(identity, 80) or 'none'}"
        refusal = authz.Refusal(identity, str(peer), "frames", status.value, why)
        log.warning(
            "refused a frame connection from %s (%s): %s", peer, authz.cap(identity, 80) or "-", status.value
        )
        if self.audit is not None:
            self.audit(refusal)
        return status, why

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        context: ssl.SSLContext | None = tls.server_ssl_context(self.security)
        self._server = await loop.create_server(lambda: _Connection(self), host, port, ssl=context)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        """Stops listening and closes every connection (their unanswered requests are cancelled)."""
        if self._server is None:
            return
        self._server.close()
        for connection in list(self.connections):
            connection.close()
        await self._server.wait_closed()
        self._server = None
