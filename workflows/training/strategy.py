"""The training trial kind: a tensor trial (workflows/tensor/strategy.py) whose paths also train
(`training` in the spec), once or single-process then distributed (workflows/training/
distributed.py), each candidate's loss curve judged against the reference's.

`TrainingSteps` add the training phase to the tensor steps; `TRAINING` is the kind: the tensor
criteria with the training criterion before cost, and the training's report sections. The
steps run in the workflow sandbox: they only schedule activities and await events.
"""

from __future__ import annotations

import asyncio

from temporalio import workflow

from workflows.pipeline.context import TrialContext
from workflows.pipeline.kind import KindRender, PathSteps
from workflows.pipeline.path_ledger import PathLedger
from workflows.pipeline.path_state import PathState
from workflows.pipeline.types import Target, TrainRequest
from workflows.report.results import PASS
from workflows.spec.trial_io import Verdict
from workflows.spec.trial_spec import Policy
from workflows.tensor import verdict as tensor_verdict
from workflows.tensor.strategy import TensorKind, TensorSteps
from workflows.training.activities import TrainingActivities
from workflows.training.render import TRAINING_RENDER
from workflows.training.verdict import training


class TrainingSteps(TensorSteps):
    def __init__(self, ctx: TrialContext, target: Target, state: PathState, ledger: PathLedger) -> None:
        super().__init__(ctx, target, state, ledger)
        self.loss: list[float] = []  # the reference's curve, for the candidates to meet
        self.loss_ready = asyncio.Event()

    def release(self) -> None:
        super().release()
        self.loss_ready.set()

    async def training(self, reference: TensorSteps, passed: bool) -> None:
        plan = self.ctx.spec.training
        if plan is None or not passed:
            return
        assert isinstance(reference, TrainingSteps)
        ref_loss: list[float] = []
        if not self.state.is_reference:
            await reference.loss_ready.wait()
            if not reference.loss:
                self.state.training_skipped = "the reference produced no loss curve"
                return
            ref_loss = reference.loss
        started = workflow.now()
        result = await self.ctx.call(TrainingActivities.train_path, TrainRequest(self.target, plan, ref_loss))
        self.state.training = result
        if self.state.is_reference:
            self.loss = result.loss
            self.loss_ready.set()
        start_us, busy_us = int(started.timestamp() * 1e6), int(result.total_s * 1e6)
        await self.ledger.usage("training", busy_us, start_us, start_us + busy_us)


class TrainingKind(TensorKind):
    name = "training"
    render: KindRender = TRAINING_RENDER

    def steps(self, ctx: TrialContext, target: Target, state: PathState, ledger: PathLedger) -> PathSteps:
        return TrainingSteps(ctx, target, state, ledger)

    def judge(self, reference: PathState, candidate: PathState, policy: Policy) -> Verdict:
        criteria = tensor_verdict.criteria(reference, candidate, policy)
        cost = criteria.pop("cost")  # the criteria read in the pipeline's order: training, then cost
        correct = criteria["correctness"].result == PASS
        criteria["training"] = training(candidate, policy, correct)
        criteria["cost"] = cost
        return Verdict.of(criteria)


TRAINING = TrainingKind()
