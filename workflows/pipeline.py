"""One path's pipeline inside TrialWorkflow: prepare -> correctness -> performance -> training
-> economics, with the path's state kept as plain data for the `progress` query and the report.

Runs in the workflow sandbox: it only schedules activities and awaits events. A failed
activity ends that path's measurement (the path becomes INCONCLUSIVE with the reason), but its
reservation is still closed and its cost still read, so the ledger stays whole.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

from workflows.spec import TrialSpec
from workflows.types import (
    CloseRequest,
    CompareRequest,
    CorrectnessResult,
    EconomicsRequest,
    EconomicsResult,
    InputsPlan,
    PathInfo,
    PerformanceRequest,
    PerformanceResult,
    PrepareResult,
    ReservationRequest,
    ReservationResult,
    RunRequest,
    RunResult,
    Target,
    TensorData,
    TrainRequest,
    TrainResult,
    UsageRecord,
)


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
    options: dict[str, Any]

    async def activity(self, name: str, arg: Any, result_type: type | None = None) -> Any:
        return await workflow.execute_activity(name, arg, result_type=result_type, **self.options)

    def inputs(self) -> InputsPlan:
        i = self.spec.inputs
        tensors = [dataclasses.asdict(t) for t in i.tensors]
        return InputsPlan(i.seed, tensors, i.file, i.file_sha256, i.workload, i.workload_sha256)


@dataclass
class PathState:
    """Everything the report says about one path; JSON-friendly."""

    path: str
    role: str
    host: str = ""
    phase: str = "pending"
    status: str = "pending"  # pending | running | done | failed | cancelled
    phases_done: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    prepare: dict[str, Any] = field(default_factory=dict)
    correctness: dict[str, Any] = field(default_factory=dict)
    # the counters around the fixed inputs' requests: fallback calls per request, compilations
    compatibility_on_inputs: dict[str, Any] = field(default_factory=dict)
    performance: dict[str, Any] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)
    economics: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    ledger_problem: str = ""
    reservation_id: str = ""
    reservation_open: bool = False
    loaded: bool = False
    restore: dict[str, Any] = field(default_factory=dict)  # serving config before the trial
    timeline: dict[str, list[str]] = field(default_factory=dict)  # phase -> [start, end] (ISO)

    def summary(self) -> dict[str, Any]:
        return {"phase": self.phase, "status": self.status, "host": self.host, "errors": self.errors}


class PathRun:
    def __init__(self, ctx: TrialContext, target: Target, is_reference: bool) -> None:
        self.ctx = ctx
        self.target = target
        self.is_reference = is_reference
        self.state = PathState(target.path, "reference" if is_reference else "candidate")
        self.golden: list[TensorData] = []
        self.runs: list[list[TensorData]] = []
        self.outputs_ready = asyncio.Event()
        self.loss: list[float] = []
        self.loss_ready = asyncio.Event()

    async def describe(self) -> PathInfo | None:
        try:
            info: PathInfo = await self.ctx.activity("describe_path", self.target, PathInfo)
        except ActivityError as err:
            self._fail("prepare", f"Describe failed: {_reason(err)}")
            return None
        self.state.host = info.host
        self.state.info = dataclasses.asdict(info)
        self.target.ledger_path = info.ledger_path
        try:
            self.state.ledger_problem = await self.ctx.activity("register_path", info, str)
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
            self.outputs_ready.set()
            self.loss_ready.set()

    async def _usage(self, phase: str, busy_us: int, started: int, ended: int) -> None:
        if self.state.reservation_open:
            record = UsageRecord(self.target, phase, busy_us, started, ended, self.state.reservation_id)
            await self.ctx.activity("record_path_usage", record)

    async def _pipeline(self, reference: PathRun) -> None:
        t, spec = self.target, self.ctx.spec
        self._enter("prepare")
        if not self.state.ledger_problem:
            # the start comes from the workflow so a retried activity sends the same request
            r: ReservationResult = await self.ctx.activity(
                "open_reservation", ReservationRequest(t, _now_us()), ReservationResult
            )
            self.state.reservation_id, self.state.reservation_open = r.reservation_id, True
        try:
            self.state.restore = await self.ctx.activity("serving_config", t, dict)
            self.state.loaded = True
            if self.is_reference:
                await self._golden()
            prepared: PrepareResult = await self.ctx.activity("prepare_path", t, PrepareResult)
            self.state.prepare = dataclasses.asdict(prepared)
            busy = int(prepared.total_s * 1e6)
            await self._usage("prepare", busy, prepared.started_unix_us, prepared.ended_unix_us)
            self._leave()
            self._enter("correctness")
            passed = await self._correctness(reference)
            self._leave()
            self._enter("performance")
            if passed:
                perf: PerformanceResult = await self.ctx.activity(
                    "measure_performance",
                    PerformanceRequest(
                        t,
                        self.ctx.inputs(),
                        dataclasses.asdict(spec.performance),
                        met_quality=True,
                        ledger=self.state.reservation_open,
                    ),
                    PerformanceResult,
                )
                self.state.performance = dataclasses.asdict(perf)
                if not perf.ok:
                    self.state.errors["performance"] = perf.problem
            else:
                self.state.performance = {"skipped": "failed correctness: no speed verdict"}
            self._leave()
            self._enter("training")
            if spec.training is not None and passed:
                await self._training(reference)
            self._leave()
        except (ActivityError, PathProblem) as err:
            self._fail(self.state.phase, _reason(err))
        self._enter("economics")
        try:
            if self.state.reservation_open:
                econ: EconomicsResult = await self.ctx.activity(
                    "economics",
                    EconomicsRequest(t, self.state.reservation_id, 0, _now_us()),
                    EconomicsResult,
                )
                self.state.reservation_open = False
                self.state.economics = dataclasses.asdict(econ)
            else:
                self.state.economics = {"unpriced": True, "problem": self.state.ledger_problem}
        except ActivityError as err:
            self._fail("economics", _reason(err))
        self._leave()
        await self.cleanup()
        if self.state.status != "failed":
            self.state.status = "done"

    async def _golden(self) -> None:
        t = self.target
        try:
            golden: RunResult = await self.ctx.activity(
                "run_inputs", RunRequest(t, self.ctx.inputs(), 1, golden=True), RunResult
            )
        except ActivityError as err:
            self.state.notes.append(
                f"no float64 golden run ({_reason(err)}): tolerance falls back to allclose"
            )
            return
        self.golden = golden.runs[0]
        await self._usage("golden", golden.busy_us, golden.started_unix_us, golden.ended_unix_us)

    async def _correctness(self, reference: PathRun) -> bool:
        t = self.target
        # both sides run twice: a candidate that differs from itself is named non-deterministic
        run: RunResult = await self.ctx.activity("run_inputs", RunRequest(t, self.ctx.inputs(), 2), RunResult)
        self.state.compatibility_on_inputs = run.compatibility
        await self._usage("correctness", run.busy_us, run.started_unix_us, run.ended_unix_us)
        if self.is_reference:
            self.runs = run.runs
            self.outputs_ready.set()
            self.state.correctness = {"role": "reference", "golden": bool(self.golden), "passed": True}
            if run.workload:
                self.state.correctness["workload"] = run.workload
            if self.golden:
                # the reference's own error against float64 (reference_rmse) and its run-to-run difference
                own: CorrectnessResult = await self.ctx.activity(
                    "compare_outputs",
                    CompareRequest(t, dataclasses.asdict(self.ctx.spec.criteria), run.runs[0], run.runs[1],
                                   self.golden, run.runs[1]),
                    CorrectnessResult,
                )  # fmt: skip
                self.state.correctness["against_float64"] = dataclasses.asdict(own)
            return True
        await reference.outputs_ready.wait()
        if not reference.runs:
            why = reference.state.errors or {"reference": "did not run"}
            raise PathProblem(f"the reference path produced no outputs to compare with: {why}")
        result: CorrectnessResult = await self.ctx.activity(
            "compare_outputs",
            CompareRequest(t, dataclasses.asdict(self.ctx.spec.criteria), reference.runs[0], run.runs[0],
                           reference.golden, reference.runs[1], run.runs[1]),
            CorrectnessResult,
        )  # fmt: skip
        self.state.correctness = dataclasses.asdict(result)
        if run.workload:
            self.state.correctness["workload"] = run.workload
        return result.passed

    async def _training(self, reference: PathRun) -> None:
        plan = self.ctx.spec.training
        assert plan is not None
        ref_loss: list[float] = []
        if not self.is_reference:
            await reference.loss_ready.wait()
            if not reference.loss:
                self.state.training = {"skipped": "the reference produced no loss curve"}
                return
            ref_loss = reference.loss
        started = workflow.now()
        result: TrainResult = await self.ctx.activity(
            "train_path", TrainRequest(self.target, dataclasses.asdict(plan), ref_loss), TrainResult
        )
        self.state.training = dataclasses.asdict(result)
        if self.is_reference:
            self.loss = result.loss
            self.loss_ready.set()
        start_us = int(started.timestamp() * 1e6)
        await self._usage(
            "training", int(result.total_s * 1e6), start_us, start_us + int(result.total_s * 1e6)
        )

    async def cleanup(self) -> None:
        """Close the reservation (if still open) and hand back the serving set-up (or unload
        what only the trial loaded); safe to call twice."""
        if not self.state.reservation_open and not self.state.loaded:
            return
        reservation = self.state.reservation_id if self.state.reservation_open else ""
        request = CloseRequest(self.target, reservation, _now_us(), restore=self.state.restore)
        try:
            await self.ctx.activity("close_path", request)
            self.state.reservation_open = False
            self.state.loaded = False
        except ActivityError as err:
            self.state.notes.append(f"cleanup failed: {_reason(err)}")
