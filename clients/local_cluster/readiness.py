"""When a service of `switchyard up` is ready: its health probe, and its models loaded.

Each kind of service has its probe (ServiceSpec.probe): Temporal answers its own health
check, the trial worker is ready once it polls its task queue, every other service answers
gRPC health (the router on its public port, without a client certificate). An executor is
ready only once every model it was started with is READY; a model that FAILED to load fails
the start at once instead of at the timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from clients.local_cluster import health
from clients.local_cluster.plan import ServiceSpec
from switchyard import tls
from switchyard.errors import FailedPrecondition, Unavailable
from workflows.temporal_link import TemporalTLS

# A starting service is probed after 0.05 s, then at doubling intervals up to every 0.5 s: a
# quick one (the router from its standby) is seen ready soon after it is, and a slow one (an
# executor loading its models) is not probed, a TLS handshake each, more than twice a second.
POLL_FIRST_S = 0.05
POLL_S = 0.5


class StartupFailed(Unavailable):
    """A service exited or stayed unhealthy while the cluster was starting."""


class Started(Protocol):
    """What readiness needs of a started child."""

    @property
    def spec(self) -> ServiceSpec: ...
    @property
    def started(self) -> float: ...
    @property
    def log_path(self) -> Path: ...
    @property
    def returncode(self) -> int | None: ...


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class Readiness:
    """Probes the services of one cluster, and waits for a starting one to be ready."""

    def __init__(
        self, specs: Sequence[ServiceSpec], namespace: str, task_queue: str, say: Callable[[str], None]
    ) -> None:
        self.specs = specs
        self.namespace = namespace
        self.task_queue = task_queue
        self.say = say

    async def probe(self, spec: ServiceSpec) -> str:
        """The one-word health of a service as the status table shows it."""
        if spec.probe == "temporal":
            return await health.temporal_health(spec.address, self.namespace)
        if spec.probe == "http":
            return await health.http_health(spec.address)
        if spec.probe == "process":
            temporal = self._temporal_address()
            # TLS as the worker dials it (a remote Temporal's [temporal] tls_*)
            security = TemporalTLS.from_env(spec.env).config()
            pollers = await health.temporal_pollers(
                temporal, self.namespace, self.task_queue, temporal_tls=security
            )
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

    async def wait_ready(self, child: Started, stop: asyncio.Event, origin: float | None = None) -> None:
        """Returns once `child` is ready (or `stop` is set); StartupFailed if it exits first
        or is still not ready at its spec's start-up timeout. Its "ready" line says how long
        it took, and with `origin` (the cluster's start, monotonic) when that was."""
        spec = child.spec
        deadline = child.started + spec.startup_timeout_s
        status = "starting"
        pause = POLL_FIRST_S
        while True:
            if child.returncode is not None:
                raise StartupFailed(
                    f"{spec.name} exited with code {child.returncode} while starting; "
                    f"last lines of {child.log_path}:\n{log_tail(child.log_path)}"
                )
            if stop.is_set():
                return
            status = await self.probe(spec)
            if status == health.SERVING and await self._models_ready(spec):
                now = time.monotonic()
                at = "" if origin is None else f" (at {now - origin:5.1f}s)"
                self.say(f"  {spec.name:<16} ready after {now - child.started:5.1f}s{at}")
                return
            if time.monotonic() > deadline:
                raise StartupFailed(
                    f"{spec.name} not ready after {spec.startup_timeout_s:.0f}s (health {status}); "
                    f"last lines of {child.log_path}:\n{log_tail(child.log_path)}"
                )
            await asyncio.sleep(pause)
            pause = min(POLL_S, pause * 2)

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
