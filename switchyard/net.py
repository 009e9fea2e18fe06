"""Network definitions every process shares: the message limit, the channel options that carry
it, free ports for services started on port 0, and the run loop of the small HTTP services
(the audit witness, the Temporal UI's codec endpoint).

No grpc import: the router chooses its gRPC transport before grpc is first imported
(switchyard.transport), and a client-only install uses this as well. The servicer context's
type, which needs grpc, is `switchyard.grpcio.ServicerContext`.
"""

from __future__ import annotations

import random
import signal
import socket
from collections.abc import Collection
from http.server import HTTPServer
from typing import Any

MIB = 1024 * 1024
# The largest gRPC message (and frame) any switchyard server or client sends or accepts: a
# batch of inputs fits, a runaway one is refused with RESOURCE_EXHAUSTED instead of buffered.
MAX_MESSAGE_BYTES = 64 * MIB


def message_options(
    max_receive_bytes: int = MAX_MESSAGE_BYTES, max_send_bytes: int | None = None
) -> list[tuple[str, int]]:
    """gRPC channel/server options for the message limits (send defaults to the receive limit)."""
    send = max_receive_bytes if max_send_bytes is None else max_send_bytes
    return [("grpc.max_receive_message_length", max_receive_bytes), ("grpc.max_send_message_length", send)]


# The same options as a constant, for channels that never change them.
CHANNEL_OPTIONS: list[tuple[str, int]] = message_options()


# Keepalive for every internal client channel (gRPC's keepalive guide): a ping after 1 s
# without reads, the transport closed when its answer is 1 s late, with or without calls. A
# peer that stops answering (a blackholed host: no RST, every packet dropped) then fails its
# calls with UNAVAILABLE in about 2 s instead of after TCP's retransmission timeout (minutes).
KEEPALIVE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# What a server must allow for those pings, or it answers them with GOAWAY (too_many_pings).
KEEPALIVE_PERMIT_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 500),
    ("grpc.http2.max_ping_strikes", 0),
]


PORT_FLOOR = 20000  # free ports are drawn from here up to the ephemeral range's start


def free_port(host: str = "127.0.0.1", taken: Collection[int] = ()) -> int:
    """A TCP port free on `host` now and not in `taken`, for a service that another process
    binds later (services started on port 0 by a cluster or a test, a distributed run's
    rendezvous). Below the kernel's ephemeral range where it has one: a port from that range
    (what a bind to port 0 returns) may be handed to any other bind to port 0 or outgoing
    connection on the host before its service binds it; one below it cannot be. Configured
    ports never go through here.
    """
    low = _ephemeral_low()
    chooser = random.Random()
    for _ in range(200 if low > PORT_FLOOR + 1 else 0):
        port = chooser.randrange(PORT_FLOOR, low)
        if port not in taken and _bindable(host, port):
            return port
    while True:  # no ephemeral range known, or none free below it: any port the kernel gives
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in taken:
            return port


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    """The first port of Linux's ephemeral range (ip_local_port_range), or 0 where unknown."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def serve_http_until_stopped(server: HTTPServer) -> None:
    """Serve until SIGTERM (a supervisor's stop) or Ctrl-C, then close: the process exits 0."""
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
