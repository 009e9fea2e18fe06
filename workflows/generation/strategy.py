"""The generation trial kind (docs/trial-spec.md#generation-trials): the reference's float64
golden run, greedy generations twice on each path judged under the divergence rule, and the
generation scenario's load levels.

`GenerationSteps` are one path's steps (workflows/pipeline/kind.py); `GENERATION` is the kind:
its steps, its verdict (workflows/generation/verdict.py), its report entries and its sections
(workflows/generation/render.py). The steps run in the workflow sandbox: they only schedule
activities and await events.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from workflows.generation.activities import GenerationActivities
from workflows.generation.measure import GenerationMeasurement
from workflows.generation.metrics import DEFINITIONS
from workflows.generation.render import GENERATION_RENDER
from workflows.generation.types import (
    GenerationCompareRequest,
    GenerationInterleavedRequest,
    GenerationPerformanceRequest,
    GenerationPerformanceResult,
    GenerationRunRequest,
)
from workflows.generation.verdict import judge_generation
from workflows.pipeline.context import PathProblem, TrialContext
from workflows.pipeline.kind import KindRender, Measurement, PathSteps
from workflows.pipeline.path_ledger import PathLedger
from workflows.pipeline.path_state import PathState
from workflows.pipeline.types import CorrectnessResult, Target
from workflows.spec.trial_io import Verdict
from workflows.spec.trial_spec import Policy


class GenerationMeasurer:
    """The generation kind's measurement (workflows/pipeline/interleave.py Measurer)."""

    async def alone(
        self, ctx: TrialContext, request: GenerationPerformanceRequest
    ) -> GenerationPerformanceResult:
        return await ctx.call(GenerationMeasurement.measure_generation, request)

    async def together(
        self, ctx: TrialContext, requests: list[GenerationPerformanceRequest]
    ) -> list[GenerationPerformanceResult]:
        together = GenerationInterleavedRequest(requests)
        return (await ctx.call(GenerationMeasurement.measure_generation_interleaved, together)).results


GENERATION_MEASURER = GenerationMeasurer()


class GenerationSteps:
    def __init__(self, ctx: TrialContext, target: Target, state: PathState, ledger: PathLedger) -> None:
        self.ctx = ctx
        self.target = target
        self.state = state
        self.ledger = ledger
        self.golden_run: list[dict[str, Any]] = []  # per prompt, Generated dicts of the float64 run
        self.runs: list[list[dict[str, Any]]] = []  # both runs, for the candidates to meet
        self.outputs_ready = asyncio.Event()

    def release(self) -> None:
        self.outputs_ready.set()

    def _request(self, repeats: int, golden: bool = False) -> GenerationRunRequest:
        spec = self.ctx.spec
        assert spec.inputs.prompts is not None
        top_k = spec.criteria.top_k or 5
        return GenerationRunRequest(
            self.target, spec.inputs.seed, spec.inputs.prompts, top_k, repeats, golden
        )

    async def prepare(self) -> None:
        """The reference model in float64 (eager), greedy on every prompt."""
        if not self.state.is_reference:
            return
        request, fallback = self._request(1, golden=True), "logprobs fall back to allclose"
        run = await self.ledger.golden(GenerationActivities.run_generation, request, fallback)
        if run is not None:
            self.golden_run = run.runs[0]
            self.state.golden = bool(self.golden_run)

    async def correctness(self, reference: GenerationSteps) -> bool:
        """Greedy generations twice; the reference's are judged against its own float64 run,
        a candidate's against the reference's under the divergence rule."""
        run = await self.ctx.call(GenerationActivities.run_generation, self._request(2))
        self.state.compatibility_on_inputs = run.compatibility
        await self.ledger.usage("correctness", run.busy_us, run.started_unix_us, run.ended_unix_us)
        criteria = self.ctx.spec.criteria
        if self.state.is_reference:
            self.runs = run.runs
            self.outputs_ready.set()
            self.state.correctness = CorrectnessResult(passed=True, outputs=[])  # what candidates meet
            if self.golden_run:
                own = GenerationCompareRequest(self.target, criteria, self.golden_run, run.runs[0])
                self.state.generation = await self.ctx.call(GenerationActivities.compare_generation, own)
            return True
        await reference.outputs_ready.wait()
        if not reference.runs:
            why = reference.state.errors or {"reference": "did not run"}
            raise PathProblem(f"the reference path produced no generations to compare with: {why}")
        compare = GenerationCompareRequest(
            self.target, criteria, reference.runs[0], run.runs[0],
            reference.golden_run, reference.runs[1], run.runs[1],
        )  # fmt: skip
        self.state.generation = await self.ctx.call(GenerationActivities.compare_generation, compare)
        return self.state.generation.passed

    async def performance(self, reference: GenerationSteps, measurement: Measurement) -> None:
        """The generation scenario's load levels, each request a job with its tokens; alone, or
        in alternating blocks with the paths on the reference's host (`measurement`)."""
        spec = self.ctx.spec
        prompts, policy = spec.inputs.prompts, spec.policy
        slo = {"ttft_ms": policy.slo_ttft_ms, "tpot_ms": policy.slo_tpot_ms, "e2el_ms": policy.slo_e2el_ms}
        token_range = [prompts.low, prompts.high] if prompts else [0, 0]
        request = GenerationPerformanceRequest(
            self.target, spec.performance, token_range, slo, ledger=self.state.reservation_open
        )
        perf = await measurement.measure(self.target.path, request, GENERATION_MEASURER)
        self.state.generation_performance = perf
        if not perf.ok:
            self.state.errors["performance"] = perf.problem

    async def training(self, reference: GenerationSteps, passed: bool) -> None:
        """A generation trial has no training phase (the spec refuses one)."""


def correctness_json(state: PathState) -> dict[str, Any]:
    """The path's `correctness` entry: the divergence rule's verdict (the reference's is its own
    run against its float64 run)."""
    reference = {"role": "reference", "golden": state.golden, "passed": True}
    if state.generation is None:
        return reference if state.correctness else {}
    rule = {"rule": "generation", **dataclasses.asdict(state.generation)}
    return {**reference, "against_float64": rule} if state.is_reference else rule


class GenerationKind:
    name = "generation"
    render: KindRender = GENERATION_RENDER

    def steps(self, ctx: TrialContext, target: Target, state: PathState, ledger: PathLedger) -> PathSteps:
        return GenerationSteps(ctx, target, state, ledger)

    def judge(self, reference: PathState, candidate: PathState, policy: Policy) -> Verdict:
        return Verdict.of(judge_generation(reference, candidate, policy))

    def results_json(self, state: PathState) -> dict[str, Any]:
        perf = state.generation_performance
        performance = {**dataclasses.asdict(perf), "definitions": dict(DEFINITIONS)} if perf else {}
        return {"correctness": correctness_json(state), "performance": performance}


GENERATION = GenerationKind()
