"""Activity inputs and outputs of a generation trial: one dataclass in, one out, JSON-friendly.

Generations travel as dicts of `switchyard.judge.divergence.Generated` (token ids, the
chosen tokens' logprobs, the top-k per position): a few kB per prompt, well inside a
Temporal payload.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workflows.pipeline.types import InputsCompatibility, Target
from workflows.spec.trial_spec import Criteria, PerformancePlan, Prompts


@dataclass
class GenerationRunRequest:
    """Greedy generations of the correctness prompts, `repeats` times; `golden` loads the
    model in fp64 (eager) first."""

    target: Target
    seed: int
    prompts: Prompts
    top_k: int
    repeats: int = 1
    golden: bool = False


@dataclass
class GenerationRunResult:
    runs: list[list[dict[str, Any]]]  # per repeat, per prompt: Generated.to_dict()
    prompt_tokens: list[int]
    busy_us: int
    started_unix_us: int
    ended_unix_us: int
    compatibility: InputsCompatibility | None = None  # None: not measured (the golden run)


@dataclass
class GenerationCompareRequest:
    target: Target
    criteria: Criteria
    reference: list[dict[str, Any]]
    candidate: list[dict[str, Any]]
    golden: list[dict[str, Any]] = field(default_factory=list)
    reference_repeat: list[dict[str, Any]] = field(default_factory=list)
    candidate_repeat: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class GenerationCompareResult:
    passed: bool
    finding: str
    first_divergence: int  # the earliest diverging position over the prompts; -1 = none
    diverged: list[int]  # prompts whose tokens diverged
    sequences: list[dict[str, Any]]  # per prompt: SequenceCheck as a dict
    metrics: dict[str, Any]
    reasons: list[str]
    justification: str


@dataclass
class GenerationPerformanceRequest:
    target: Target
    plan: PerformancePlan  # its `generation` is the scenario
    token_range: list[int]  # [low, high) of prompt ids when the plan gives none
    slo: dict[str, float] = field(default_factory=dict)  # goodput: ttft_ms, tpot_ms, e2el_ms
    ledger: bool = True


@dataclass
class GenerationInterleavedRequest:
    """Paths that share a host, measured together in alternating blocks; one plan for all."""

    paths: list[GenerationPerformanceRequest]


@dataclass
class GenerationPerformanceResult:
    levels: list[dict[str, Any]]  # genmetrics.summarize per load level
    compilations_before: int
    compilations_after: int
    busy_us: int
    jobs: int
    prompt_tokens: int
    output_tokens: int
    ok: bool
    problem: str = ""
    interleaved_with: list[str] = field(default_factory=list)  # paths measured in alternation
    not_interleaved: str = ""  # why a path on the reference's host was measured apart


@dataclass
class GenerationInterleavedResult:
    results: list[GenerationPerformanceResult]  # in the order of the request's paths
