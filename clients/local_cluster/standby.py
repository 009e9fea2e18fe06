"""A service process started ahead of need, for `switchyard up`'s restarts.

    python -m clients.local_cluster.standby MODULE[,MODULE...] LOG -- ARGS...

imports the MODULEs (the slow part of a service's start: torch and the executor's server, some
seconds on a busy host), says `ready` on stdout, from then on writes its output to the file LOG
(appending), and waits for one line on stdin. On that line the process becomes
`python -m clients.cli ARGS...`, with its imports already done; at end of input (nobody needed
it) it exits 0. The supervisor keeps one standby per executor, so a crashed executor's
replacement only has to load its models.

`Standbys` is the supervisor's side: a standby per service whose spec names modules to
preload, started once the cluster is up (and again after each restart), and handed the
service's command line at the next restart instead of starting an interpreter from nothing.
A standby costs one idle interpreter with torch imported per executor, and one for the router.
The router's first start takes one too: started with the back ends, it has imported the
router's server by the time they are up and its routes are written.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from clients.local_cluster.processes import kill_group, start_in_session

if TYPE_CHECKING:
    from clients.local_cluster.plan import ServiceSpec

MODULE = "clients.local_cluster.standby"  # this program, as `python -m` runs it


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") != 2:
        print(
            "usage: python -m clients.local_cluster.standby MODULE[,MODULE...] LOG -- ARGS...",
            file=sys.stderr,
        )
        return 2
    modules, log = [m for m in argv[0].split(",") if m], argv[1]
    # the services that preload (executors, the router) choose gRPC's transport before grpc
    # is imported, as their `serve` does; after the imports below it would be too late
    from switchyard import transport

    transport.prefer_low_latency()
    for module in modules:
        importlib.import_module(module)
    print("ready", flush=True)
    out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(out, sys.stdout.fileno())
    os.close(out)
    if not sys.stdin.readline():
        return 0
    sys.argv = ["switchyard", *argv[3:]]
    from clients.cli import main as cli

    return cli(sys.argv[1:])


class Standbys:
    """The standby of each service that preloads modules, for the supervisor's restarts."""

    def __init__(self, log_dir: Path, say: Callable[[str], None], on_ready: Callable[[], None]) -> None:
        self.log_dir = log_dir
        self.say = say
        self.on_ready = on_ready  # called when a standby has its imports done
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._ready: set[str] = set()
        self._waits: set[asyncio.Task[None]] = set()

    async def start(self, spec: ServiceSpec) -> None:
        """Starts the standby of `spec` (if it preloads anything and has none alive)."""
        current = self._procs.get(spec.name)
        if not spec.preload or (current is not None and current.returncode is None):
            return
        python, dash_m, module, *args = spec.argv
        if (dash_m, module) != ("-m", "clients.cli"):
            return  # only `python -m clients.cli ...` services have a standby
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{spec.name}.log"
        with log_path.open("ab") as out:
            proc = await start_in_session(
                [python, "-m", MODULE, ",".join(spec.preload), str(log_path), "--", *args],
                {**os.environ, **spec.env}, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=out,
            )  # fmt: skip
        self._procs[spec.name] = proc
        self._ready.discard(spec.name)

        async def await_ready() -> None:
            assert proc.stdout is not None
            if (await proc.stdout.readline()).strip() == b"ready" and self._procs.get(spec.name) is proc:
                self._ready.add(spec.name)
                self.on_ready()

        task = asyncio.create_task(await_ready())
        self._waits.add(task)
        task.add_done_callback(self._waits.discard)

    def state(self, name: str) -> str:
        """The standby of a service: ready (imports done), starting, or "" (none)."""
        proc = self._procs.get(name)
        if proc is None or proc.returncode is not None:
            return ""
        return "ready" if name in self._ready else "starting"

    async def take(self, spec: ServiceSpec, verb: str = "restarted") -> asyncio.subprocess.Process | None:
        """The standby of `spec`, told to become the service; None if there is none alive."""
        proc = self._procs.pop(spec.name, None)
        self._ready.discard(spec.name)
        if proc is None or proc.returncode is not None or proc.stdin is None:
            return None
        try:
            proc.stdin.write(b"go\n")
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):  # it died meanwhile
            return None
        self.say(f"  {spec.name} {verb} from its standby (pid {proc.pid}, imports done)")
        return proc

    async def stop(self) -> None:
        for task in list(self._waits):
            task.cancel()
        for proc in self._procs.values():
            kill_group(proc.pid, signal.SIGKILL)
        for proc in self._procs.values():
            await proc.wait()
        self._procs.clear()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
