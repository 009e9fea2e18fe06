"""The tensor trial kind: the reference's float64 golden run, fixed inputs run twice on each path
and compared by the evaluator, then the latency and throughput scenarios with a share of the
answers under load checked against the reference's answers (docs/trial-spec.md).

`TensorSteps` are one path's steps (workflows/pipeline/kind.py); `TENSOR` is the kind: its
steps, its verdict (workflows/tensor/verdict.py), its report entries and its sections
(workflows/tensor/render.py). The steps run in the workflow sandbox: they only schedule
activities and await events.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from workflows.activities.path import PathActivities
from workflows.pipeline.context import PathProblem, TrialContext
from workflows.pipeline.kind import KindRender, Measurement, PathSteps
from workflows.pipeline.path_ledger import PathLedger
from workflows.pipeline.path_state import PathState
from workflows.pipeline.types import (
    CompareRequest,
    CorrectnessResult,
    ExtensionRule,
    InterleavedRequest,
    PerformanceRequest,
    PerformanceResult,
    RunRequest,
    RunResult,
    Target,
    TensorData,
)
from workflows.spec.trial_io import Verdict
from workflows.spec.trial_spec import Policy
from workflows.tensor import verdict
from workflows.tensor.comparison import ComparisonActivities
from workflows.tensor.performance import PerformanceActivities
from workflows.tensor.render import TENSOR_RENDER


class TensorMeasurer:
    """The tensor kind's measurement (workflows/pipeline/interleave.py Measurer)."""

    async def alone(self, ctx: TrialContext, request: PerformanceRequest) -> PerformanceResult:
        return await ctx.call(PerformanceActivities.measure_performance, request)

    async def together(
        self, ctx: TrialContext, requests: list[PerformanceRequest]
    ) -> list[PerformanceResult]:
        together = InterleavedRequest(requests, extension_rule(ctx))
        measured = await ctx.call(PerformanceActivities.measure_interleaved, together)
        return measured.results


def extension_rule(ctx: TrialContext) -> ExtensionRule | None:
    """How far an interleaved measurement may extend itself (workflows/tensor/extension.py):
    from the spec alone, so a replayed workflow schedules the same activity."""
    spec = ctx.spec
    if not spec.performance.max_extra_requests:
        return None
    policy = spec.policy
    return ExtensionRule(
        spec.reference, spec.performance.max_extra_requests, policy.max_p95_regression, policy.confidence
    )


TENSOR_MEASURER = TensorMeasurer()


class TensorSteps:
    def __init__(self, ctx: TrialContext, target: Target, state: PathState, ledger: PathLedger) -> None:
        self.ctx = ctx
        self.target = target
        self.state = state
        self.ledger = ledger
        self.golden: list[TensorData] = []  # the reference's float64 outputs
        self.runs: list[list[TensorData]] = []  # the reference's two runs, for candidates to meet
        self.outputs_ready = asyncio.Event()
        self.answers: dict[str, list[TensorData]] = {}  # the reference's answer per batch size
        self.answers_ready = asyncio.Event()

    def release(self) -> None:
        self.outputs_ready.set()
        self.answers_ready.set()

    async def prepare(self) -> None:
        """The reference model in float64: the basis of every path's allowed error."""
        if not self.state.is_reference:
            return
        request = RunRequest(self.target, self.ctx.inputs(), 1, golden=True)
        fallback = "tolerance falls back to allclose"
        golden = await self.ledger.golden(PathActivities.run_inputs, request, fallback)
        if golden is not None:
            self.golden = golden.runs[0]
            self.state.golden = bool(self.golden)

    async def correctness(self, reference: TensorSteps) -> bool:
        # both sides run twice: a candidate that differs from itself is named non-deterministic
        run = await self.ctx.call(PathActivities.run_inputs, RunRequest(self.target, self.ctx.inputs(), 2))
        self.state.compatibility_on_inputs = run.compatibility
        await self.ledger.usage("correctness", run.busy_us, run.started_unix_us, run.ended_unix_us)
        if self.state.is_reference:
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

    async def performance(self, reference: TensorSteps, measurement: Measurement) -> None:
        request = PerformanceRequest(
            self.target,
            self.ctx.inputs(),
            self.ctx.spec.performance,
            met_quality=True,
            ledger=self.state.reservation_open,
        )
        if self.state.is_reference:
            await self._answers(request)
        else:  # its answers under load are checked against the reference's
            await reference.answers_ready.wait()
            request.reference_answers, request.criteria = reference.answers, self.ctx.spec.criteria
            if request.inputs.workload:
                request.under_load_skip = "not checked under load: workload replay"
            elif not reference.answers:
                request.under_load_skip = "not checked under load: the reference kept no answers"
        perf = await measurement.measure(self.target.path, request, TENSOR_MEASURER)
        self.state.performance = dataclasses.replace(perf, answers={})
        if not perf.ok:
            self.state.errors["performance"] = perf.problem

    async def _answers(self, request: PerformanceRequest) -> None:
        """The reference's answer to each batch size's inputs, one request each, before its
        measurement: a candidate measured at the same time on another host waits only for
        these. Not metered (a few requests; the measurement's idempotency keys are its own)."""
        try:
            if request.inputs.workload:
                return
            plan = dataclasses.replace(
                request.plan, warmup=0, min_iterations=1, min_seconds=0.0, offline_concurrency=1, blocks=1
            )
            probe = dataclasses.replace(request, plan=plan, ledger=False)
            self.answers = (await self.ctx.call(PerformanceActivities.measure_performance, probe)).answers
        finally:
            self.answers_ready.set()

    async def training(self, reference: TensorSteps, passed: bool) -> None:
        """A tensor trial has no training phase (the training kind adds one)."""


def correctness_json(state: PathState) -> dict[str, Any]:
    """The path's `correctness` entry: the evaluator's verdict per output (the reference's:
    its own error against float64), with a replayed workload's distribution."""
    if state.correctness is None:
        return {}
    out: dict[str, Any]
    if state.is_reference:
        out = {"role": "reference", "golden": state.golden, "passed": True}
    else:
        out = dataclasses.asdict(state.correctness)
    if state.workload:
        out["workload"] = state.workload
    if state.against_float64 is not None:
        out["against_float64"] = dataclasses.asdict(state.against_float64)
    return out


class TensorKind:
    name = "tensor"
    render: KindRender = TENSOR_RENDER

    def steps(self, ctx: TrialContext, target: Target, state: PathState, ledger: PathLedger) -> PathSteps:
        return TensorSteps(ctx, target, state, ledger)

    def judge(self, reference: PathState, candidate: PathState, policy: Policy) -> Verdict:
        return Verdict.of(verdict.criteria(reference, candidate, policy))

    def results_json(self, state: PathState) -> dict[str, Any]:
        perf = dataclasses.asdict(state.performance) if state.performance is not None else {}
        return {"correctness": correctness_json(state), "performance": perf}


TENSOR = TensorKind()
