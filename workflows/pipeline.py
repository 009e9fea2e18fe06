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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.workflow import ActivityCancellationType

from workflows.activities import PathActivities
from workflows.ledger_activities import LedgerActivities
from workflows.path_state import PathState
from workflows.performance import PerformanceActivities
from workflows.spec import TrialSpec
from workflows.types import (
    CloseRequest,
    CompareRequest,
    CorrectnessResult,
    EconomicsRequest,
    InputsPlan,
    PathInfo,
    PerformanceRequest,
    ReservationRequest,
    RunRequest,
    RunResult,
    Target,
    TensorData,
    TrainRequest,
    UsageRecord,
)

In = TypeVar("In")
Out = TypeVar("Out")


def _now_us() -> int:
    return int(workflow.now().timestamp() * 1_000_000)


class PathProblem(Exception):
    """A path cannot go on for a reason of the trial's own (not an activity failure)."""


def _reason(err: BaseException) -> str:
    """The innermost message of an activity failure, for the report."""
    cause: BaseException | None = err
    while isinstance(cause, ActivityError) and cause.cause is not None:
        cause = cause.cause
    if isinstance(cause, ApplicationError):
        return cause.message
    return str(cause)


@dataclass
class TrialContext:
    spec: TrialSpec
    trial_id: str

    async def call(self, activity: Callable[[Any, In], Awaitable[Out]], arg: In) -> Out:
        """Run one activity method with the spec's timeouts and retries."""
        t = self.spec.timeouts
        return await workflow.execute_activity_method(
            activity,
            arg,
            start_to_close_timeout=timedelta(seconds=t.activity_s),
            heartbeat_timeout=timedelta(seconds=t.heartbeat_s),
            retry_policy=RetryPolicy(
                maximum_attempts=t.max_attempts,
                initial_interval=timedelta(seconds=1),
                non_retryable_error_types=["InvalidTrialSpec"],
            ),
            cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
        )

    def inputs(self) -> InputsPlan:
        i = self.spec.inputs
        return InputsPlan(i.seed, list(i.tensors), i.file, i.file_sha256, i.workload, i.workload_sha256)


class PathRun:
    def __init__(self, ctx: TrialContext, target: Target, is_reference: bool, version_field: str) -> None:
        self.ctx = ctx
        self.target = target
        self.is_reference = is_reference
        self.version_field = version_field  # the spec field that names this path's version
        self.state = PathState(target.path, "reference" if is_reference else "candidate")
        self.model_problem = ""  # why the executor cannot load the model ("" = it can)
        self.golden: list[TensorData] = []
        self.runs: list[list[TensorData]] = []
        self.prepared = asyncio.Event()
        self.outputs_ready = asyncio.Event()
        self.loss: list[float] = []
        self.loss_ready = asyncio.Event()

    async def describe(self) -> PathInfo | None:
        """Describe the executor and register the path; refuse a model it does not hold."""
        try:
            info = await self.ctx.call(PathActivities.describe_path, self.target)
        except ActivityError as err:
            self._fail("prepare", f"Describe failed: {_reason(err)}")
            return None
        self.state.host = info.host
        self.state.info = info
        self.target.ledger_path = info.ledger_path
        self.model_problem = info.model_problem(self.target, self.version_field)
        if self.model_problem:
            self._fail("prepare", self.model_problem)
            return info
        try:
            registered = await self.ctx.call(LedgerActivities.register_path, info)
            self.state.ledger_problem = registered.problem
        except ActivityError as err:
            self.state.ledger_problem = f"ledger: {_reason(err)}"
        return info

    def _fail(self, phase: str, reason: str) -> None:
        self.state.errors[phase] = reason
        self.state.status = "failed"

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
            for event in (self.prepared, self.outputs_ready, self.loss_ready):
                event.set()

    async def _usage(self, phase: str, busy_us: int, started: int, ended: int) -> None:
        if self.state.reservation_open:
            record = UsageRecord(self.target, phase, busy_us, started, ended, self.state.reservation_id)
            await self.ctx.call(LedgerActivities.record_path_usage, record)

    async def _pipeline(self, reference: PathRun) -> None:
        self._enter("prepare")
        if not self.state.ledger_problem:
            # the start comes from the workflow so a retried activity sends the same request
            request = ReservationRequest(self.target, _now_us())
            r = await self.ctx.call(LedgerActivities.open_reservation, request)
            self.state.reservation_id, self.state.reservation_open = r.reservation_id, True
        try:
            await self._prepare(reference)
            self._leave()
            self._enter("correctness")
            passed = await self._correctness(reference)
            self._leave()
            self._enter("performance")
            await self._performance(passed)
            self._leave()
            self._enter("training")
            if self.ctx.spec.training is not None and passed:
                await self._training(reference)
            self._leave()
        except (ActivityError, PathProblem) as err:
            self._fail(self.state.phase, _reason(err))
        self._enter("economics")
        await self._economics()
        self._leave()
        await self.cleanup()
        if self.state.status != "failed":
            self.state.status = "done"

    async def _prepare(self, reference: PathRun) -> None:
        self.state.restore = await self.ctx.call(PathActivities.serving_config, self.target)
        self.state.loaded = True
        if self.is_reference:
            await self._golden()
        prepared = await self.ctx.call(PathActivities.prepare_path, self.target)
        self.state.prepare = prepared
        busy = int(prepared.total_s * 1e6)
        await self._usage("prepare", busy, prepared.started_unix_us, prepared.ended_unix_us)
        self.prepared.set()
        if not self.is_reference:
            await reference.prepared.wait()
            self._check_artifact(reference)

    def _check_artifact(self, reference: PathRun) -> None:
        """Paths of one model version must load the same artifact, or they compare two models."""
        mine, theirs = self.state.prepare, reference.state.prepare
        if mine is None or theirs is None or self.target.version != reference.target.version:
            return
        if mine.checkpoint_sha256 != theirs.checkpoint_sha256:
            t = self.target
            raise PathProblem(
                f"FAILED_PRECONDITION: {t.model}:{t.version or 'default'} on {t.path} has artifact sha256 "
                f"{mine.checkpoint_sha256}, the reference {reference.target.path} has "
                f"{theirs.checkpoint_sha256}: the executors' model repositories hold different files "
                f"for one version; add the same artifact to both (`switchyard models add`) or pin "
                "model.checkpoint_sha256"
            )

    async def _golden(self) -> None:
        request = RunRequest(self.target, self.ctx.inputs(), 1, golden=True)
        try:
            golden = await self.ctx.call(PathActivities.run_inputs, request)
        except ActivityError as err:
            self.state.notes.append(
                f"no float64 golden run ({_reason(err)}): tolerance falls back to allclose"
            )
            return
        self.golden = golden.runs[0]
        self.state.golden = bool(self.golden)
        await self._usage("golden", golden.busy_us, golden.started_unix_us, golden.ended_unix_us)

    async def _correctness(self, reference: PathRun) -> bool:
        # both sides run twice: a candidate that differs from itself is named non-deterministic
        run = await self.ctx.call(PathActivities.run_inputs, RunRequest(self.target, self.ctx.inputs(), 2))
        self.state.compatibility_on_inputs = run.compatibility
        await self._usage("correctness", run.busy_us, run.started_unix_us, run.ended_unix_us)
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
        result = await self.ctx.call(PathActivities.compare_outputs, compare)
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
            self.state.against_float64 = await self.ctx.call(PathActivities.compare_outputs, compare)

    async def _performance(self, passed: bool) -> None:
        if not passed:
            self.state.performance_skipped = "failed correctness: no speed verdict"
            return
        request = PerformanceRequest(
            self.target,
            self.ctx.inputs(),
            self.ctx.spec.performance,
            met_quality=True,
            ledger=self.state.reservation_open,
        )
        perf = await self.ctx.call(PerformanceActivities.measure_performance, request)
        self.state.performance = perf
        if not perf.ok:
            self.state.errors["performance"] = perf.problem

    async def _training(self, reference: PathRun) -> None:
        plan = self.ctx.spec.training
        assert plan is not None
        ref_loss: list[float] = []
        if not self.is_reference:
            await reference.loss_ready.wait()
            if not reference.loss:
                self.state.training_skipped = "the reference produced no loss curve"
                return
            ref_loss = reference.loss
        started = workflow.now()
        result = await self.ctx.call(PathActivities.train_path, TrainRequest(self.target, plan, ref_loss))
        self.state.training = result
        if self.is_reference:
            self.loss = result.loss
            self.loss_ready.set()
        start_us, busy_us = int(started.timestamp() * 1e6), int(result.total_s * 1e6)
        await self._usage("training", busy_us, start_us, start_us + busy_us)

    async def _economics(self) -> None:
        if not self.state.reservation_open:
            self.state.economics_unpriced = True
            return
        request = EconomicsRequest(self.target, self.state.reservation_id, 0, _now_us())
        try:
            self.state.economics = await self.ctx.call(LedgerActivities.economics, request)
            self.state.reservation_open = False
        except ActivityError as err:
            self._fail("economics", _reason(err))

    async def cleanup(self) -> None:
        """Close the reservation (if still open) and hand back the serving set-up (or unload
        what only the trial loaded); safe to call twice."""
        if not self.state.reservation_open and not self.state.loaded:
            return
        reservation = self.state.reservation_id if self.state.reservation_open else ""
        request = CloseRequest(self.target, reservation, _now_us(), restore=self.state.restore)
        try:
            await self.ctx.call(LedgerActivities.close_path, request)
            self.state.reservation_open = False
            self.state.loaded = False
        except ActivityError as err:
            self.state.notes.append(f"cleanup failed: {_reason(err)}")
