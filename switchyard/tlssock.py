"""TLS for frame connections on the socket itself: OpenSSL reads and writes the descriptor.

asyncio's (and uvloop's) TLS runs OpenSSL on memory buffers: each read copies the ciphertext
into a MemoryBIO and drains the plaintext through several Python-level SSLObject calls, each
write encrypts into another buffer and hands it to the plain transport, and a `writelines` of a
frame's header and payload becomes two TLS records. On the router's hop to an executor that
was most of what mutual TLS cost: a 1 KB frame's round trip took ~45 µs in plaintext and
~165 µs over uvloop's TLS on the same two processes (both ends, this project's 2-core
machines). Here a non-blocking `ssl.SSLSocket` is driven from the event loop's reader and
writer callbacks instead: one `recv` call decrypts straight from the kernel, one `send`
encrypts and sends, so a frame costs one TLS record and one C call per direction.

`SocketTLSTransport` is the subset of asyncio.Transport that frames use (write, writelines,
close, is_closing, pause/resume_reading, get_extra_info with "peercert", "peername",
"sslcontext"), calling its protocol as asyncio does (connection_made, data_received,
connection_lost, pause_writing/resume_writing at the write buffer's high-water mark).
OpenSSL without partial writes wants a refused write retried with the same buffer, so pending
output is a queue of whole chunks and only the head is ever retried.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import ssl
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger(__name__)

READ_SIZE = 256 * 1024  # what one data_received hands over at most
RECORD = 16 * 1024  # the most plaintext one TLS record carries: OpenSSL returns at most one per read
HIGH_WATER = 1 << 20  # pending output bytes at which the protocol is told to pause writing
LOW_WATER = HIGH_WATER // 4
ProtocolFactory = Callable[[], asyncio.Protocol]


class SocketTLSTransport(asyncio.Transport):
    def __init__(
        self, loop: asyncio.AbstractEventLoop, sock: ssl.SSLSocket, protocol: asyncio.Protocol
    ) -> None:
        super().__init__()
        self._loop = loop
        self._sock = sock
        self._fd = sock.fileno()
        self._protocol = protocol
        self._out: collections.deque[bytes] = collections.deque()
        self._out_bytes = 0
        self._closing = False
        self._closed = False
        self._reading = False
        self._writing_paused = False
        self._read_wants_write = False  # a read that needs the socket writable (renegotiation)
        self._buffer = bytearray(READ_SIZE)
        self._view = memoryview(self._buffer)
        self._extra = {
            "peercert": sock.getpeercert(),
            "peername": _quiet(sock.getpeername),
            "sockname": _quiet(sock.getsockname),
            "sslcontext": sock.context,
            "ssl_object": sock,
            "cipher": sock.cipher(),
        }

    def start(self) -> None:
        self._protocol.connection_made(self)
        if not self._closing:
            self.resume_reading()

    # ---- reading ---------------------------------------------------------------------------
    def _on_readable(self) -> None:
        """Reads what has arrived, up to READ_SIZE, and hands it over in one data_received.

        OpenSSL returns at most one record (16 KiB) per read and holds nothing past it. A read
        that filled a whole record is likely followed by more, so reading goes on into the
        same buffer (a 1 MiB frame takes a few deliveries, not 64); a short one ends it without
        the extra read that would only raise WantRead, and the level-triggered reader fires
        again for anything still in the kernel."""
        filled = 0
        ended = False  # the peer closed, or the connection failed (`failure`): end after delivery
        failure: Exception | None = None
        while self._reading and not self._closed and filled < READ_SIZE:
            try:
                n = self._sock.recv_into(self._view[filled:])
            except ssl.SSLWantReadError:
                break
            except ssl.SSLWantWriteError:
                self._read_wants_write = True
                self._loop.add_writer(self._fd, self._on_writable)
                break
            except (OSError, ssl.SSLError) as exc:
                ended, failure = True, exc
                break
            if not n:  # the peer closed (close_notify or EOF)
                ended = True
                break
            if n < RECORD and n < READ_SIZE - filled:
                # the record was shorter than the space: all of it is delivered and OpenSSL
                # holds nothing (no pending() call: every ssl call releases the GIL, and
                # in a process with gRPC's threads taking it back costs more than the call)
                filled += n
                break
            filled += n
        if filled:
            self._protocol.data_received(self._view[:filled].tobytes())
        if ended:
            self._fatal(failure)
        elif filled >= READ_SIZE and self._reading and not self._closed:
            self._loop.call_soon(self._on_readable)  # more may be held by OpenSSL

    def pause_reading(self) -> None:
        if self._reading and not self._closed:
            self._reading = False
            self._loop.remove_reader(self._fd)

    def resume_reading(self) -> None:
        if self._reading or self._closed or self._closing:
            return
        self._reading = True
        self._loop.add_reader(self._fd, self._on_readable)
        if self._sock.pending():  # decrypted bytes already held by OpenSSL: no readiness event comes
            self._loop.call_soon(self._on_readable)

    def is_reading(self) -> bool:
        return self._reading

    # ---- writing ---------------------------------------------------------------------------
    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or self._closed or not data:
            return
        chunk = bytes(data)
        if not self._out and self._send(chunk):
            return
        if not self._out:
            self._loop.add_writer(self._fd, self._on_writable)
        self._out.append(chunk)
        self._out_bytes += len(chunk)
        if not self._writing_paused and self._out_bytes >= HIGH_WATER:
            self._writing_paused = True
            self._protocol.pause_writing()

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        self.write(b"".join(list_of_data))  # one TLS record, one send

    def _send(self, chunk: bytes) -> bool:
        """True when OpenSSL took all of `chunk`; False when the socket is full (retry it)."""
        try:
            self._sock.send(chunk)  # without partial writes: all of it, or WantWrite
            return True
        except (ssl.SSLWantWriteError, ssl.SSLWantReadError, BlockingIOError):
            return False
        except (OSError, ssl.SSLError) as exc:
            self._fatal(exc)
            return True

    def _on_writable(self) -> None:
        if self._read_wants_write:
            self._read_wants_write = False
            if not self._out:
                self._loop.remove_writer(self._fd)
            self._on_readable()
        while self._out and not self._closed:
            head = self._out[0]
            if not self._send(head):
                return
            if self._closed:
                return
            self._out.popleft()
            self._out_bytes -= len(head)
        if self._closed:
            return
        self._loop.remove_writer(self._fd)
        if self._writing_paused and self._out_bytes <= LOW_WATER:
            self._writing_paused = False
            self._protocol.resume_writing()
        if self._closing:
            self._finish(None)

    def get_write_buffer_size(self) -> int:
        return self._out_bytes

    def can_write_eof(self) -> bool:
        return False

    # ---- closing ---------------------------------------------------------------------------
    def is_closing(self) -> bool:
        return self._closing or self._closed

    def close(self) -> None:
        if self._closing or self._closed:
            return
        self._closing = True
        self.pause_reading()
        if not self._out:
            self._finish(None)

    def abort(self) -> None:
        self._fatal(None)

    def _fatal(self, exc: Exception | None) -> None:
        self._closing = True
        self._out.clear()
        self._out_bytes = 0
        self._finish(exc)

    def _finish(self, exc: Exception | None) -> None:
        if self._closed:
            return
        self._closed = True
        self._reading = False
        self._loop.remove_reader(self._fd)
        self._loop.remove_writer(self._fd)
        self._sock.close()
        self._loop.call_soon(self._protocol.connection_lost, exc)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._extra.get(name, default)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        raise NotImplementedError("a frame connection keeps its protocol")


def _quiet(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except OSError:
        return None


async def _handshake(loop: asyncio.AbstractEventLoop, sock: ssl.SSLSocket, timeout_s: float) -> None:
    fd = sock.fileno()

    async def run() -> None:
        while True:
            try:
                sock.do_handshake()
                return
            except ssl.SSLWantReadError:
                await _until(loop, fd, loop.add_reader, loop.remove_reader)
            except ssl.SSLWantWriteError:
                await _until(loop, fd, loop.add_writer, loop.remove_writer)

    await asyncio.wait_for(run(), timeout_s)


async def _until(
    loop: asyncio.AbstractEventLoop, fd: int, watch: Callable[..., Any], unwatch: Callable[[int], Any]
) -> None:
    """Until the socket is readable (add_reader) or writable (add_writer)."""
    ready = loop.create_future()
    watch(fd, ready.set_result, None)
    try:
        await ready
    finally:
        unwatch(fd)


async def connect(
    factory: ProtocolFactory, host: str, port: int, context: ssl.SSLContext, timeout_s: float
) -> tuple[SocketTLSTransport, asyncio.Protocol]:
    """A TLS connection to host:port (the peer's certificate checked against `host`)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    if not infos:
        raise OSError(f"cannot resolve {host}")
    family, kind, proto, _, address = infos[0]
    raw = socket.socket(family, kind, proto)
    try:
        raw.setblocking(False)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.wait_for(loop.sock_connect(raw, address), timeout_s)
        sock = context.wrap_socket(raw, server_hostname=host, do_handshake_on_connect=False)
    except BaseException:
        raw.close()
        raise
    try:
        await _handshake(loop, sock, timeout_s)
    except BaseException:
        sock.close()
        raise
    protocol = factory()
    transport = SocketTLSTransport(loop, sock, protocol)
    transport.start()
    return transport, protocol


class Server:
    """Accepts TLS connections on a listening socket; each gets a protocol from `factory`."""

    def __init__(
        self, factory: ProtocolFactory, context: ssl.SSLContext, handshake_timeout_s: float = 10.0
    ) -> None:
        self._factory = factory
        self._context = context
        self._timeout = handshake_timeout_s
        self._listener: socket.socket | None = None
        self._handshakes: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.port = 0

    async def start(self, host: str, port: int, backlog: int = 128) -> int:
        loop = self._loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address)
            listener.listen(backlog)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        loop.add_reader(listener.fileno(), self._accept)
        return self.port

    def _accept(self) -> None:
        assert self._listener is not None and self._loop is not None
        for _ in range(64):
            try:
                raw, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say: the next readiness event retries
                log.warning("frames: accept failed: %s", exc)
                return
            task = self._loop.create_task(self._open(raw))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _open(self, raw: socket.socket) -> None:
        assert self._loop is not None
        try:
            raw.setblocking(False)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock = self._context.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
        except (OSError, ssl.SSLError) as exc:
            raw.close()
            log.info("frames: TLS setup with a peer failed: %s", exc)
            return
        try:
            await _handshake(self._loop, sock, self._timeout)
        except (OSError, ssl.SSLError, TimeoutError) as exc:
            sock.close()
            log.info("frames: TLS handshake with a peer failed: %s", exc)
            return
        except asyncio.CancelledError:
            sock.close()
            raise
        SocketTLSTransport(self._loop, sock, self._factory()).start()

    def close(self) -> None:
        if self._listener is not None and self._loop is not None:
            self._loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
        for task in list(self._handshakes):
            task.cancel()

    async def wait_closed(self) -> None:
        if self._handshakes:
            await asyncio.gather(*self._handshakes, return_exceptions=True)
