"""One path's pipeline inside TrialWorkflow: prepare -> correctness -> performance -> training
-> economics, with the path's state kept typed (workflows/path_state.py) for the `progress`
query, the verdict and the report.

Runs in the workflow sandbox: it only schedules activities and awaits events. Every activity
is called by its method with one dataclass in and one out (`TrialContext.call`), so mypy sees
each call's types. A failed activity ends that path's measurement (the path becomes
INCONCLUSIVE with the reason), but its reservation is still closed and its cost still read,
so the ledger stays whole.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable
from typing import TypeVar

from temporalio import workflow
from temporalio.exceptions import ActivityError

from workflows.activities import PathActivities
from workflows.comparison_activities import ComparisonActivities
from workflows.generation_pipeline import GenerationSteps
from workflows.interleave import Alone, Interleaved
from workflows.ledger_activities import LedgerActivities
from workflows.path_ledger import PathLedger
from workflows.path_state import PathState
from workflows.performance import PerformanceActivities
from workflows.training_activities import TrainingActivities
from workflows.trial_context import PathProblem, TrialContext, reason_of
from workflows.types import (
    CompareRequest,
    CorrectnessResult,
    PathInfo,
    PerformanceRequest,
    RunRequest,
    RunResult,
    Target,
    TensorData,
    TrainRequest,
)

T = TypeVar("T")


def artifact_problem(path: Target, mine: str, reference: Target, theirs: str) -> str:
    """Why two paths of one model version do not run one artifact ("" if they do)."""
    if path.version != reference.version or mine == theirs:
        return ""
    return (
        f"FAILED_PRECONDITION: {path.model}:{path.version or 'default'} on {path.path} has artifact sha256 "
        f"{mine}, the reference {reference.path} has {theirs}: the executors' model repositories hold "
        "different files for one version; add the same artifact to both (`switchyard models add`) or "
        "pin model.checkpoint_sha256"
    )


async def reference_answers(ctx: TrialContext, request: PerformanceRequest) -> dict[str, list[TensorData]]:
    """The reference's answer to each batch size's inputs, one request each, before its
    measurement: a candidate measured at the same time on another host waits only for
    these. Not metered (a few requests; the measurement's idempotency keys are its own)."""
    if request.inputs.workload:
        return {}
    plan = dataclasses.replace(
        request.plan, warmup=0, min_iterations=1, min_seconds=0.0, offline_concurrency=1, blocks=1
    )
    probe = dataclasses.replace(request, plan=plan, ledger=False)
    return (await ctx.call(PerformanceActivities.measure_performance, probe)).answers


class PathRun:
    def __init__(self, ctx: TrialContext, target: Target, is_reference: bool, version_field: str) -> None:
        self.ctx = ctx
        self.target = target
        self.is_reference = is_reference
        self.version_field = version_field  # the spec field that names this path's version
        self.state = PathState(target.path, "reference" if is_reference else "candidate")
        self.ledger = PathLedger(ctx, target, self.state)
        self.model_problem = ""  # why the executor cannot load the model ("" = it can)
        self.golden: list[TensorData] = []
        self.runs: list[list[TensorData]] = []
        self.prepared = asyncio.Event()
        self.outputs_ready = asyncio.Event()
        self.answers: dict[str, list[TensorData]] = {}  # the reference's answer per batch size
        self.answers_ready = asyncio.Event()
        self.loss: list[float] = []
        self.loss_ready = asyncio.Event()
        # the paths it is measured with and the turns it keeps meanwhile (workflows/interleave.py)
        self.group: Alone | Interleaved = Alone(ctx)
        # a generative model's golden, correctness and performance steps (prompts, not tensors)
        self.generation = (
            GenerationSteps(ctx, target, self.state, self.ledger) if ctx.spec.generative else None
        )

    async def describe(self) -> PathInfo | None:
        """Describe the executor and register the path; refuse a model it does not hold."""
        try:
            info = await self.ctx.call(PathActivities.describe_path, self.target)
        except ActivityError as err:
            self.state.fail("prepare", f"Describe failed: {reason_of(err)}")
            return None
        self.state.host = info.host
        self.state.info = info
        self.target.ledger_path = info.ledger_path
        self.model_problem = info.model_problem(self.target, self.version_field)
        if self.model_problem:
            self.state.fail("prepare", self.model_problem)
            return info
        try:
            registered = await self.ctx.call(LedgerActivities.register_path, info)
            self.state.ledger_problem = registered.problem
        except ActivityError as err:
            self.state.ledger_problem = f"ledger: {reason_of(err)}"
        return info

    def _enter(self, phase: str) -> None:
        self.state.phase = phase
        self.state.status = "running"
        self.state.timeline[phase] = [workflow.now().isoformat()]

    def _leave(self) -> None:
        self.state.phases_done += 1
        self.state.timeline[self.state.phase].append(workflow.now().isoformat())

    async def pipeline(self, host_lock: asyncio.Lock, reference: PathRun) -> None:
        try:
            if self.state.errors:
                return
            async with host_lock:
                await self._pipeline(reference)
        except asyncio.CancelledError:
            self.state.status = "cancelled"
            raise
        finally:
            self._release()
            self.group.finished(self.target.path)

    def _release(self) -> None:
        """Whoever waits on this path's outputs need wait no longer: they are ready, or never."""
        for event in (self.prepared, self.outputs_ready, self.answers_ready, self.loss_ready):
            event.set()

    async def _pipeline(self, reference: PathRun) -> None:
        name = self.target.path
        try:
            async with self.group.turn(name, "setup"):  # its reservation opens with its turn
                self._enter("prepare")
                await self.ledger.open()
                await self._prepare(reference)
                self._leave()
                passed = await self._phase("correctness", self._correctness(reference))
            await self._phase("performance", self._performance(passed, reference))
            async with self.group.turn(name, "training"):
                await self._phase("training", self._training(reference, passed))
        except (ActivityError, PathProblem) as err:
            self.state.fail(self.state.phase, reason_of(err))
            self._release()  # a candidate elsewhere need not wait for this path's cleanup
        self.group.leave(name)
        await self.group.last_out(name)
        await self._phase("economics", self.ledger.economics())
        await self.ledger.cleanup()
        if self.state.status != "failed":
            self.state.status = "done"

    async def _phase(self, phase: str, step: Awaitable[T]) -> T:
        if (task := asyncio.current_task()) is not None and task.cancelling():
            raise asyncio.CancelledError()  # cancelled while in an activity that then completed
        self._enter(phase)
        result = await step
        self._leave()
        return result

    async def _prepare(self, reference: PathRun) -> None:
        self.state.restore = await self.ctx.call(PathActivities.serving_config, self.target)
        self.state.loaded = True
        if self.is_reference:
            await self._golden()
        prepared = await self.ctx.call(PathActivities.prepare_path, self.target)
        self.state.prepare = prepared
        busy = int(prepared.total_s * 1e6)
        await self.ledger.usage("prepare", busy, prepared.started_unix_us, prepared.ended_unix_us)
        self.prepared.set()
        if not self.is_reference:
            await reference.prepared.wait()
            if reference.state.prepare is not None:
                theirs = reference.state.prepare.checkpoint_sha256
                problem = artifact_problem(self.target, prepared.checkpoint_sha256, reference.target, theirs)
                if problem:
                    raise PathProblem(problem)

    async def _golden(self) -> None:
        if self.generation is not None:
            await self.generation.golden()
            return
        request = RunRequest(self.target, self.ctx.inputs(), 1, golden=True)
        fallback = "tolerance falls back to allclose"
        golden = await self.ledger.golden(PathActivities.run_inputs, request, fallback)
        if golden is not None:
            self.golden = golden.runs[0]
            self.state.golden = bool(self.golden)

    async def _correctness(self, reference: PathRun) -> bool:
        if self.generation is not None and reference.generation is not None:
            return await self.generation.correctness(
                reference.generation, reference.outputs_ready, self.outputs_ready
            )
        # both sides run twice: a candidate that differs from itself is named non-deterministic
        run = await self.ctx.call(PathActivities.run_inputs, RunRequest(self.target, self.ctx.inputs(), 2))
        self.state.compatibility_on_inputs = run.compatibility
        await self.ledger.usage("correctness", run.busy_us, run.started_unix_us, run.ended_unix_us)
        if self.is_reference:
            await self._own_error(run)
            return True
        await reference.outputs_ready.wait()
        if not reference.runs:
            why = reference.state.errors or {"reference": "did not run"}
            raise PathProblem(f"the reference path produced no outputs to compare with: {why}")
        compare = CompareRequest(
            self.target, self.ctx.spec.criteria, reference.runs[0], run.runs[0],
            reference.golden, reference.runs[1], run.runs[1],
        )  # fmt: skip
        result = await self.ctx.call(ComparisonActivities.compare_outputs, compare)
        self.state.correctness, self.state.workload = result, run.workload
        return result.passed

    async def _own_error(self, run: RunResult) -> None:
        """The reference's outputs for the candidates; its own error against float64
        (reference_rmse) and its run-to-run difference."""
        self.runs = run.runs
        self.outputs_ready.set()
        self.state.correctness = CorrectnessResult(passed=True, outputs=[])  # what candidates meet
        self.state.workload = run.workload
        if self.golden:
            compare = CompareRequest(
                self.target, self.ctx.spec.criteria, run.runs[0], run.runs[1], self.golden, run.runs[1]
            )
            self.state.against_float64 = await self.ctx.call(ComparisonActivities.compare_outputs, compare)

    async def _performance(self, passed: bool, reference: PathRun) -> None:
        if not passed:
            self.state.performance_skipped = "failed correctness: no speed verdict"
            self.answers_ready.set()
            self.group.withdraw(self.target.path)
            return
        if self.generation is not None:
            await self.generation.performance()
            return
        request = PerformanceRequest(
            self.target,
            self.ctx.inputs(),
            self.ctx.spec.performance,
            met_quality=True,
            ledger=self.state.reservation_open,
        )
        if not self.is_reference:  # its answers under load are checked against the reference's
            await reference.answers_ready.wait()
            request.reference_answers, request.criteria = reference.answers, self.ctx.spec.criteria
            if request.inputs.workload:
                request.under_load_skip = "not checked under load: workload replay"
            elif not reference.answers:
                request.under_load_skip = "not checked under load: the reference kept no answers"
        if self.is_reference:
            try:
                self.answers = await reference_answers(self.ctx, request)
            finally:
                self.answers_ready.set()
        perf = await self.group.measure(self.target.path, request)
        self.state.performance = dataclasses.replace(perf, answers={})
        if not perf.ok:
            self.state.errors["performance"] = perf.problem

    async def _training(self, reference: PathRun, passed: bool) -> None:
        plan = self.ctx.spec.training
        if plan is None or not passed:
            return
        ref_loss: list[float] = []
        if not self.is_reference:
            await reference.loss_ready.wait()
            if not reference.loss:
                self.state.training_skipped = "the reference produced no loss curve"
                return
            ref_loss = reference.loss
        started = workflow.now()
        result = await self.ctx.call(TrainingActivities.train_path, TrainRequest(self.target, plan, ref_loss))
        self.state.training = result
        if self.is_reference:
            self.loss = result.loss
            self.loss_ready.set()
        start_us, busy_us = int(started.timestamp() * 1e6), int(result.total_s * 1e6)
        await self.ledger.usage("training", busy_us, start_us, start_us + busy_us)
