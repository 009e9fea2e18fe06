"""Path activities: one class, its dependencies (connections, clock) injected by the worker.

Each activity does one phase step for one path and heartbeats while it waits, with details
an operator can read in the Temporal UI (phase, progress). Measurement (performance.py),
comparison (comparison_activities.py), training (training_activities.py) and ledger writes
(ledger_activities.py) live in their own modules; this one prepares paths and runs the fixed
inputs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from temporalio import activity

from switchyard.field_copy import copy_fields
from switchyard.gen.inference import grpc_service_pb2 as oip
from switchyard.gen.switchyard.v1 import executor_pb2 as xpb
from workflows.activities import payloads
from workflows.activities.connections import Connections, grpc_errors
from workflows.pipeline.types import (
    InputsCompatibility,
    LoadCompatibility,
    PathInfo,
    PrepareResult,
    RunRequest,
    RunResult,
    ServingConfig,
    Target,
    TensorData,
)

T = TypeVar("T")
Clock = Callable[[], float]


def now_us(clock: Clock = time.time) -> int:
    return int(clock() * 1_000_000)


async def heartbeating(work: Awaitable[T], details: Callable[[], dict[str, Any]], every_s: float = 1.0) -> T:
    """Await `work`, heartbeating every `every_s` so a dead worker is noticed within the timeout."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=every_s)
        if done:
            return task.result()
        activity.heartbeat(details())


def _load_request(target: Target, precision: str, mode: str, buckets: list[int]) -> xpb.LoadModelRequest:
    return xpb.LoadModelRequest(
        model_name=target.model,
        version=target.version,
        mode=mode,
        precision=precision,
        batch_buckets=buckets,
        dynamic_batching=False,  # one request = one batch, so timings are not batching artefacts
        checkpoint_sha256=target.checkpoint_sha256,
    )


def load_compatibility(report: xpb.CompatibilityReport) -> LoadCompatibility:
    return LoadCompatibility(
        fallback_ops={op.op: op.count for op in report.fallback_ops},
        graph_breaks=report.graph_breaks,
        graph_break_reasons=list(report.graph_break_reasons),
        recompiles=report.recompiles,
        unsupported_dtypes=list(report.unsupported_dtypes),
        adaptations=list(report.adaptations),
        compilations=report.compilations,
        cached_compilations=report.cached_compilations,
        compile_time_s=report.compile_time_s,
        compilations_after_warmup=report.compilations_after_warmup,
        notes=list(report.notes),
    )


def serving_compatibility(
    before: xpb.CompatibilityReport | None, after: xpb.CompatibilityReport | None, requests: int
) -> InputsCompatibility:
    """What `requests` requests did to a model's counters: host-fallback calls (in all and
    per request) and compilations after warm-up (a new shape on the trial's own inputs)."""
    if before is None or after is None or requests < 1:
        return InputsCompatibility(unknown="the executor did not report its counters around the requests")
    old = {op.op: op.count for op in before.fallback_ops_after_warmup}
    calls = {
        op.op: op.count - old.get(op.op, 0)
        for op in after.fallback_ops_after_warmup
        if op.count - old.get(op.op, 0) > 0
    }
    return InputsCompatibility(
        requests=requests,
        fallback_ops=dict(sorted(calls.items())),
        fallback_ops_per_request={op: n / requests for op, n in sorted(calls.items())},
        compilations=int(after.compilations_after_warmup - before.compilations_after_warmup),
    )


class PathActivities:
    """Activities that act on an executor or the evaluator for one path."""

    def __init__(self, connections: Connections, clock: Clock = time.time) -> None:
        self.connections = connections
        self.clock = clock

    @activity.defn(name="describe_path")
    async def describe_path(self, target: Target) -> PathInfo:
        with grpc_errors(f"Describe on {target.executor} for path {target.path}"):
            d = await self.connections.control(target.executor).Describe(xpb.DescribeRequest(), timeout=30)
        host = self.connections.host_of(target.executor, d.host or "unknown-host")
        return PathInfo(
            path=target.path,
            address=self.connections.executor_address(target.executor),
            host=host,
            backend=d.device.backend,
            device_name=d.device.device_name,
            device_count=d.device.device_count,
            memory_total_bytes=d.device.memory_total_bytes,
            resource_class=d.resource_class,
            price_key=d.price_key,
            torch_version=d.torch_version,
            versions=dict(d.versions),
            ledger_path=f"{target.path}@{host}",
            registered_models=list(d.registered_models),
        )

    @activity.defn(name="serving_config")
    async def serving_config(self, target: Target) -> ServingConfig | None:
        """How the executor serves this model now (LoadModelRequest fields), None if it does not.

        A trial loads the model its own way (fp64 golden, its buckets and mode) on executors
        that may be serving it; cleanup puts this configuration back instead of unloading.
        """
        request = xpb.ModelStatusRequest(model_name=target.model, version=target.version)
        try:
            status = await self.connections.control(target.executor).ModelStatus(request, timeout=30)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise
        ready = [m for m in status.models if m.state == "READY"]
        if not ready:
            return None
        m = ready[0]
        return copy_fields(ServingConfig, m, model_name=m.name, batch_buckets=list(m.batch_buckets))

    @activity.defn(name="prepare_path")
    async def prepare_path(self, target: Target) -> PrepareResult:
        started = self.clock()
        started_us = now_us(self.clock)
        request = _load_request(target, target.precision, target.mode, target.batch_buckets)
        with grpc_errors(f"LoadModel {target.model} ({target.mode}, {target.precision}) on {target.path}"):
            response = await heartbeating(
                self.connections.control(target.executor).LoadModel(request),
                lambda: {
                    "phase": "prepare",
                    "path": target.path,
                    "elapsed_s": round(self.clock() - started, 1),
                },
            )
        m = response.model
        return PrepareResult(
            checkpoint_load_s=m.timings.checkpoint_load_s,
            to_device_s=m.timings.to_device_s,
            compile_s=m.timings.compile_s,
            total_s=m.timings.total_s,
            checkpoint_sha256=m.checkpoint_sha256,
            compatibility=load_compatibility(m.compatibility),
            state=m.state,
            started_unix_us=started_us,
            ended_unix_us=now_us(self.clock),
        )

    @activity.defn(name="run_inputs")
    async def run_inputs(self, request: RunRequest) -> RunResult:
        """The fixed inputs through a path; `golden` loads the model in fp64 (eager) first."""
        target = request.target
        replay = payloads.workload_requests(request.inputs) if request.inputs.workload else []
        inputs = payloads.make_inputs(request.inputs) if not replay else []
        rows = sorted({int(r.inputs[0].shape[0]) for r in replay}) or [int(inputs[0][2].shape[0])]
        started = now_us(self.clock)
        if request.golden:
            load = _load_request(target, "fp64", "eager", rows)
            with grpc_errors(f"LoadModel {target.model} in fp64 for the golden run on {target.path}"):
                await heartbeating(
                    self.connections.control(target.executor).LoadModel(load),
                    lambda: {"phase": "golden", "path": target.path},
                )
        before = None if request.golden else await self._serving_counters(target)
        workload: dict[str, Any] = {}
        if replay:  # every captured request in order, each with its own shape
            runs, busy_us = await self._replay(request, replay)
            from switchyard.judge.capture_format import distribution

            summary = {"workload": request.inputs.workload, "sha256": request.inputs.workload_sha256}
            workload = {**summary, **distribution(replay)}
        else:
            runs, busy_us = await self._repeat(request, inputs)
        compat = None
        if before is not None:
            after = await self._serving_counters(target)
            compat = serving_compatibility(before, after, request.repeats * (len(replay) or 1))
        return RunResult(runs, busy_us, started, now_us(self.clock), workload, compat)

    async def _infer(
        self, target: Target, req: oip.ModelInferRequest, what: str
    ) -> tuple[list[TensorData], int]:
        """One request: its outputs and the device time the executor reports for it."""
        with grpc_errors(f"ModelInfer {target.model}{what} on {target.path}"):
            response = await self.connections.oip(target.executor).ModelInfer(req, timeout=120)
        compute = response.parameters.get("compute_us")
        return payloads.outputs_of(response), compute.int64_param if compute is not None else 0

    async def _replay(
        self, request: RunRequest, replay: list[oip.ModelInferRequest]
    ) -> tuple[list[list[TensorData]], int]:
        target, runs, busy_us = request.target, [], 0
        for i in range(request.repeats):
            outputs = []
            for k, captured in enumerate(replay):
                req = payloads.retarget(
                    captured, target.model, target.version, f"{target.trial_id}/{target.path}/{i}/{k}"
                )
                tensors, busy = await self._infer(target, req, f" (workload request {k})")
                outputs.append(tensors)
                busy_us += busy
            runs.append(payloads.combine(outputs))
            activity.heartbeat({"phase": "golden" if request.golden else "correctness", "run": i + 1})
        return runs, busy_us

    async def _repeat(
        self, request: RunRequest, inputs: list[tuple[str, str, Any]]
    ) -> tuple[list[list[TensorData]], int]:
        target, runs, busy_us = request.target, [], 0
        for i in range(request.repeats):
            req = payloads.infer_request(
                target.model, target.version, inputs, f"{target.trial_id}/{target.path}/{i}"
            )
            tensors, busy = await self._infer(target, req, "")
            runs.append(tensors)
            busy_us += busy
            activity.heartbeat({"phase": "golden" if request.golden else "correctness", "run": i + 1})
        return runs, busy_us

    async def _serving_counters(self, target: Target) -> xpb.CompatibilityReport | None:
        """The model's counters now (None where the executor cannot say: then the findings
        per request are unknown, which the verdict says, rather than a failed phase)."""
        request = xpb.ModelStatusRequest(model_name=target.model, version=target.version)
        try:
            status = await self.connections.control(target.executor).ModelStatus(request, timeout=30)
        except grpc.aio.AioRpcError:
            return None
        return status.models[0].compatibility if status.models else None
