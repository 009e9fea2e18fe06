"""The process supervisor behind `switchyard up`: start, wait healthy, watch, drain, stop.

Each service runs in its own session (process group), so a signal to the group reaches the
helpers it spawns too (inductor compile workers, the Temporal server's children) and the
terminal's Ctrl-C reaches only the supervisor, which then stops the services in reverse
order: front door first, so no new work arrives while the rest drain. Whatever is left in a
group after its leader exits is killed, so no process outlives `switchyard up`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from switchyard.cluster import health
from switchyard.cluster.plan import ServiceSpec
from switchyard.errors import FailedPrecondition, Unavailable

log = logging.getLogger(__name__)

# Stopped first, in this order, before everything else stops together.
FRONT_FIRST = ("router", "trial-worker")


class StartupFailed(Unavailable):
    """A service exited or stayed unhealthy while the cluster was starting."""


@dataclass
class Child:
    spec: ServiceSpec
    proc: asyncio.subprocess.Process
    log_path: Path
    started: float

    @property
    def pid(self) -> int:
        return int(self.proc.pid)


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class Supervisor:
    """Owns the child processes of one local cluster."""

    def __init__(
        self,
        specs: Sequence[ServiceSpec],
        log_dir: Path,
        namespace: str,
        task_queue: str,
        say: Callable[[str], None] = print,
    ) -> None:
        self.specs = list(specs)
        self.log_dir = log_dir
        self.namespace = namespace
        self.task_queue = task_queue
        self.say = say
        self.children: dict[str, Child] = {}

    async def _spawn(self, spec: ServiceSpec) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{spec.name}.log"
        env = {**os.environ, **spec.env}
        with log_path.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                *spec.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        child = Child(spec, proc, log_path, time.monotonic())
        self.children[spec.name] = child
        log.info("started %s (pid %d): %s", spec.name, proc.pid, " ".join(spec.argv))
        return child

    async def probe(self, spec: ServiceSpec) -> str:
        """The one-word health of a service as the status table shows it."""
        if spec.probe == "temporal":
            return await health.temporal_health(spec.address, self.namespace)
        if spec.probe == "process":
            temporal = self._temporal_address()
            pollers = await health.temporal_pollers(temporal, self.namespace, self.task_queue)
            return health.SERVING if pollers > 0 else "NO_POLLER"
        return await health.grpc_health(spec.address)

    def _temporal_address(self) -> str:
        for spec in self.specs:
            if spec.probe == "temporal":
                return spec.address
        # A remote Temporal: the worker's argv carries the address after --temporal.
        for spec in self.specs:
            if "--temporal" in spec.argv:
                return spec.argv[spec.argv.index("--temporal") + 1]
        raise FailedPrecondition("no Temporal address in the plan")

    async def _wait_ready(self, child: Child, stop: asyncio.Event) -> None:
        spec = child.spec
        deadline = child.started + spec.startup_timeout_s
        status = "starting"
        while True:
            if child.proc.returncode is not None:
                raise StartupFailed(
                    f"{spec.name} exited with code {child.proc.returncode} while starting; "
                    f"last lines of {child.log_path}:\n{log_tail(child.log_path)}"
                )
            if stop.is_set():
                return
            status = await self.probe(spec)
            if status == health.SERVING and await self._models_ready(spec):
                self.say(f"  {spec.name:<16} ready after {time.monotonic() - child.started:5.1f}s")
                return
            if time.monotonic() > deadline:
                raise StartupFailed(
                    f"{spec.name} not ready after {spec.startup_timeout_s:.0f}s (health {status}); "
                    f"last lines of {child.log_path}:\n{log_tail(child.log_path)}"
                )
            await asyncio.sleep(0.5)

    async def _models_ready(self, spec: ServiceSpec) -> bool:
        if not spec.models:
            return True
        models = await health.executor_models(spec.address)
        if models is None:  # the executor does not report model status: health must do
            return True
        states = {m.name: m.state for m in models}
        failed = [name for name, state in states.items() if state == "FAILED"]
        if failed:
            raise StartupFailed(f"{spec.name}: model(s) {', '.join(failed)} FAILED to load")
        return all(states.get(name) == "READY" for name in spec.models)

    async def start(self, stop: asyncio.Event, between: Callable[[], Awaitable[None]] | None = None) -> None:
        """Starts every service, in two waves: back ends together, then router and worker;
        `between` runs once the first wave is healthy (e.g. to write the router's routes)."""
        waves = [
            [s for s in self.specs if s.name not in FRONT_FIRST],
            [s for s in self.specs if s.name in FRONT_FIRST],
        ]
        for wave in waves:
            children = [await self._spawn(spec) for spec in wave]
            waits = [asyncio.ensure_future(self._wait_ready(c, stop)) for c in children]
            try:
                await asyncio.gather(*waits)
            except BaseException:
                for w in waits:
                    w.cancel()
                raise
            if stop.is_set():
                return
            if between is not None and wave is waves[0]:
                await between()

    async def watch(self, stop: asyncio.Event) -> str | None:
        """Waits for `stop` or for a child to exit; returns the name of a child that died."""
        exits = {asyncio.ensure_future(c.proc.wait()): name for name, c in self.children.items()}
        stopper = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait({stopper, *exits}, return_when=asyncio.FIRST_COMPLETED)
        for fut in (stopper, *exits):
            fut.cancel()
        for fut in done:
            if fut in exits:
                return exits[fut]
        return None

    async def _stop_one(self, child: Child, grace_s: float) -> None:
        pgid = child.pid  # the leader of its own session: pgid == pid
        if child.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            try:
                await asyncio.wait_for(child.proc.wait(), grace_s)
            except TimeoutError:
                log.warning("%s did not stop within %.0fs: killing it", child.spec.name, grace_s)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
                await child.proc.wait()
        # Helpers the service left behind in its group go too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        self.say(f"  stopped {child.spec.name} (exit {child.proc.returncode})")

    async def stop(self, grace_s: float = 20.0) -> None:
        """Drains and stops every child: router and worker first, then the rest together."""
        front = [self.children[n] for n in FRONT_FIRST if n in self.children]
        rest = [c for n, c in self.children.items() if n not in FRONT_FIRST]
        for child in front:
            await self._stop_one(child, grace_s)
        await asyncio.gather(*(self._stop_one(c, grace_s) for c in rest))

    def pids(self) -> dict[str, int]:
        return {name: c.pid for name, c in self.children.items()}
