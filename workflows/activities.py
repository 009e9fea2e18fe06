"""Trial activities: one class, its dependencies (connections, clock) injected by the worker.

Each activity does one phase step for one path and heartbeats while it waits, with details
an operator can read in the Temporal UI (phase, progress). Measurement (performance.py) and
ledger writes (ledger_activities.py) live in their own modules; this one prepares paths,
runs the fixed inputs and asks the evaluator.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from temporalio import activity

from switchyard.gen.switchyard.v1 import evaluator_pb2 as epb
from switchyard.gen.switchyard.v1 import executor_pb2 as xpb
from workflows import distributed_training, payloads
from workflows.connections import Connections, grpc_errors
from workflows.types import (
    CompareRequest,
    CorrectnessResult,
    OutputVerdict,
    PathInfo,
    PrepareResult,
    RunRequest,
    RunResult,
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


def compatibility_dict(report: xpb.CompatibilityReport) -> dict[str, Any]:
    return {
        "fallback_ops": {op.op: op.count for op in report.fallback_ops},
        "graph_breaks": report.graph_breaks,
        "graph_break_reasons": list(report.graph_break_reasons),
        "recompiles": report.recompiles,
        "unsupported_dtypes": list(report.unsupported_dtypes),
        "adaptations": list(report.adaptations),
        "compilations": report.compilations,
        "compile_time_s": report.compile_time_s,
        "compilations_after_warmup": report.compilations_after_warmup,
        "notes": list(report.notes),
    }


def serving_compatibility(
    before: xpb.CompatibilityReport | None, after: xpb.CompatibilityReport | None, requests: int
) -> dict[str, Any]:
    """What `requests` requests did to a model's counters: host-fallback calls (in all and
    per request) and compilations after warm-up (a new shape on the trial's own inputs)."""
    if before is None or after is None or requests < 1:
        return {"unknown": "the executor did not report its counters around the requests"}
    old = {op.op: op.count for op in before.fallback_ops_after_warmup}
    calls = {
        op.op: op.count - old.get(op.op, 0)
        for op in after.fallback_ops_after_warmup
        if op.count - old.get(op.op, 0) > 0
    }
    return {
        "requests": requests,
        "fallback_ops": dict(sorted(calls.items())),
        "fallback_ops_per_request": {op: n / requests for op, n in sorted(calls.items())},
        "compilations": int(after.compilations_after_warmup - before.compilations_after_warmup),
    }


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
        )

    @activity.defn(name="serving_config")
    async def serving_config(self, target: Target) -> dict[str, Any]:
        """How the executor serves this model now (LoadModelRequest fields), {} if it does not.

        A trial loads the model its own way (fp64 golden, its buckets and mode) on executors
        that may be serving it; cleanup puts this configuration back instead of unloading.
        """
        request = xpb.ModelStatusRequest(model_name=target.model, version=target.version)
        try:
            status = await self.connections.control(target.executor).ModelStatus(request, timeout=30)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return {}
            raise
        ready = [m for m in status.models if m.state == "READY"]
        if not ready:
            return {}
        m = ready[0]
        return {
            "model_name": m.name,
            "version": m.version,
            "mode": m.mode,
            "precision": m.precision,
            "batch_buckets": list(m.batch_buckets),
            "dynamic_batching": m.dynamic_batching,
            "max_queue_delay_us": m.max_queue_delay_us,
            "max_queue_size": m.max_queue_size,
            "checkpoint_sha256": m.checkpoint_sha256,
        }

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
            compatibility=compatibility_dict(m.compatibility),
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
        runs: list[list[TensorData]] = []
        busy_us = 0
        stub = self.connections.oip(target.executor)
        before = None if request.golden else await self._serving_counters(target)
        requests = request.repeats * (len(replay) or 1)
        workload: dict[str, Any] = {}
        if replay:  # every captured request in order, each with its own shape
            for i in range(request.repeats):
                outputs = []
                for k, captured in enumerate(replay):
                    req = payloads.retarget(
                        captured, target.model, target.version, f"{target.trial_id}/{target.path}/{i}/{k}"
                    )
                    with grpc_errors(f"ModelInfer {target.model} (workload request {k}) on {target.path}"):
                        response = await stub.ModelInfer(req, timeout=120)
                    compute = response.parameters.get("compute_us")
                    busy_us += compute.int64_param if compute is not None else 0
                    outputs.append(payloads.outputs_of(response))
                runs.append(payloads.combine(outputs))
                activity.heartbeat({"phase": "golden" if request.golden else "correctness", "run": i + 1})
            from services.router.capture import distribution

            summary = {"workload": request.inputs.workload, "sha256": request.inputs.workload_sha256}
            workload = {**summary, **distribution(replay)}
        for i in range(0 if replay else request.repeats):
            req = payloads.infer_request(
                target.model, target.version, inputs, f"{target.trial_id}/{target.path}/{i}"
            )
            with grpc_errors(f"ModelInfer {target.model} on {target.path}"):
                response = await stub.ModelInfer(req, timeout=120)
            compute = response.parameters.get("compute_us")
            busy_us += compute.int64_param if compute is not None else 0
            runs.append(payloads.outputs_of(response))
            activity.heartbeat({"phase": "golden" if request.golden else "correctness", "run": i + 1})
        compat: dict[str, Any] = {}
        if before is not None:
            after = await self._serving_counters(target)
            compat = serving_compatibility(before, after, requests)
        return RunResult(runs, busy_us, started, now_us(self.clock), workload, compat)

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
        wanted = list(request.criteria.get("outputs") or [t.name for t in request.reference])
        c = request.criteria
        criteria = epb.Criteria(
            precision=request.target.precision,
            error_multiplier=c.get("error_multiplier", 0.0),
            min_cosine=c.get("min_cosine", 0.0),
            min_top1_agreement=c.get("min_top1_agreement", 0.0),
            min_topk_agreement=c.get("min_topk_agreement", 0.0),
            top_k=c.get("top_k", 0),
            max_kl=c.get("max_kl", 0.0),
            logits=c.get("logits", False),
            atol_floor=c.get("atol_floor", 0.0),
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
        self, target: Target, plan: dict[str, Any], reference: list[float], candidate: list[float]
    ) -> dict[str, Any]:
        with grpc_errors(f"CompareLoss for {target.path}"):
            c = await self.connections.evaluator().CompareLoss(
                epb.CompareLossRequest(
                    reference=reference,
                    candidate=candidate,
                    target_loss=plan.get("target_loss", 0.0),
                    max_relative_deviation=plan.get("max_relative_deviation", 0.0),
                    precision=target.precision,
                ),
                timeout=60,
            )
        return {
            "passed": c.passed,
            "deviation": list(c.deviation),
            "max_relative_deviation": c.max_relative_deviation,
            "reference_steps_to_target": c.reference_steps_to_target,
            "candidate_steps_to_target": c.candidate_steps_to_target,
            "reasons": list(c.reasons),
            "justification": c.justification,
        }

    @activity.defn(name="train_path")
    async def train_path(self, request: TrainRequest) -> TrainResult:
        target, plan = request.target, request.plan
        if plan.get("distributed"):
            return await self._train_distributed(request)
        response = await self._train_call(
            target,
            xpb.TrainRequest(
                model_name=target.model,
                version=target.version,
                steps=plan["steps"],
                lr=plan["lr"],
                seed=plan["seed"],
                batch_size=plan["batch_size"],
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
        world = int(plan["distributed"]["world_size"])
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
        report = {
            "single_process": one,
            "distributed": many,
            "scaling": distributed_training.scaling(one, many),
            "against_single_process": await self._compare_loss(
                target, plan, list(single.loss), list(multi.loss)
            ),
        }
        result = TrainResult(
            list(multi.loss), list(multi.step_seconds), single.total_s + multi.total_s, distributed=report
        )
        if request.reference_loss:
            result.comparison = await self._compare_loss(target, plan, request.reference_loss, result.loss)
        # a distributed curve that leaves its own single-process curve fails the path's training
        if not report["against_single_process"]["passed"]:
            result.comparison = result.comparison or {"passed": False, "reasons": []}
            result.comparison["passed"] = False
            result.comparison["reasons"] = [
                *result.comparison.get("reasons", []),
                "distributed curve differs from the single-process curve on this path: "
                + "; ".join(report["against_single_process"]["reasons"]),
            ]
        return result
