"""The process supervisor behind `switchyard up`: start, wait healthy, heal, drain, stop.

Each service runs in its own session (process group), so a signal to the group reaches the
helpers it spawns too (inductor compile workers, the Temporal server's children) and the
terminal's Ctrl-C reaches only the supervisor, which then stops the services in reverse
order: front door first, so no new work arrives while the rest drain. Whatever is left in a
group after its leader exits is killed, so no process outlives `switchyard up`.

A service that exits while the cluster runs is restarted, the rest serving meanwhile (the
router fails over from a dead executor and re-admits it once its health passes again):
after `RestartPolicy.base_s`, doubling per consecutive crash up to `max_s`. A service that
stayed up for `stable_s` starts counting afresh; one that crashes `limit` times in a row is
left stopped ("crash loop") and the status says so. Only Ctrl-C or SIGTERM stop the cluster.

A service whose spec names modules to preload (the executors: torch and their server) has a
standby: a process started once the cluster is up (and again after each restart) that has
imported those modules and waits (`switchyard.standby`). A restart hands the service's
command line to the standby instead of starting an interpreter from nothing, so the
replacement only loads its models: a SIGKILLed CPU executor serves again in a few seconds
even on a busy host. A standby costs one idle interpreter with torch imported per executor.

Every child is started with PR_SET_PDEATHSIG (Linux prctl, through ctypes): the kernel
SIGKILLs it when the supervisor dies, even by SIGKILL, so a killed `switchyard up` leaves no
orphaned services behind. On other systems the children outlive a killed supervisor.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from clients.local_cluster import health
from clients.local_cluster.plan import ServiceSpec
from switchyard import tls
from switchyard.errors import FailedPrecondition, Unavailable

log = logging.getLogger(__name__)

# Stopped first, in this order, before everything else stops together.
FRONT_FIRST = ("router", "trial-worker")


class StartupFailed(Unavailable):
    """A service exited or stayed unhealthy while the cluster was starting."""


@dataclass(frozen=True)
class RestartPolicy:
    base_s: float = 0.5  # wait before the first restart; doubles per consecutive crash
    max_s: float = 30.0
    limit: int = 5  # consecutive crashes before a service is left stopped
    stable_s: float = 60.0  # up this long: the next crash counts as the first again


PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """preexec_fn: the kernel SIGKILLs this child when the supervisor thread exits."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def exit_reason(code: int | None) -> str:
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


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
        policy: RestartPolicy | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.specs = list(specs)
        self.log_dir = log_dir
        self.namespace = namespace
        self.task_queue = task_queue
        self.say = say
        self.policy = policy or RestartPolicy()
        self.on_change = on_change  # called after a restart or a give-up (to rewrite cluster.json)
        self.children: dict[str, Child] = {}
        self._standbys: dict[str, asyncio.subprocess.Process] = {}
        self._standby_ready: set[str] = set()
        self._standby_waits: set[asyncio.Task[None]] = set()
        self._healer: asyncio.Task[None] | None = None
        self._rewatch = asyncio.Event()
        self._stopping = False

    async def _spawn(self, spec: ServiceSpec) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{spec.name}.log"
        env = {**os.environ, **spec.env}
        old = self.children.get(spec.name)
        proc = await self._take_standby(spec)
        if proc is None:
            # a restart appends to the log, so the crash that caused it stays readable
            with log_path.open("ab" if old is not None else "wb") as out:
                proc = await asyncio.create_subprocess_exec(
                    *spec.argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out,
                    stderr=asyncio.subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                    preexec_fn=_die_with_parent if sys.platform == "linux" else None,
                )
        child = Child(spec, proc, log_path, time.monotonic())
        if old is not None:
            child.restarts, child.crashes, child.last_exit = old.restarts, old.crashes, old.last_exit
        self.children[spec.name] = child
        log.info("started %s (pid %d): %s", spec.name, proc.pid, " ".join(spec.argv))
        return child

    async def _start_standby(self, spec: ServiceSpec) -> None:
        """Starts the standby of `spec` (if it preloads anything and has none alive)."""
        current = self._standbys.get(spec.name)
        if not spec.preload or self._stopping or (current is not None and current.returncode is None):
            return
        python, dash_m, module, *args = spec.argv
        if (dash_m, module) != ("-m", "switchyard"):
            return  # only `python -m switchyard ...` services have a standby
        log_path = self.log_dir / f"{spec.name}.log"
        with log_path.open("ab") as out:
            proc = await asyncio.create_subprocess_exec(
                python, "-m", "switchyard.standby", ",".join(spec.preload), str(log_path), "--", *args,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=out,
                env={**os.environ, **spec.env}, start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )  # fmt: skip
        self._standbys[spec.name] = proc
        self._standby_ready.discard(spec.name)

        async def await_ready() -> None:
            assert proc.stdout is not None
            if (await proc.stdout.readline()).strip() == b"ready" and self._standbys.get(spec.name) is proc:
                self._standby_ready.add(spec.name)
                self._changed()

        task = asyncio.create_task(await_ready())
        self._standby_waits.add(task)
        task.add_done_callback(self._standby_waits.discard)

    def standby(self, name: str) -> str:
        """The standby of a service: ready (imports done), starting, or "" (none)."""
        proc = self._standbys.get(name)
        if proc is None or proc.returncode is not None:
            return ""
        return "ready" if name in self._standby_ready else "starting"

    async def _take_standby(self, spec: ServiceSpec) -> asyncio.subprocess.Process | None:
        """The standby of `spec`, told to become the service; None if there is none alive."""
        proc = self._standbys.pop(spec.name, None)
        self._standby_ready.discard(spec.name)
        if proc is None or proc.returncode is not None or proc.stdin is None:
            return None
        try:
            proc.stdin.write(b"go\n")
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):  # it died meanwhile
            return None
        self.say(f"  {spec.name} restarted from its standby (pid {proc.pid}, imports done)")
        return proc

    async def _stop_standbys(self) -> None:
        for task in list(self._standby_waits):
            task.cancel()
        for proc in self._standbys.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self._standbys.values():
            await proc.wait()
        self._standbys.clear()

    async def probe(self, spec: ServiceSpec) -> str:
        """The one-word health of a service as the status table shows it."""
        if spec.probe == "temporal":
            return await health.temporal_health(spec.address, self.namespace)
        if spec.probe == "process":
            temporal = self._temporal_address()
            pollers = await health.temporal_pollers(temporal, self.namespace, self.task_queue)
            return health.SERVING if pollers > 0 else "NO_POLLER"
        # the router's port is its public one: API keys, no client certificates
        public = tls.Security.plaintext() if spec.name == "router" else None
        return await health.grpc_health(spec.address, security=public, expect=spec.name)

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
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)
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
                await self._wait_ready(child, stop)
            except StartupFailed as exc:
                log.warning("%s failed to restart: %s", name, exc)
                if child.proc.returncode is None:  # unhealthy for too long: kill it, try again
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(child.pid, signal.SIGKILL)
                    await child.proc.wait()
                continue
            child.state = "running"
            self._rewatch.set()
            await self._start_standby(child.spec)  # for the next crash, once this one is up
            self._changed()
            return

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:  # a status file that cannot be written must not stop healing
                log.exception("could not record the cluster's state")

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
        child.state = "stopped"
        self.say(f"  stopped {child.spec.name} (exit {child.proc.returncode})")

    async def stop(self, grace_s: float = 20.0) -> None:
        """Drains and stops every child: router and worker first, then the rest together."""
        self._stopping = True
        if self._healer is not None:
            self._healer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._healer
        await self._stop_standbys()
        front = [self.children[n] for n in FRONT_FIRST if n in self.children]
        rest = [c for n, c in self.children.items() if n not in FRONT_FIRST]
        for child in front:
            await self._stop_one(child, grace_s)
        await asyncio.gather(*(self._stop_one(c, grace_s) for c in rest))

    def pids(self) -> dict[str, int]:
        return {name: c.pid for name, c in self.children.items()}
