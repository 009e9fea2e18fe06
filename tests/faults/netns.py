"""Hosts for fault tests: network namespaces joined to one bridge namespace by veth pairs.

Each `Host` is a namespace with its own address on 10.77.0.0/24 (addresses stay inside the
namespaces made here: nothing is routed to the machine's own interfaces). A link's faults:
`blackhole` takes the bridge's end of the host's veth down, so every packet to or from the
host is dropped with no RST or ICMP while its processes and sockets live on; `degrade` is
`tc netem` delay and loss on the host's end, where the kernel has netem (`netem_missing` says
why not: this machine's kernel has no sch_netem, and no modprobe); `heal` undoes both.
`Network.close` removes every namespace it made, and is safe to call
twice; tests call it from a fixture finalizer, so a failing test leaves nothing behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field

SUBNET = "10.77.0"


def unavailable() -> str:
    """Why namespaces cannot be made here ("" when they can): for pytest's skip reason."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs these as root)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (`ip`, `tc`) is not installed"
    probe = f"sy-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return ""


def _ip(*args: str, ns: str = "") -> None:
    cmd = ["ip", "netns", "exec", ns, *args] if ns else list(args)
    subprocess.run(cmd, check=True, capture_output=True, timeout=10)


def netem_missing() -> str:
    """Why `tc netem` cannot be used here ("" when it can)."""
    probe = f"sy-probe-{uuid.uuid4().hex[:6]}"
    try:
        _ip("ip", "netns", "add", probe)
        _ip("ip", "link", "add", "p0", "type", "veth", "peer", "name", "p1", ns=probe)
        tried = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                probe,
                "tc",
                "qdisc",
                "add",
                "dev",
                "p0",
                "root",
                "netem",
                "delay",
                "1ms",
            ],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return "" if tried.returncode == 0 else f"tc netem: {tried.stderr.strip()} (no sch_netem)"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)


@dataclass
class Host:
    name: str  # the namespace
    address: str
    device: str  # its end of the veth pair, inside the namespace
    outer: str  # the bridge's end
    bridge_ns: str

    def command(self, *args: str) -> list[str]:
        """`args` run inside this host."""
        return ["ip", "netns", "exec", self.name, *args]

    def _netem(self, *spec: str) -> None:
        _ip("tc", "qdisc", "replace", "dev", self.device, "root", "netem", *spec, ns=self.name)

    def blackhole(self) -> None:
        _ip("ip", "link", "set", self.outer, "down", ns=self.bridge_ns)

    def degrade(self, delay_ms: int, loss_percent: float) -> None:
        self._netem("delay", f"{delay_ms}ms", "loss", f"{loss_percent}%")

    def heal(self) -> None:
        _ip("ip", "link", "set", self.outer, "up", ns=self.bridge_ns)
        subprocess.run(
            ["ip", "netns", "exec", self.name, "tc", "qdisc", "del", "dev", self.device, "root"],
            capture_output=True,
            timeout=10,
        )


@dataclass
class Network:
    """A bridge namespace and the hosts attached to it."""

    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    hosts: dict[str, Host] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.bridge_ns = f"sy-{self.tag}-br"
        _ip("ip", "netns", "add", self.bridge_ns)
        _ip("ip", "link", "add", "br0", "type", "bridge", ns=self.bridge_ns)
        _ip("ip", "link", "set", "br0", "up", ns=self.bridge_ns)

    def add(self, role: str) -> Host:
        n = len(self.hosts) + 1
        assert n < 200, "a test network has fewer than 200 hosts"
        ns, outer = f"sy-{self.tag}-{role}", f"v{self.tag}{n}"
        _ip("ip", "netns", "add", ns)
        _ip("ip", "link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("ip", "link", "set", outer, "netns", self.bridge_ns)
        _ip("ip", "link", "set", outer, "master", "br0", ns=self.bridge_ns)
        _ip("ip", "link", "set", outer, "up", ns=self.bridge_ns)
        address = f"{SUBNET}.{n}"
        _ip("ip", "addr", "add", f"{address}/24", "dev", "eth0", ns=ns)
        _ip("ip", "link", "set", "eth0", "up", ns=ns)
        _ip("ip", "link", "set", "lo", "up", ns=ns)
        host = Host(ns, address, "eth0", outer, self.bridge_ns)
        self.hosts[role] = host
        return host

    def close(self) -> None:
        for ns in [*(h.name for h in self.hosts.values()), self.bridge_ns]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        self.hosts.clear()
