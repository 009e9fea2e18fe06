"""Framed inference: OIP messages between the router and an executor on a plain TCP connection.

The router's hop to an executor is the one place a request crosses a process boundary twice
more than it would calling the executor directly, and in Python a gRPC message costs far more
than the bytes it moves: `benchmarks/bench_frames.py` measured a 1 KB request and its echo at
342 µs round trip on an open grpc.aio stream and 127 µs in frames, with the same protobuf
work on both sides (1 MiB: 3.9 ms and 2.5 ms), on this project's 2-core machines. So
inference between the two goes over frames when both offer them; everything else (health,
control, metadata) and every other caller stay on gRPC.

The messages are those of `ModelStreamInfer`, so the executor answers them with the same code:

    frame   = header payload
    header  = length:u32le number:u32le kind:u8     (length = payload bytes)
    REQUEST   router -> executor   payload: a serialized ModelInferRequest
    CANCEL    router -> executor   no payload: drop request `number` (timed out, caller gone)
    REPLY     executor -> router   payload: a serialized ModelStreamInferResponse, either
                                   `infer_response` or `error_message` "STATUS: why"

Requests are numbered by the sender and multiplexed: many may be in flight on one connection
and replies come in any order. The remaining deadline and the trace context travel as request
parameters (Triton's `timeout`, `traceparent`), as they do on the stream. A frame longer than
the receiver's limit is skipped, not buffered; the receiver answers it (or fails it) with
RESOURCE_EXHAUSTED and the connection stays usable.

Outside an explicitly insecure setup the connection is TLS with a certificate on both ends
(switchyard.tls), and the executor serves only the identities it accepts for inference. That
TLS is the event loop's own (docs/security.md, Cost, says why not TLS driven on the socket).
The executor bounds the requests in flight on one connection: at the bound it stops reading
the socket (TCP flow control holds the sender back) until answers go out, and it stops
reading as well while the router is not taking its replies.
"""

from __future__ import annotations

import asyncio
import ssl
import struct
from collections.abc import Sequence
from typing import cast

from switchyard.errors import ResourceExhausted

HEADER = struct.Struct("<IIB")
REQUEST, CANCEL, REPLY = 1, 2, 3
MAX_NUMBER = 0xFFFFFFFF

Frame = tuple[int, int, bytes | None]  # number, kind, payload (None: longer than the limit, skipped)


def header(length: int, number: int, kind: int) -> bytes:
    return HEADER.pack(length, number, kind)


JOIN_UNDER = 64 * 1024  # over TLS, a frame shorter than this is written as one piece


def is_tls(transport: asyncio.BaseTransport) -> bool:
    return transport.get_extra_info("sslcontext") is not None


def send(transport: asyncio.Transport, pieces: Sequence[bytes], tls: bool) -> None:
    """Writes one frame's pieces (its header first). In plaintext they go out in one system
    call as they are (writelines). The event loop's TLS instead makes a record of each piece it
    is given (a call into OpenSSL, its encryption and bookkeeping), and the peer reads each
    record back in a call of its own, so there a small frame is joined first: one record a
    side, for one copy of a few KiB."""
    if not tls or sum(map(len, pieces)) >= JOIN_UNDER:
        transport.writelines(pieces)
    else:
        transport.write(b"".join(pieces))


class FrameReader:
    """Splits a byte stream into frames. A frame longer than `limit` is reported with payload
    None and its bytes are dropped as they arrive, so a peer cannot make us buffer it.

    A payload that spans reads is kept as the list of its pieces and joined once when
    complete: one copy of a 1 MB request, not one per read."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._partial_header = b""
        self._current: tuple[int, int, int] | None = None  # length, number, kind being read
        self._pieces: list[bytes] = []
        self._have = 0
        self._skip = 0  # payload bytes of an oversized frame still to drop

    def feed(self, data: bytes) -> list[Frame]:
        frames: list[Frame] = []
        pos, end = 0, len(data)
        while pos < end:
            if self._skip:
                dropped = min(self._skip, end - pos)
                self._skip -= dropped
                pos += dropped
            elif self._current is not None:
                length, number, kind = self._current
                take = min(length - self._have, end - pos)
                self._pieces.append(data[pos : pos + take])  # the whole read: no copy
                self._have += take
                pos += take
                if self._have == length:
                    frames.append((number, kind, b"".join(self._pieces)))
                    self._current, self._pieces, self._have = None, [], 0
            else:
                if self._partial_header or end - pos < HEADER.size:
                    take = min(HEADER.size - len(self._partial_header), end - pos)
                    self._partial_header += data[pos : pos + take]
                    pos += take
                    if len(self._partial_header) < HEADER.size:
                        break
                    length, number, kind = HEADER.unpack(self._partial_header)
                    self._partial_header = b""
                else:
                    length, number, kind = HEADER.unpack_from(data, pos)
                    pos += HEADER.size
                if length > self._limit:
                    frames.append((number, kind, None))
                    self._skip = length
                elif end - pos >= length:  # the common case: the whole frame in this read
                    frames.append((number, kind, data[pos : pos + length]))
                    pos += length
                else:
                    self._current = (length, number, kind)
        return frames


class FrameClosed(Exception):
    """The connection ended (or never opened): the request may or may not have been served."""


class FrameTimeout(Exception):
    """No reply within the request's time; the executor has been told to drop it."""


class FrameChannel(asyncio.Protocol):
    """The router's end: one connection to one executor, many requests in flight on it."""

    def __init__(self, limit: int) -> None:
        self._reader = FrameReader(limit)
        self._pending: dict[int, asyncio.Future[bytes]] = {}
        self._number = 0
        self._transport: asyncio.Transport | None = None
        self._tls = False
        self._loop = asyncio.get_running_loop()  # made in the loop's create_connection; kept:
        self.closed_because = ""  # asking for it per request is a getpid system call

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        limit: int,
        timeout_s: float,
        tls: ssl.SSLContext | None = None,
        server_hostname: str = "",
    ) -> FrameChannel:
        """Connects (over TLS with `tls`: the executor's certificate checked against
        `server_hostname`, the name of the service meant (switchyard.tls.service_name), else
        `host`; this process's certificate shown to it)."""
        loop = asyncio.get_running_loop()
        name = (server_hostname or host) if tls is not None else None
        connecting = loop.create_connection(lambda: cls(limit), host, port, ssl=tls, server_hostname=name)
        _, channel = await asyncio.wait_for(connecting, timeout_s)
        return channel

    @property
    def is_open(self) -> bool:
        return self._transport is not None and not self._transport.is_closing()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._tls = is_tls(transport)

    def data_received(self, data: bytes) -> None:
        for number, kind, payload in self._reader.feed(data):
            if kind != REPLY:  # not this protocol's peer: fail what is pending, stop talking
                self.close(f"the executor sent a frame of kind {kind}, not a reply")
                return
            waiter = self._pending.pop(number, None)
            if waiter is None or waiter.done():
                continue  # a reply to a request given up on
            if payload is None:
                waiter.set_exception(
                    ResourceExhausted("the executor's reply is larger than the router's message limit")
                )
            else:
                waiter.set_result(payload)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed_because = self.closed_because or (str(exc) if exc else "closed by the executor")
        pending, self._pending = self._pending, {}
        for waiter in pending.values():
            if not waiter.done():
                waiter.set_exception(FrameClosed(self.closed_because))

    async def request(self, parts: Sequence[bytes], timeout_s: float) -> bytes:
        """Sends the concatenated `parts` as one request; returns the reply's payload."""
        transport = self._transport
        if transport is None or transport.is_closing():
            raise FrameClosed(self.closed_because or "not connected")
        self._number = number = self._number % MAX_NUMBER + 1
        loop = self._loop
        waiter: asyncio.Future[bytes] = loop.create_future()
        self._pending[number] = waiter

        def expire() -> None:
            if not waiter.done():
                waiter.set_exception(FrameTimeout())

        timer = loop.call_later(timeout_s, expire)
        send(transport, (header(sum(map(len, parts)), number, REQUEST), *parts), self._tls)
        try:
            return await waiter
        except BaseException:  # timed out, or the caller went away: the executor drops it
            if self._pending.pop(number, None) is not None and not transport.is_closing():
                transport.write(header(0, number, CANCEL))
            raise
        finally:
            timer.cancel()

    def close(self, reason: str = "closed by the router") -> None:
        self.closed_because = self.closed_because or reason
        if self._transport is not None:
            self._transport.close()

    def abort(self, reason: str) -> None:
        """Closes without flushing what is unsent (close waits for a peer that may never read):
        every waiting request fails with FrameClosed at once."""
        self.closed_because = self.closed_because or reason
        if self._transport is not None:
            self._transport.abort()
