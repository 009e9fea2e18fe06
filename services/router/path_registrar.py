"""The router registers its deployments' ledger paths with metering, so usage is never refused.

Metering records usage only on a registered path. A router knows each deployment's path id
from its routes file; the rest of a registration (backend, resource class, price key, host)
is what the executor's Describe reports. So at start, and again whenever the routes in force
change, every deployment the routes name is queued here and registered in the background:
Describe the executor, then RegisterPath. Registration is idempotent (same settings: the
existing row), so re-queuing a registered deployment costs two small RPCs and nothing else.

Nothing waits on it: requests are served meanwhile, and usage that reaches metering before
its path is registered waits in the spool (metering answers NOT_FOUND, which the spool keeps
for a later replay). A deployment whose executor or metering does not answer is retried with
exponential back-off (`RETRY_BASE_S` doubling up to `RETRY_MAX_S`). A path whose price key
has no price in force is still registered: its usage is recorded unpriced, and reports show
it as such, until an operator sets a price (`switchyard prices set`).

Two deployments may share a path id (replicas of one executor StatefulSet, say) but not its
settings: the first registration wins and a later one that differs (another host) is logged
once, since the path exists and usage on it is recorded either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import grpc

from services.router.router_config import Deployment, Route
from switchyard.errors import AlreadyExists, SwitchyardError, Unavailable
from switchyard.gen.switchyard.v1 import executor_pb2, executor_pb2_grpc
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb

log = logging.getLogger(__name__)

RETRY_BASE_S = 0.5
RETRY_MAX_S = 15.0
DESCRIBE_TIMEOUT_S = 5.0


class PathSink(Protocol):
    async def register_path(self, request: mpb.RegisterPathRequest) -> mpb.PathInfo: ...


@dataclass(frozen=True)
class Registered:
    deployment: str
    path: str
    backend: str
    resource_class: str
    price_key: str
    host: str


def routed_deployments(routes: Iterable[Route]) -> set[str]:
    """The deployments the routes send traffic to: targets and shadow candidates."""
    names: set[str] = set()
    for route in routes:
        names.update(t.deployment for t in route.targets)
        if route.shadow is not None:
            names.update(t.deployment for t in route.shadow.candidates)
    return names


class PathRegistrar:
    def __init__(
        self,
        sink: PathSink,
        deployments: Iterable[Deployment],
        channels: Mapping[str, grpc.aio.Channel],
    ) -> None:
        self._sink = sink
        self._deployments = {d.name: d for d in deployments}
        self._channels = channels
        self._pending: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._conflicts: set[str] = set()  # deployments already warned about
        self.registered: dict[str, Registered] = {}
        self.attempts = 0

    def want(self, names: Iterable[str]) -> None:
        """Queue these deployments for (re-)registration."""
        fresh = {n for n in names if n in self._deployments}
        if fresh - self._pending:
            self._pending |= fresh
            self._wake.set()

    def want_routes(self, routes: Iterable[Route]) -> None:
        self.want(routed_deployments(routes))

    @property
    def pending(self) -> set[str]:
        return set(self._pending)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="path-registrar")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def wait_registered(self, timeout_s: float) -> bool:
        """True once nothing is pending (for tests and the CLI)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout_s
        while self._pending and loop.time() < until:  # noqa: ASYNC110 (a test helper)
            await asyncio.sleep(0.05)
        return not self._pending

    async def _run(self) -> None:
        backoff: dict[str, float] = {}
        due: dict[str, float] = {}
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()  # before the work: a want() during it wakes the wait below
            now = loop.time()
            ready = sorted(n for n in self._pending if due.get(n, 0.0) <= now)
            for name in ready:
                try:
                    done = await self.register(name)
                except Exception:  # a bug must not stop registration for good
                    log.exception("registering the path of deployment %s failed; retrying", name)
                    done = False
                if done:
                    self._pending.discard(name)
                    backoff.pop(name, None)
                    due.pop(name, None)
                else:
                    wait = min(RETRY_MAX_S, backoff.get(name, RETRY_BASE_S / 2) * 2)
                    backoff[name] = wait
                    due[name] = loop.time() + wait
            waits = [due[n] - loop.time() for n in self._pending if n in due]
            timeout = max(0.05, min(waits)) if waits else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    async def register(self, name: str) -> bool:
        """One attempt; True when the path is registered (or cannot be, for good)."""
        self.attempts += 1
        deployment = self._deployments[name]
        try:
            described = await executor_pb2_grpc.ExecutorControlStub(self._channels[name]).Describe(
                executor_pb2.DescribeRequest(), timeout=DESCRIBE_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            log.info(
                "deployment %s: Describe failed (%s); registering path %s later",
                name, exc.code().name, deployment.path,
            )  # fmt: skip
            return False
        backend = described.device.backend or name
        request = mpb.RegisterPathRequest(
            path_info=mpb.PathInfo(
                path=deployment.path,
                backend=backend,
                resource_class=described.resource_class or backend,
                price_key=described.price_key or f"{backend}/{described.resource_class or backend}",
                host=described.host,
            ),
            actor=mpb.Actor(principal="router", source="router", request_id=f"register-path/{name}"),
        )
        try:
            info = await self._sink.register_path(request)
        except Unavailable as exc:
            log.info("metering unavailable (%s); registering path %s later", exc, deployment.path)
            return False
        except AlreadyExists as exc:
            if name not in self._conflicts:
                self._conflicts.add(name)
                log.warning(
                    "deployment %s: path %s is registered with other settings than its executor "
                    "reports (%s); its usage is recorded on the existing registration",
                    name, deployment.path, exc,
                )  # fmt: skip
            return True
        except SwitchyardError as exc:
            # bad input (a path id metering refuses): retrying cannot help; usage on it will
            # reach the spool's dead letters, which name the same reason
            log.error("deployment %s: metering refused path %s: %s", name, deployment.path, exc)
            return True
        self.registered[name] = Registered(
            name, info.path, info.backend, info.resource_class, info.price_key, info.host
        )
        log.info(
            "registered path %s for deployment %s (%s, %s, price key %s)",
            info.path, name, info.backend, info.resource_class, info.price_key,
        )  # fmt: skip
        return True
