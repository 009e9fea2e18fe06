"""Trial activities: one class, its dependencies (connections, clock) injected by the worker.

Each activity does one phase step for one path and heartbeats while it waits, with details
an operator can read in the Temporal UI (phase, progress). Measurement (performance.py) and
ledger writes (ledger_activities.py) live in their own modules; this one prepares paths,
runs the fixed inputs and asks the evaluator.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from temporalio import activity

from switchyard.gen.inference import grpc_service_pb2 as oip
from switchyard.gen.switchyard.v1 import evaluator_pb2 as epb
from switchyard.gen.switchyard.v1 import executor_pb2 as xpb
from workflows import distributed_training, payloads
from workflows.connections import Connections, grpc_errors
from workflows.spec import TrainingPlan
from workflows.types import (
    CompareRequest,
    CorrectnessResult,
    InputsCompatibility,
    LoadCompatibility,
    LossComparison,
    OutputVerdict,
    PathInfo,
    PrepareResult,
    RunRequest,
    RunResult,
    ServingConfig,
    Target,
    TensorData,
    TrainRequest,
    TrainResult,
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
        return ServingConfig(
            model_name=m.name,
            version=m.version,
            mode=m.mode,
            precision=m.precision,
            batch_buckets=list(m.batch_buckets),
            dynamic_batching=m.dynamic_batching,
            max_queue_delay_us=m.max_queue_delay_us,
            max_queue_size=m.max_queue_size,
            checkpoint_sha256=m.checkpoint_sha256,
        )

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
            from services.router.capture import distribution

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

    @activity.defn(name="compare_outputs")
    async def compare_outputs(self, request: CompareRequest) -> CorrectnessResult:
        golden = {t.name: t for t in request.golden}
        repeat = {t.name: t for t in request.reference_repeat}
        candidate = {t.name: t for t in request.candidate}
        candidate_repeat = {t.name: t for t in request.candidate_repeat}
        c = request.criteria
        wanted = list(c.outputs or [t.name for t in request.reference])
        criteria = epb.Criteria(
            precision=request.target.precision,
            error_multiplier=c.error_multiplier,
            min_cosine=c.min_cosine,
            min_top1_agreement=c.min_top1_agreement,
            min_topk_agreement=c.min_topk_agreement,
            top_k=c.top_k,
            max_kl=c.max_kl,
            logits=c.logits,
            atol_floor=c.atol_floor,
        )
        verdicts: list[OutputVerdict] = []
        for ref in request.reference:
            if ref.name not in wanted:
                continue
            cand = candidate.get(ref.name)
            if cand is None:
                verdicts.append(OutputVerdict(ref.name, False, {}, [f"output {ref.name} missing"], ""))
                continue

            def tensor(t: TensorData | None) -> epb.Tensor | None:
                return (
                    None
                    if t is None
                    else epb.Tensor(datatype=t.datatype, shape=t.shape, data=payloads.raw(t))
                )

            with grpc_errors(f"Compare {ref.name} of {request.target.path}"):
                r = await self.connections.evaluator().Compare(
                    epb.CompareRequest(
                        output_name=ref.name,
                        reference=tensor(ref),
                        candidate=tensor(cand),
                        golden=tensor(golden.get(ref.name)),
                        reference_repeat=tensor(repeat.get(ref.name)),
                        criteria=criteria,
                        candidate_repeat=tensor(candidate_repeat.get(ref.name)),
                    ),
                    timeout=120,
                )
            metrics = {f.name: getattr(r.metrics, f.name) for f in r.metrics.DESCRIPTOR.fields}
            verdicts.append(
                OutputVerdict(ref.name, r.passed, metrics, list(r.reasons), r.justification, r.finding)
            )
        return CorrectnessResult(bool(verdicts) and all(v.passed for v in verdicts), verdicts)

    async def _train_call(self, target: Target, request: xpb.TrainRequest, what: str) -> xpb.TrainResponse:
        started = self.clock()
        with grpc_errors(f"{what} {target.model} on {target.path}"):
            response: xpb.TrainResponse = await heartbeating(
                self.connections.control(target.executor).Train(request),
                lambda: {
                    "phase": "training",
                    "path": target.path,
                    "run": what,
                    "elapsed_s": round(self.clock() - started, 1),
                },
            )
        return response

    async def _compare_loss(
        self, target: Target, plan: TrainingPlan, reference: list[float], candidate: list[float]
    ) -> LossComparison:
        with grpc_errors(f"CompareLoss for {target.path}"):
            c = await self.connections.evaluator().CompareLoss(
                epb.CompareLossRequest(
                    reference=reference,
                    candidate=candidate,
                    target_loss=plan.target_loss,
                    max_relative_deviation=plan.max_relative_deviation,
                    precision=target.precision,
                ),
                timeout=60,
            )
        return LossComparison(
            passed=c.passed,
            deviation=list(c.deviation),
            max_relative_deviation=c.max_relative_deviation,
            reference_steps_to_target=c.reference_steps_to_target,
            candidate_steps_to_target=c.candidate_steps_to_target,
            reasons=list(c.reasons),
            justification=c.justification,
        )

    @activity.defn(name="train_path")
    async def train_path(self, request: TrainRequest) -> TrainResult:
        target, plan = request.target, request.plan
        if plan.distributed is not None:
            return await self._train_distributed(request)
        response = await self._train_call(
            target,
            xpb.TrainRequest(
                model_name=target.model,
                version=target.version,
                steps=plan.steps,
                lr=plan.lr,
                seed=plan.seed,
                batch_size=plan.batch_size,
            ),
            "Train",
        )
        result = TrainResult(list(response.loss), list(response.step_seconds), response.total_s)
        if request.reference_loss:
            result.comparison = await self._compare_loss(target, plan, request.reference_loss, result.loss)
        return result

    async def _train_distributed(self, request: TrainRequest) -> TrainResult:
        """Single-process run, then the distributed run, on this path (distributed_training)."""
        target, plan = request.target, request.plan
        assert plan.distributed is not None
        world = plan.distributed.world_size
        label = f"{target.trial_id}/{target.path}"
        single = await self._train_call(
            target,
            distributed_training.request(target.model, target.version, plan, 1, label),
            "Train world 1",
        )
        distributed_training.check(single, target.path, "the single-process run")
        multi = await self._train_call(
            target,
            distributed_training.request(target.model, target.version, plan, world, label),
            f"Train world {world}",
        )
        distributed_training.check(multi, target.path, "the distributed run")
        one, many = distributed_training.summary(single), distributed_training.summary(multi)
        own = await self._compare_loss(target, plan, list(single.loss), list(multi.loss))
        report = {
            "single_process": one,
            "distributed": many,
            "scaling": distributed_training.scaling(one, many),
            "against_single_process": dataclasses.asdict(own),
        }
        result = TrainResult(
            list(multi.loss), list(multi.step_seconds), single.total_s + multi.total_s, distributed=report
        )
        if request.reference_loss:
            result.comparison = await self._compare_loss(target, plan, request.reference_loss, result.loss)
        # a distributed curve that leaves its own single-process curve fails the path's training
        if not own.passed:
            c = result.comparison or LossComparison(False, [], 0.0, 0, 0, [], "")
            why = "distributed curve differs from the single-process curve on this path: "
            c.passed, c.reasons = False, [*c.reasons, why + "; ".join(own.reasons)]
            result.comparison = c
        return result
