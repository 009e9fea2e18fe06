"""The fault harness's hosts: two namespaces reach each other, a blackhole drops every packet
(a connection attempt times out, no RST), healing restores it, and nothing is left behind."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.faults.netns import Network, unavailable

WHY = unavailable()
pytestmark = pytest.mark.skipif(bool(WHY), reason=WHY or "runs")


@pytest.fixture
def network() -> Iterator[Network]:
    net = Network()
    try:
        yield net
    finally:
        net.close()  # even when the test failed


CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], 7000), timeout=1).close()"
LISTEN = (
    "import socket; s = socket.create_server(('0.0.0.0', 7000)); [s.accept()[0].close() for _ in range(50)]"
)


def _reach(network: Network, src: str, dst: str) -> bool:
    """A TCP connection from `src` to `dst`'s listener within 1 s."""
    probe = network.hosts[src].command(sys.executable, "-c", CONNECT, network.hosts[dst].address)
    return subprocess.run(probe, capture_output=True, timeout=10).returncode == 0


def _namespaces(tag: str) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    return [line for line in listed.splitlines() if tag in line]


def test_hosts_reach_each_other_until_blackholed_and_after_healing(network: Network) -> None:
    network.add("client")
    executor = network.add("executor")
    listener = subprocess.Popen(executor.command(sys.executable, "-c", LISTEN))
    try:
        deadline = time.monotonic() + 10
        while not _reach(network, "client", "executor"):
            assert time.monotonic() < deadline, "the listener never answered"
        executor.blackhole()
        t0 = time.monotonic()
        assert not _reach(network, "client", "executor")
        assert time.monotonic() - t0 >= 0.9  # no RST: the caller waits out its own timeout
        executor.heal()
        assert _reach(network, "client", "executor")
    finally:
        listener.kill()
        listener.wait()
    tag = network.tag
    network.close()
    assert _namespaces(tag) == []
