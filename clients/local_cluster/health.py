"""Health and readiness probes for the local cluster: grpc.health.v1, Temporal, model status.

One probe per kind of process, each returning a short word for the status table rather than
raising: a cluster status that cannot be read is itself a status ("unreachable").
"""

from __future__ import annotations

import argparse
import asyncio
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from switchyard import tls
from switchyard.gen.switchyard.v1 import executor_pb2, executor_pb2_grpc

if TYPE_CHECKING:
    from temporalio.service import TLSConfig

T = TypeVar("T")

SERVING = "SERVING"
NOT_SERVING = "NOT_SERVING"
UNREACHABLE = "UNREACHABLE"


async def grpc_health(
    address: str,
    service: str = "",
    timeout_s: float = 2.0,
    security: tls.Security | None = None,
    expect: str = "",
) -> str:
    """The grpc.health.v1 status of `service` at `address` (SERVING, NOT_SERVING, ...), over
    this process's mTLS (or `security`: plaintext for the router's public port), the server
    checked to be `expect` (metering, executor-cpu, ...; "" = this process's own identity: a
    container checking itself)."""
    security = tls.resolve(security)
    expect = expect or security.identity
    async with tls.aio_channel(address, security=security, expect=expect) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return "UNKNOWN_SERVICE"
            return UNREACHABLE
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


async def temporal_health(address: str, namespace: str = "default", timeout_s: float = 3.0) -> str:
    """SERVING once the Temporal frontend answers and the namespace exists."""
    from temporalio.client import Client  # the XLA env has no temporalio: import on use

    try:
        client = await asyncio.wait_for(Client.connect(address, namespace=namespace), timeout_s)
        ok = await asyncio.wait_for(client.service_client.check_health(), timeout_s)
    except Exception:  # a probe reports, it does not raise: any failure is 'unreachable'
        return UNREACHABLE
    return SERVING if ok else NOT_SERVING


async def http_health(address: str, timeout_s: float = 2.0) -> str:
    """SERVING once `GET /healthz` at `address` answers 200 (the audit witness)."""

    def get() -> int:
        with urllib.request.urlopen(f"http://{address}/healthz", timeout=timeout_s) as reply:
            return int(reply.status)

    try:
        return SERVING if await asyncio.to_thread(get) == 200 else NOT_SERVING
    except (OSError, ValueError):  # refused, timed out, or an HTTP error status
        return UNREACHABLE


@dataclass(frozen=True)
class ModelState:
    name: str
    version: str
    state: str  # LOADING | READY | FAILED | UNLOADED
    mode: str


async def executor_models(address: str, timeout_s: float = 3.0) -> list[ModelState] | None:
    """Models an executor holds and their state; None when it cannot be asked."""
    reply = await _ask_executor(
        address, lambda stub: stub.ModelStatus(executor_pb2.ModelStatusRequest(), timeout=timeout_s)
    )
    if reply is None:
        return None
    return [ModelState(m.name, m.version, m.state, m.mode) for m in reply.models]


def readiness_summary(models: list[ModelState] | None) -> str:
    """'3/3 ready' or the states that are not READY, for the status table."""
    if models is None:
        return "unknown"
    if not models:
        return "no models"
    ready = [m for m in models if m.state == "READY"]
    if len(ready) == len(models):
        return f"{len(ready)}/{len(models)} ready ({', '.join(m.name for m in models)})"
    waiting = ", ".join(f"{m.name}:{m.state}" for m in models if m.state != "READY")
    return f"{len(ready)}/{len(models)} ready; {waiting}"


def health_main(args: argparse.Namespace) -> int:
    """`switchyard health ADDRESS`: exit 0 when SERVING (container and compose health checks)."""
    status = asyncio.run(grpc_health(args.address, args.service, args.timeout, expect=args.identity))
    print(status)
    return 0 if status == SERVING else 1


async def temporal_pollers(
    address: str,
    namespace: str,
    task_queue: str,
    timeout_s: float = 3.0,
    temporal_tls: TLSConfig | bool = False,
) -> int:
    """How many workers poll `task_queue` for workflow tasks (a trial worker's readiness)."""
    from temporalio.api.enums.v1 import TaskQueueType
    from temporalio.api.taskqueue.v1 import TaskQueue
    from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
    from temporalio.client import Client

    try:
        client = await asyncio.wait_for(
            Client.connect(address, namespace=namespace, tls=temporal_tls), timeout_s
        )
        reply = await client.workflow_service.describe_task_queue(
            DescribeTaskQueueRequest(
                namespace=namespace,
                task_queue=TaskQueue(name=task_queue),
                task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
            ),
            timeout=timedelta(seconds=timeout_s),
        )
    except Exception:  # not reachable yet counts as no poller
        return 0
    return len(reply.pollers)


async def executor_host(address: str, timeout_s: float = 5.0) -> str:
    """The host id an executor reports (paths on one host never measure at once); "" if unknown."""
    reply = await _ask_executor(
        address, lambda stub: stub.Describe(executor_pb2.DescribeRequest(), timeout=timeout_s)
    )
    return "" if reply is None else str(reply.host)


async def executor_load(address: str, timeout_s: float = 3.0) -> tuple[int, int] | None:
    """(in flight, queue depth) an executor reports; None when it cannot be asked."""
    reply = await _ask_executor(
        address, lambda stub: stub.GetLoad(executor_pb2.GetLoadRequest(), timeout=timeout_s)
    )
    if reply is None:
        return None
    return int(reply.in_flight), int(reply.queue_depth)


async def _ask_executor(
    address: str, call: Callable[[executor_pb2_grpc.ExecutorControlAsyncStub], Awaitable[T]]
) -> T | None:
    """One ExecutorControl call; None when the executor cannot be asked (a status, not an error)."""
    async with tls.aio_channel(address, expect=tls.EXECUTOR) as channel:
        try:
            return await call(executor_pb2_grpc.ExecutorControlStub(channel))
        except grpc.aio.AioRpcError:
            return None
