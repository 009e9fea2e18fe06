"""The training phase's activity: the executor trains the path's model (once, or single-process
then distributed: workflows/training/distributed_phase.py) and the evaluator compares the loss
curves (CompareLoss), against the reference path's curve and a distributed run's own
single-process curve.
"""

from __future__ import annotations

import dataclasses
import time

from temporalio import activity

from switchyard.gen.switchyard.v1 import evaluator_pb2 as epb
from switchyard.gen.switchyard.v1 import executor_pb2 as xpb
from workflows.activities.connections import Connections, grpc_errors
from workflows.activities.path import Clock, heartbeating
from workflows.pipeline.types import LossComparison, Target, TrainRequest, TrainResult
from workflows.spec.trial_spec import TrainingPlan
from workflows.training import distributed_phase as distributed_training


class TrainingActivities:
    def __init__(self, connections: Connections, clock: Clock = time.time) -> None:
        self.connections = connections
        self.clock = clock

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
