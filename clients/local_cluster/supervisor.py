"""The process supervisor behind `switchyard up`: start, wait healthy, heal, drain, stop.

Each service runs in its own session (clients.local_cluster.processes). Ctrl-C reaches only
the supervisor, which then stops the services in reverse order: front door first, so no new
work arrives while the rest drain. Whatever is left in a group after its leader exits is
killed, so no process outlives `switchyard up`. When a service is ready is
clients.local_cluster.readiness's to say.

A service that exits while the cluster runs is restarted, the rest serving meanwhile (the
router fails over from a dead executor and re-admits it once its health passes again):
after `RestartPolicy.base_s`, doubling per consecutive crash up to `max_s`. A service that
stayed up for `stable_s` starts counting afresh; one that crashes `limit` times in a row is
left stopped ("crash loop") and the status says so. Only Ctrl-C or SIGTERM stop the cluster.

A service whose spec names modules to preload (the executors: torch and their server) has a
standby (clients.local_cluster.standby) that has imported those modules; a restart hands it
the service's command line, so the replacement only loads its models: a SIGKILLed CPU
executor serves again in a few seconds even on a busy host.
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

from clients.local_cluster.plan import ServiceSpec
from clients.local_cluster.processes import exit_reason, kill_group, start_in_session
from clients.local_cluster.readiness import Readiness, StartupFailed
from clients.local_cluster.standby import Standbys

log = logging.getLogger(__name__)

# Stopped first, in this order, before everything else stops together.
FRONT_FIRST = ("router", "trial-worker")
# Started, and healthy, before the back ends: metering countersigns its head there at start.
GROUND = ("witness",)


@dataclass(frozen=True)
class RestartPolicy:
    base_s: float = 0.5  # wait before the first restart; doubles per consecutive crash
    max_s: float = 30.0
    limit: int = 5  # consecutive crashes before a service is left stopped
    stable_s: float = 60.0  # up this long: the next crash counts as the first again


@dataclass
class Child:
    spec: ServiceSpec
    proc: asyncio.subprocess.Process
    log_path: Path
    started: float
    restarts: int = 0
    crashes: int = 0  # consecutive, reset once the child has been up for stable_s
    last_exit: str = ""  # why it last exited, "" if it never did
    state: str = "running"  # running | restarting | crash-loop | stopped

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode


class Supervisor:
    """Owns the child processes of one local cluster."""

    def __init__(
        self,
        specs: Sequence[ServiceSpec],
        log_dir: Path,
        namespace: str,
        task_queue: str,
        say: Callable[[str], None] = print,
        policy: RestartPolicy | None = None,
        on_change: Callable[[], None] | None = None,
        origin: float | None = None,
    ) -> None:
        self.specs = list(specs)
        self.origin = origin  # when the cluster's start began (monotonic), for the ready lines
        self.log_dir = log_dir
        self.say = say
        self.policy = policy or RestartPolicy()
        self.on_change = on_change  # called after a restart or a give-up (to rewrite cluster.json)
        self.children: dict[str, Child] = {}
        self.readiness = Readiness(self.specs, namespace, task_queue, say)
        self.standbys = Standbys(log_dir, say, on_ready=self._changed)
        self._healer: asyncio.Task[None] | None = None
        self._rewatch = asyncio.Event()
        self._stopping = False
        self._up = False  # every wave ready: only then is a change reported (cluster.json)

    async def _spawn(self, spec: ServiceSpec) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{spec.name}.log"
        old = self.children.get(spec.name)
        proc = await self.standbys.take(spec, "started" if old is None else "restarted")
        if proc is None:
            # a restart appends to the log, so the crash that caused it stays readable
            with log_path.open("ab" if old is not None else "wb") as out:
                proc = await start_in_session(
                    spec.argv, {**os.environ, **spec.env}, stdin=asyncio.subprocess.DEVNULL, stdout=out,
                    stderr=asyncio.subprocess.STDOUT,
                )  # fmt: skip
        child = Child(spec, proc, log_path, time.monotonic())
        if old is not None:
            child.restarts, child.crashes, child.last_exit = old.restarts, old.crashes, old.last_exit
        self.children[spec.name] = child
        log.info("started %s (pid %d): %s", spec.name, proc.pid, " ".join(spec.argv))
        return child

    async def _start_standby(self, spec: ServiceSpec) -> None:
        if not self._stopping:
            await self.standbys.start(spec)

    def standby(self, name: str) -> str:
        """The standby of a service: ready (imports done), starting, or "" (none)."""
        return self.standbys.state(name)

    async def probe(self, spec: ServiceSpec) -> str:
        """The one-word health of a service as the status table shows it."""
        return await self.readiness.probe(spec)

    async def start(self, stop: asyncio.Event, between: Callable[[], Awaitable[None]] | None = None) -> None:
        """Starts every service in waves: the audit witness, then the back ends together, then
        router and worker; `between` runs once the back ends are healthy (e.g. to write the
        router's routes). The executors (slowest: models to load and warm) spawn first, then
        the front's standbys (the router's), whose imports are done when their wave comes."""
        waves = [
            [s for s in self.specs if s.name in GROUND],
            [s for s in self.specs if s.name not in (*GROUND, *FRONT_FIRST)],
            [s for s in self.specs if s.name in FRONT_FIRST],
        ]
        early = {s.name: await self._spawn(s) for s in waves[1] if s.models}  # they need no other up
        for spec in waves[2]:  # importing while the back ends start; each takes its standby
            await self._start_standby(spec)
        for wave in filter(None, waves):
            children = [early.get(spec.name) or await self._spawn(spec) for spec in wave]
            waits = [asyncio.ensure_future(self.readiness.wait_ready(c, stop, self.origin)) for c in children]
            try:
                await asyncio.gather(*waits)
            except BaseException:
                for w in waits:
                    w.cancel()
                raise
            if stop.is_set():
                return
            if between is not None and wave is waves[1]:
                await between()
        self._up = True

    async def watch(self, stop: asyncio.Event) -> str | None:
        """Waits for `stop` or for a running child to exit; returns the name of a child that died."""
        running = {n: c for n, c in self.children.items() if c.state == "running"}
        exits = {asyncio.ensure_future(c.proc.wait()): name for name, c in running.items()}
        stopper = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait({stopper, *exits}, return_when=asyncio.FIRST_COMPLETED)
        for fut in (stopper, *exits):
            fut.cancel()
        for fut in done:
            if fut in exits:
                return exits[fut]
        return None

    def start_healing(self, stop: asyncio.Event) -> None:
        """Restarts services that exit, in the background, until `stop` is set."""
        self._healer = asyncio.create_task(self._heal(stop), name="supervisor-heal")

    async def _heal(self, stop: asyncio.Event) -> None:
        restarts: set[asyncio.Task[None]] = set()
        for child in list(self.children.values()):
            await self._start_standby(child.spec)
        try:
            while not stop.is_set() and not self._stopping:
                self._rewatch.clear()  # set when a restarted child runs again: watch it too
                running = {n: c for n, c in self.children.items() if c.state == "running"}
                exits = {asyncio.ensure_future(c.proc.wait()): name for name, c in running.items()}
                others = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._rewatch.wait())}
                done, _ = await asyncio.wait({*others, *exits}, return_when=asyncio.FIRST_COMPLETED)
                for fut in (*others, *exits):
                    fut.cancel()
                if stop.is_set() or self._stopping:
                    return
                for fut in done:
                    if fut not in exits:
                        continue
                    child = self.children[exits[fut]]
                    child.state = "restarting"
                    task = asyncio.create_task(self._restart(child, stop))
                    restarts.add(task)
                    task.add_done_callback(restarts.discard)
        finally:
            for task in restarts:
                task.cancel()
            await asyncio.gather(*restarts, return_exceptions=True)

    async def _restart(self, child: Child, stop: asyncio.Event) -> None:
        """One crashed child: back-off, start it again, wait until it is ready; repeat while it
        keeps failing, up to the policy's limit."""
        name, p = child.spec.name, self.policy
        while True:
            # helpers the dead service left in its group go before a new one starts
            kill_group(child.pid)
            child.last_exit = exit_reason(child.proc.returncode)
            up_for = time.monotonic() - child.started
            child.crashes = 1 if up_for >= p.stable_s else child.crashes + 1
            if child.crashes > p.limit:
                child.state = "crash-loop"
                self.say(
                    f"  {name} {child.last_exit} after {up_for:.1f}s: {child.crashes - 1} restarts in a row "
                    f"failed, leaving it stopped (crash loop); see {child.log_path}"
                )
                self._changed()
                return
            delay = min(p.max_s, p.base_s * 2 ** (child.crashes - 1))
            child.state = "restarting"
            self.say(
                f"  {name} {child.last_exit} after {up_for:.1f}s; restarting in {delay:.1f}s "
                f"(attempt {child.crashes} of {p.limit})"
            )
            self._changed()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            if stop.is_set() or self._stopping:
                return
            restarts = child.restarts + 1
            child = await self._spawn(child.spec)
            child.restarts = restarts
            child.state = "restarting"
            try:
                await self.readiness.wait_ready(child, stop)
            except StartupFailed as exc:
                log.warning("%s failed to restart: %s", name, exc)
                if child.proc.returncode is None:  # unhealthy for too long: kill it, try again
                    kill_group(child.pid)
                    await child.proc.wait()
                continue
            child.state = "running"
            self._rewatch.set()
            await self._start_standby(child.spec)  # for the next crash, once this one is up
            self._changed()
            return

    def _changed(self) -> None:
        # the router's standby is ready before the cluster is: its state file means "up"
        if self.on_change is not None and self._up:
            try:
                self.on_change()
            except Exception:  # a status file that cannot be written must not stop healing
                log.exception("could not record the cluster's state")

    async def _stop_one(self, child: Child, grace_s: float) -> None:
        pgid = child.pid  # the leader of its own session: pgid == pid
        if child.proc.returncode is None:
            kill_group(pgid, signal.SIGTERM)
            try:
                await asyncio.wait_for(child.proc.wait(), grace_s)
            except TimeoutError:
                log.warning("%s did not stop within %.0fs: killing it", child.spec.name, grace_s)
                kill_group(pgid)
                await child.proc.wait()
        kill_group(pgid)  # helpers the service left behind in its group go too
        child.state = "stopped"
        self.say(f"  stopped {child.spec.name} (exit {child.proc.returncode})")

    async def stop(self, grace_s: float = 20.0) -> None:
        """Drains and stops every child: router and worker first, then the back ends together,
        then the witness (metering countersigns its last head as it stops)."""
        self._stopping = True
        if self._healer is not None:
            self._healer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._healer
        await self.standbys.stop()
        front = [self.children[n] for n in FRONT_FIRST if n in self.children]
        rest = [c for n, c in self.children.items() if n not in (*FRONT_FIRST, *GROUND)]
        for child in front:
            await self._stop_one(child, grace_s)
        await asyncio.gather(*(self._stop_one(c, grace_s) for c in rest))
        for child in [self.children[n] for n in GROUND if n in self.children]:
            await self._stop_one(child, grace_s)

    def pids(self) -> dict[str, int]:
        return {name: c.pid for name, c in self.children.items()}
