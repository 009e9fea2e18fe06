"""The trial worker's connections: one grpc.aio channel per address, shared by all activities.

Executors are named in the spec by address ("host:port") or by a name the worker was told
about (`--executor cpu=127.0.0.1:8101`). gRPC failures become Temporal errors in one place:
statuses that retrying cannot fix (bad argument, unknown model, failed precondition, ...)
are non-retryable `ApplicationError`s carrying the server's message; UNAVAILABLE and
deadlines stay retryable.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
from temporalio.exceptions import ApplicationError

from switchyard import net, telemetry, tls
from switchyard.gen.inference import grpc_service_pb2_grpc as oip_grpc
from switchyard.gen.switchyard.v1 import evaluator_pb2_grpc as eval_grpc
from switchyard.gen.switchyard.v1 import executor_pb2_grpc as exec_grpc
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as meter_grpc
from workflows.temporal_link import TemporalLink, TemporalTLS

FINAL_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)


@dataclass(frozen=True)
class WorkerConfig:
    """Where the worker finds the services; parsed once from flags or environment."""

    temporal: str = "127.0.0.1:7233"
    namespace: str = "default"
    evaluator: str = "127.0.0.1:8301"
    metering: str = "127.0.0.1:8201"
    executors: dict[str, str] = field(default_factory=dict)
    task_queue: str = "switchyard-trials"
    # executor name or address -> host id, overriding Describe's; for executors whose own
    # hostname hides where they run (containers sharing a node share its cores)
    hosts: dict[str, str] = field(default_factory=dict)
    # the API key a trial started without a grant (Temporal UI or CLI) runs as: its principal's
    # roles are checked like a starter's (workflows/activities/authorization.py); "": such trials are refused
    ui_key: str = field(default="", repr=False)
    # TLS to Temporal where the cluster offers it, and the payload codec's keys
    # (workflows/temporal_link.py); off and "" = plaintext, payloads in clear
    tls: TemporalTLS = field(default_factory=TemporalTLS)
    codec_key_file: str = ""

    def link(self) -> TemporalLink:
        return TemporalLink(self.temporal, self.namespace, self.tls, self.codec_key_file)


class Connections:
    def __init__(self, config: WorkerConfig, security: tls.Security | None = None) -> None:
        """`security`: the worker's identity (None: the process's, from the environment)."""
        self.config = config
        self.security = tls.resolve(security)
        self._channels: dict[tuple[str, str], grpc.aio.Channel] = {}

    def channel(self, address: str, expect: str) -> grpc.aio.Channel:
        """One channel per (service, address), the server checked to be `expect` (tls.aio_channel)."""
        channel = self._channels.get((expect, address))
        if channel is None:
            options = net.CHANNEL_OPTIONS
            # with tracing on, each call is a CLIENT span of the activity's trace, its context
            # in the call's metadata (opentelemetry-instrumentation-grpc)
            channel = self._channels[(expect, address)] = tls.aio_channel(
                address, options, self.security, interceptors=telemetry.client_interceptors(), expect=expect
            )
        return channel

    def executor_address(self, executor: str) -> str:
        if executor in self.config.executors:
            return self.config.executors[executor]
        if ":" in executor:
            return executor
        known = ", ".join(sorted(self.config.executors)) or "none"
        raise ApplicationError(
            f"executor {executor!r} is neither host:port nor a name this worker knows ({known}); "
            "start the worker with --executor NAME=HOST:PORT",
            type="UnknownExecutor",
            non_retryable=True,
        )

    def host_of(self, executor: str, described: str) -> str:
        address = self.executor_address(executor)
        return self.config.hosts.get(executor) or self.config.hosts.get(address) or described

    def control(self, executor: str) -> exec_grpc.ExecutorControlAsyncStub:
        return exec_grpc.ExecutorControlStub(self.channel(self.executor_address(executor), tls.EXECUTOR))

    def oip(self, executor: str) -> oip_grpc.GRPCInferenceServiceAsyncStub:
        return oip_grpc.GRPCInferenceServiceStub(self.channel(self.executor_address(executor), tls.EXECUTOR))

    def evaluator(self) -> eval_grpc.EvaluatorAsyncStub:
        return eval_grpc.EvaluatorStub(self.channel(self.config.evaluator, tls.EVALUATOR))

    def metering(self) -> meter_grpc.MeteringAsyncStub:
        return meter_grpc.MeteringStub(self.channel(self.config.metering, tls.METERING))

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


@contextlib.contextmanager
def grpc_errors(what: str) -> Iterator[None]:
    """Turn a failed RPC into an ApplicationError saying what was being done."""
    try:
        yield
    except grpc.aio.AioRpcError as err:
        code = err.code()
        raise ApplicationError(
            f"{what}: {code.name}: {err.details()}",
            type=code.name,
            non_retryable=code in FINAL_CODES,
        ) from None
