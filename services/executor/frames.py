"""The executor's end of framed inference (switchyard.frames): requests answered on its event loop.

Each REQUEST frame becomes a task running `InferenceServicer.answer`, the code that answers
ModelStreamInfer, and its REPLY goes back when done, in any order. CANCEL cancels that task
(the batcher drops the request if it is still queued), and so does the connection closing.
A malformed request gets INVALID_ARGUMENT and an oversized one RESOURCE_EXHAUSTED in its
reply; the connection goes on. A frame of a kind the executor does not take closes the
connection: the peer does not speak this protocol.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Protocol, cast

from google.protobuf.message import DecodeError

from switchyard import frames
from switchyard.gen.inference import grpc_service_pb2 as pb

log = logging.getLogger(__name__)


class Answerer(Protocol):
    """What answers a request: `InferenceServicer.answer`, the code behind ModelStreamInfer."""

    async def answer(
        self, request: pb.ModelInferRequest, time_remaining: float | None, /
    ) -> pb.ModelStreamInferResponse: ...


def _error_reply(status: str, why: str) -> bytes:
    return pb.ModelStreamInferResponse(error_message=f"{status}: {why}").SerializeToString()


class _Connection(asyncio.Protocol):
    def __init__(self, server: FrameServer) -> None:
        self._server = server
        self._reader = frames.FrameReader(server.limit)
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        for number, kind, payload in self._reader.feed(data):
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
                self._reply(number, _error_reply("RESOURCE_EXHAUSTED", f"request exceeds {limit} bytes"))
            else:
                task = asyncio.create_task(self._answer(number, payload))
                self._tasks[number] = task
                task.add_done_callback(functools.partial(self._done, number))

    def _done(self, number: int, task: asyncio.Task[None]) -> None:
        if self._tasks.get(number) is task:
            del self._tasks[number]

    async def _answer(self, number: int, payload: bytes) -> None:
        try:
            request = pb.ModelInferRequest.FromString(payload)
        except DecodeError as exc:
            self._reply(number, _error_reply("INVALID_ARGUMENT", f"not a ModelInferRequest: {exc}"))
            return
        reply = await self._server.servicer.answer(request, None)
        self._reply(number, reply.SerializeToString())

    def _reply(self, number: int, data: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.writelines((frames.header(len(data), number, frames.REPLY), data))

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        for task in self._tasks.values():
            task.cancel()  # nobody is left to answer
        self._tasks.clear()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class FrameServer:
    """Listens for frame connections next to the executor's gRPC port."""

    def __init__(self, servicer: Answerer, limit: int) -> None:
        self.servicer = servicer
        self.limit = limit
        self.connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port)
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
