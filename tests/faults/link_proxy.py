"""A link in a connection's path that a test can make slow, lossy or silent (after Toxiproxy).

This machine's kernel has no `sch_netem` (`tc qdisc add ... netem` answers "Specified qdisc
kind is unknown", and there is no modprobe), so delay and loss cannot be put on a veth. A
TCP relay in the path does it instead, as Toxiproxy's toxics do: every chunk read from one
side is written to the other after `delay_ms`; with `loss` a share of the chunks is held a
further `LOST_PENALTY_MS` (what a lost segment costs a TCP stream: the sender's minimum
retransmission timeout on Linux, 200 ms), since bytes a relay dropped outright would corrupt
the stream rather than be retransmitted; `blackhole` forwards nothing either way while the
connections stay open (no RST, no FIN), as a host whose packets are all dropped.

A proxy listens on `listen_host` at the same ports it relays to on `target_host`, so a
service that reports its own port (the executor's frame port, in Describe) is reached through
the proxy too. Everything it starts, it stops in `close`. Run as a module
(`python -m tests.faults.link_proxy`), it is a relay process inside a host of the fault
cluster, its faults set through a control file (tests/faults/cluster.py: the router's link to
exec-b).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

LOST_PENALTY_MS = 200.0
CHUNK = 64 * 1024


@dataclass
class Faults:
    delay_ms: float = 0.0
    loss: float = 0.0  # share of chunks held LOST_PENALTY_MS more
    blackhole: bool = False
    rng: random.Random = field(default_factory=lambda: random.Random(33))


class LinkProxy:
    def __init__(self, listen_host: str, target_host: str, ports: Sequence[int]) -> None:
        self.listen_host, self.target_host, self.ports = listen_host, target_host, tuple(ports)
        self.faults = Faults()
        self._servers: list[asyncio.Server] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()

    async def start(self) -> LinkProxy:
        for port in self.ports:
            server = await asyncio.start_server(
                functools.partial(self._accept, port=port), self.listen_host, port
            )
            self._servers.append(server)
        return self

    def set(self, delay_ms: float = 0.0, loss: float = 0.0, blackhole: bool = False) -> None:
        self.faults.delay_ms, self.faults.loss, self.faults.blackhole = delay_ms, loss, blackhole
        if blackhole:
            self._flowing.clear()
        else:
            self._flowing.set()

    def heal(self) -> None:
        self.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int) -> None:
        await self._flowing.wait()  # a blackholed link answers no SYN either (the caller waits)
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, port)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_writer))
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        """Reads as it comes and writes each chunk when it is due, so a delayed link still
        carries many chunks at once (its bandwidth is not the delay's inverse); order kept."""
        loop = asyncio.get_running_loop()
        due: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        writer = asyncio.create_task(self._deliver(due, dst))
        last = 0.0
        try:
            while chunk := await src.read(CHUNK):
                hold = self.faults.delay_ms
                if self.faults.loss and self.faults.rng.random() < self.faults.loss:
                    hold += LOST_PENALTY_MS
                last = max(last, loop.time() + hold / 1000)  # a held chunk holds those after it
                due.put_nowait((last, chunk))
        except (ConnectionError, OSError):
            pass
        finally:
            due.put_nowait((last, b""))
            with contextlib.suppress(Exception):
                await writer

    async def _deliver(self, due: asyncio.Queue[tuple[float, bytes]], dst: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                at, chunk = await due.get()
                await asyncio.sleep(max(0.0, at - loop.time()))
                await self._flowing.wait()  # blackholed: held, neither sent nor refused
                if not chunk:
                    return
                dst.write(chunk)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                dst.close()

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        for writer in self._writers:
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2)


async def _serve(listen_host: str, target_host: str, ports: Sequence[int], control: Path) -> None:
    """Relays until killed; `control` (JSON: delay_ms, loss, blackhole) is read every 0.1 s, so
    the test that started this process in a host sets the link's faults by writing the file."""
    proxy = await LinkProxy(listen_host, target_host, ports).start()
    print("READY", flush=True)
    seen = ""
    while True:
        text = await asyncio.to_thread(control.read_text)
        if text != seen:
            seen = text
            proxy.set(**json.loads(text or "{}"))
        await asyncio.sleep(0.1)


if __name__ == "__main__":  # python -m tests.faults.link_proxy LISTEN TARGET PORT,PORT CONTROL
    listen, target, port_list, control_file = sys.argv[1:5]
    asyncio.run(_serve(listen, target, [int(p) for p in port_list.split(",")], Path(control_file)))
