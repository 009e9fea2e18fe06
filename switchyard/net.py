"""Network definitions every process shares: the message limit, the channel options that carry
it, and a free port for services started on port 0.

No grpc import: the router chooses its gRPC transport before grpc is first imported
(switchyard.transport), and a client-only install uses this as well. The servicer context's
type, which needs grpc, is `switchyard.grpcio.ServicerContext`.
"""

from __future__ import annotations

import socket

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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now.

    A brief window exists between close and the child's bind; acceptable for port 0 in tests
    and local clusters, and configured ports never go through here.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
