"""A small asyncio HTTP/1.1 server on h11 (the protocol state machine, no framework).

It reads each request of a keep-alive connection whole (its body bounded by `max_body`: over
it, 413) and hands it to `handle` with an `HttpExchange` to answer on: a JSON response, or a
stream of server-sent events. A malformed request is answered 400 and the connection closed.
Slow clients are cut off: a request's head (and a keep-alive connection's wait for the next
one) must arrive within `header_timeout_s`, its body within `body_timeout_s`, else 408 and the
connection is closed (slowloris). At most `max_connections` are open at once; one more is
answered 503 and closed.
`openai_api` serves OpenAI's API on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import tempfile
from pathlib import Path
from typing import Any

import h11

log = logging.getLogger(__name__)


def server_context(cert: bytes, key: bytes) -> ssl.SSLContext:
    """A TLS server context from PEM bytes (ssl loads only files: they live in a 0700 folder of
    their own for the moment it reads them)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    with tempfile.TemporaryDirectory() as folder:
        paths = [Path(folder) / "tls.crt", Path(folder) / "tls.key"]
        for path, data in zip(paths, (cert, key), strict=True):
            path.touch(0o600)
            path.write_bytes(data)
        context.load_cert_chain(paths[0], paths[1])
    return context


class HttpError(Exception):
    def __init__(self, status: int, message: str, code: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


class HttpExchange:
    """One request's answer on a connection."""

    def __init__(self, conn: h11.Connection, writer: asyncio.StreamWriter) -> None:
        self.conn = conn
        self.writer = writer

    @property
    def started(self) -> bool:
        """Whether the response's head went out (an error can then only go into its body)."""
        return self.conn.our_state is not h11.SEND_RESPONSE

    @property
    def streaming(self) -> bool:
        return self.conn.our_state is h11.SEND_BODY

    async def send(self, *events: Any) -> None:
        for event in events:
            data = self.conn.send(event)
            if data:
                self.writer.write(data)
        await self.writer.drain()

    async def json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        headers = [("content-type", "application/json"), ("content-length", str(len(data)))]
        await self.send(
            h11.Response(status_code=status, headers=headers), h11.Data(data=data), h11.EndOfMessage()
        )

    async def start_events(self) -> None:
        headers = [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
        await self.send(h11.Response(status_code=200, headers=headers))

    async def event(self, data: Any, end: bool = False) -> None:
        """One server-sent event (`data: <json>`, or the text as is); `end`: the last."""
        text = data if isinstance(data, str) else json.dumps(data)
        events: list[Any] = [h11.Data(data=b"data: " + text.encode() + b"\n\n")]
        if end:
            events.append(h11.EndOfMessage())
        await self.send(*events)


MAX_CONNECTIONS = 1024
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0


class Http1Server:
    """Serves HTTP/1.1 connections; subclasses answer requests in `handle`."""

    def __init__(
        self,
        max_body: int,
        max_connections: int = MAX_CONNECTIONS,
        header_timeout_s: float = HEADER_TIMEOUT_S,
        body_timeout_s: float = BODY_TIMEOUT_S,
    ) -> None:
        self.max_body = max_body
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.port = 0

    async def handle(self, exchange: HttpExchange, request: h11.Request, body: bytes, peer: str) -> None:
        raise NotImplementedError

    def error_body(self, error: HttpError) -> Any:
        """The JSON body of an error answer."""
        return {"error": error.message}

    async def start(self, host: str, port: int, tls: tuple[bytes, bytes] | None = None) -> int:
        """Listens on `port`; with `tls` (certificate chain PEM, private key PEM), HTTPS only."""
        context = server_context(*tls) if tls is not None else None
        self._server = await asyncio.start_server(self._serve, host, port, ssl=context)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        exchange = HttpExchange(conn, writer)
        peer = "ipv4:{}:{}".format(*writer.get_extra_info("peername")[:2])
        try:
            if len(self._connections) > self.max_connections:
                raise HttpError(503, f"the router has {self.max_connections} connections open; retry later")
            while isinstance(
                request := await self._timed(_next(conn, reader), self.header_timeout_s), h11.Request
            ):
                body = await self._timed(self._body(conn, reader), self.body_timeout_s)
                if body is None:
                    return
                await self.handle(exchange, request, body, peer)
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    break
                conn.start_next_cycle()
        except HttpError as exc:
            with contextlib.suppress(Exception):
                await exchange.json(exc.status, self.error_body(exc))
        except (h11.RemoteProtocolError, h11.LocalProtocolError) as exc:
            with contextlib.suppress(Exception):
                await exchange.json(400, self.error_body(HttpError(400, f"bad HTTP request: {exc}")))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._connections.discard(task)
            writer.close()

    @staticmethod
    async def _timed(step: Any, timeout_s: float) -> Any:
        """`step` within `timeout_s`, else 408 (the client is too slow; the connection closes)."""
        try:
            return await asyncio.wait_for(step, timeout_s)
        except TimeoutError:
            raise HttpError(408, f"the request did not arrive within {timeout_s:g} s") from None

    async def _body(self, conn: h11.Connection, reader: asyncio.StreamReader) -> bytes | None:
        """The request's body, whole; None if the connection closed before its end."""
        body = bytearray()
        while not isinstance(part := await _next(conn, reader), h11.EndOfMessage):
            if isinstance(part, h11.Data):
                body += part.data
                if len(body) > self.max_body:
                    raise HttpError(413, f"the request body is over {self.max_body} bytes")
            elif isinstance(part, h11.ConnectionClosed):
                return None
        return bytes(body)


async def _next(conn: h11.Connection, reader: asyncio.StreamReader) -> Any:
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        data = await reader.read(65536)
        conn.receive_data(data)  # b"" marks the end
