"""Verdict rules on report data: each criterion decides, with its reason."""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any

from workflows.pipeline.path_state import PathState
from workflows.pipeline.types import (
    CorrectnessResult,
    EconomicsResult,
    InputsCompatibility,
    LoadCompatibility,
    OutputVerdict,
    PerformanceResult,
    PrepareResult,
    ScenarioResult,
)
from workflows.report.results import overall as overall_verdict
from workflows.spec.trial_spec import Policy
from workflows.tensor.strategy import TENSOR
from workflows.tensor.verdict import cost_per_job
from workflows.training.strategy import TRAINING


def judge(reference: PathState, candidate: PathState, policy: Policy, training: bool) -> dict[str, Any]:
    """The verdict in its JSON form, as the report holds it."""
    kind = TRAINING if training else TENSOR  # a training trial's criteria add training before cost
    return dataclasses.asdict(kind.judge(reference, candidate, policy))


def scenario(p95: float, name: str = "single-stream", batch: int = 1) -> ScenarioResult:
    return ScenarioResult(name, batch, 1, 10, 1.0, 0.0, 0.0, p95, 0.0, 0.0, 0.0, 0.0, "samples/s", {}, [], [])


def economics(
    jobs_completed: int = 0, total_micros: int = 0, prepare_micros: int = 0, **extra: Any
) -> EconomicsResult:
    fields: dict[str, Any] = {
        "currency": "USD",
        "total_micros": total_micros,
        "busy_micros": 0,
        "idle_micros": 0,
        "prepare_micros": prepare_micros,
        "reserved_micros": 0,
        "jobs_completed": jobs_completed,
        "jobs_failed": 0,
        "cost_per_completed_job_micros": 0,
        "unpriced": False,
        "unpriced_events": 0,
    }
    return EconomicsResult(**{**fields, **extra})


def _state(p95: float, cpj: int, passed: bool = True, **econ: Any) -> PathState:
    output = OutputVerdict(
        output="y",
        passed=passed,
        reasons=["rmse ...: pass" if passed else "rmse vs float64: ...: fail"],
        metrics={"rmse": 2e-6 if passed else 1e-3, "allowed_rmse": 1e-5},
        justification="",
        finding="" if passed else "wrong but stable",
    )
    state = PathState("p", "candidate")
    state.prepare = PrepareResult(0.0, 0.0, 0.0, 0.0, "", LoadCompatibility(), "READY")
    state.compatibility_on_inputs = InputsCompatibility(requests=2)
    state.correctness = CorrectnessResult(passed, [output])
    state.performance = PerformanceResult([scenario(p95)], 0, 0, 0, 0, True)
    problem = econ.pop("problem", "")
    if econ.pop("unpriced", False):  # no reservation could be held: why is the ledger's problem
        state.economics_unpriced, state.ledger_problem = True, problem
    else:
        econ = {"jobs_completed": 100, "total_micros": cpj * 100, **econ}
        state.economics = economics(cost_per_completed_job_micros=cpj, **econ)
    return state


def test_a_failed_training_phase_leaves_the_cost_unjudged_not_rejected() -> None:
    # a rank that died: its timeouts and teardown are in the ledger, so the cost says nothing
    candidate = _state(9.0, 500)
    candidate.errors["training"] = "rank 1 failed: killed by signal SIGKILL; the other ranks torn down"
    v = judge(_state(10.0, 100), candidate, Policy(require_training=True), training=True)
    assert v["criteria"]["cost"]["result"] == "inconclusive", v
    assert "training phase failed" in v["criteria"]["cost"]["reason"]
    assert v["verdict"] == "INCONCLUSIVE", v


def test_adopt_when_every_criterion_passes() -> None:
    v = judge(_state(10.0, 100), _state(9.0, 80), Policy(), training=False)
    assert v["verdict"] == "ADOPT"
    assert list(v["criteria"]) == ["correctness", "compatibility", "latency", "memory", "cost"]
    assert v["line"] == (
        "ADOPT: correctness pass (rmse 2e-06 <= allowed 1e-05); compatibility pass (0 host-fallback ops, "
        "0 graph breaks); latency pass (p95 -10.0% (allowed +10%)); memory skipped (not sampled); "
        "cost pass (saving +20.0% (needs +0%))"
    )


def test_latency_regression_beyond_policy_rejects() -> None:
    v = judge(_state(10.0, 100), _state(11.5, 80), Policy(max_p95_regression=0.1), training=False)
    assert v["verdict"] == "REJECT"
    assert v["criteria"]["latency"]["result"] == "fail" and "+15.0%" in v["criteria"]["latency"]["reason"]


def test_cost_saving_below_policy_rejects_and_unpriced_is_inconclusive() -> None:
    v = judge(_state(10.0, 100), _state(9.0, 95), Policy(min_cost_saving=0.1), training=False)
    assert v["verdict"] == "REJECT" and v["criteria"]["cost"]["result"] == "fail"
    unpriced = _state(9.0, 0, unpriced=True, problem="unknown price key 'tpu/v5e'")
    v = judge(_state(10.0, 100), unpriced, Policy(), training=False)
    assert v["verdict"] == "INCONCLUSIVE" and "tpu/v5e" in v["criteria"]["cost"]["reason"]


def test_failed_correctness_rejects_without_speed_verdict() -> None:
    v = judge(_state(10.0, 100), _state(1.0, 1, passed=False), Policy(), training=True)
    assert v["verdict"] == "REJECT"
    assert v["criteria"]["latency"]["result"] == "skipped"
    assert v["criteria"]["training"]["result"] == "skipped"


def test_compilation_while_measuring_is_inconclusive() -> None:
    candidate = _state(9.0, 80)
    candidate.errors["performance"] = "2 compilation(s) or recompile(s) while measuring"
    v = judge(_state(10.0, 100), candidate, Policy(), training=False)
    assert v["verdict"] == "INCONCLUSIVE" and v["criteria"]["latency"]["result"] == "inconclusive"


def test_amortised_cost_spreads_preparation() -> None:
    econ = economics(
        jobs_completed=10, total_micros=10_000, prepare_micros=9_000, cost_per_completed_job_micros=1_000
    )
    assert cost_per_job(econ, Policy()) == 1_000
    assert cost_per_job(econ, Policy(amortize_over_jobs=9_000)) == 100 + 1


def test_cost_below_one_micro_unit_per_job_is_still_compared() -> None:
    # figures of a real local trial: both paths' jobs cost less than a micro-unit each
    reference: dict[str, Any] = {"jobs_completed": 398, "total_micros": 146, "prepare_micros": 1}
    candidate: dict[str, Any] = {"jobs_completed": 210, "total_micros": 166, "prepare_micros": 34}
    assert cost_per_job(economics(**reference), Policy()) == Fraction(146, 398)
    mine, ref = cost_per_job(economics(**candidate), Policy()), cost_per_job(economics(**reference), Policy())
    assert mine > ref  # 0.79 vs 0.37 micro-units per job: a rounded figure would read 1 vs 0
    v = judge(
        _state(10.0, 0, **reference), _state(9.0, 1, **candidate), Policy(min_cost_saving=0.0), training=False
    )
    assert v["criteria"]["cost"]["result"] == "fail", v["criteria"]["cost"]
    assert "0.7905 vs reference 0.3668" in v["criteria"]["cost"]["reason"]


def test_overall_verdict_for_the_ui_filter() -> None:
    assert overall_verdict({"a": "REJECT", "b": "ADOPT"}) == "ADOPT"
    assert overall_verdict({"a": "REJECT", "b": "INCONCLUSIVE"}) == "INCONCLUSIVE"
    assert overall_verdict({"a": "REJECT"}) == "REJECT"


def _with_fallback(state: PathState, op: str = "aten::median.dim_values", per_request: float = 1.0) -> None:
    assert state.prepare is not None and state.compatibility_on_inputs is not None
    state.prepare.compatibility.fallback_ops = {op: 16}
    state.compatibility_on_inputs.fallback_ops_per_request = {op: per_request}


def test_host_fallback_rejects_by_default_and_names_the_op_with_calls_per_request() -> None:
    candidate = _state(9.0, 80)
    _with_fallback(candidate)
    v = judge(_state(10.0, 100), candidate, Policy(), training=False)
    compat = v["criteria"]["compatibility"]
    assert v["verdict"] == "REJECT" and compat["result"] == "fail"
    assert "aten::median.dim_values 1 call per request" in compat["reason"]
    assert "1 host-fallback op(s), policy allows 0: reject" in compat["reason"]
    assert compat["figure"] == "1 host-fallback op: aten::median.dim_values 1/request, 0 graph breaks"
    assert "compatibility fail (1 host-fallback op: aten::median.dim_values 1/request" in v["line"]


def test_policy_can_allow_fallbacks_or_only_warn() -> None:
    candidate = _state(9.0, 80)
    _with_fallback(candidate)
    allowed = judge(_state(10.0, 100), candidate, Policy(max_fallback_ops=1), training=False)
    assert allowed["verdict"] == "ADOPT" and allowed["criteria"]["compatibility"]["result"] == "pass"
    warned = judge(_state(10.0, 100), candidate, Policy(compatibility_action="warn"), training=False)
    assert warned["verdict"] == "ADOPT" and warned["criteria"]["compatibility"]["result"] == "warn"
    assert warned["line"].startswith("ADOPT: ") and "compatibility warn (" in warned["line"]


def test_graph_breaks_beyond_the_maximum_reject() -> None:
    candidate = _state(9.0, 80)
    assert candidate.prepare is not None
    compat = candidate.prepare.compatibility
    compat.graph_breaks, compat.graph_break_reasons = 2, ["Call to `torch._dynamo.graph_break()`"]
    v = judge(_state(10.0, 100), candidate, Policy(max_graph_breaks=1), training=False)
    assert v["verdict"] == "REJECT"
    assert "2 graph break(s), policy allows 1" in v["criteria"]["compatibility"]["reason"]
    assert "graph_break()" in v["criteria"]["compatibility"]["reason"]
    assert (
        judge(_state(10.0, 100), candidate, Policy(max_graph_breaks=2), training=False)["verdict"] == "ADOPT"
    )


def test_latency_regression_names_the_coinciding_fallback_op() -> None:
    candidate = _state(24.7, 80)
    _with_fallback(candidate, per_request=2.0)
    v = judge(_state(10.0, 100), candidate, Policy(compatibility_action="warn"), training=False)
    latency = v["criteria"]["latency"]
    assert latency["result"] == "fail" and "+147.0%" in latency["reason"]
    assert "coincides with host fallback: aten::median.dim_values 2 calls per request" in latency["reason"]
    assert latency["figure"] == "p95 +147.0% (allowed +10%), with host fallback"
    # a regression without a fallback says nothing of one, and a faster path names none
    plain = judge(_state(10.0, 100), _state(24.7, 80), Policy(), training=False)["criteria"]["latency"]
    assert plain["result"] == "fail" and "fallback" not in plain["reason"]
    faster = _state(9.0, 80)
    _with_fallback(faster)
    quick = judge(_state(10.0, 100), faster, Policy(compatibility_action="warn"), training=False)
    assert "fallback" not in quick["criteria"]["latency"]["reason"]


def test_recompiles_on_the_trial_inputs_warn_and_are_named() -> None:
    candidate = _state(9.0, 80)
    assert candidate.compatibility_on_inputs is not None
    candidate.compatibility_on_inputs.compilations = 2
    v = judge(_state(10.0, 100), candidate, Policy(), training=False)
    compat = v["criteria"]["compatibility"]
    assert compat["result"] == "warn" and v["verdict"] == "ADOPT"
    assert "2 on the trial's inputs after warm-up (a shape that depends on the data" in compat["reason"]
    assert compat["figure"].endswith("2 recompiles on the inputs")


def test_correctness_names_non_determinism_apart_from_wrong_but_stable() -> None:
    stable = judge(_state(10.0, 100), _state(9.0, 80, passed=False), Policy(), training=False)
    assert stable["criteria"]["correctness"]["reason"].startswith("wrong but stable: y: rmse vs float64")
    assert stable["criteria"]["correctness"]["figure"] == "wrong but stable: rmse 0.001 > allowed 1e-05"
    noisy = _state(9.0, 80, passed=False)
    assert noisy.correctness is not None
    out = noisy.correctness.outputs[0]
    out.finding = "non-deterministic"
    out.metrics["candidate_repeat_max_abs"] = 0.0312
    out.reasons.insert(0, "non-deterministic: two candidate runs ... differ by up to 0.0312 ...: fail")
    v = judge(_state(10.0, 100), noisy, Policy(), training=False)
    assert v["verdict"] == "REJECT"
    assert v["criteria"]["correctness"]["reason"].startswith("non-deterministic: y: non-deterministic")
    assert v["criteria"]["correctness"]["figure"] == "non-deterministic: repeats differ by up to 0.0312"
    assert v["line"].startswith(
        "REJECT: correctness fail (non-deterministic: repeats differ by up to 0.0312)"
    )


def test_compatibility_without_findings_is_inconclusive() -> None:
    candidate = _state(9.0, 80)
    candidate.prepare = None
    candidate.errors["prepare"] = "LoadModel failed: UNAVAILABLE"
    v = judge(_state(10.0, 100), candidate, Policy(), training=False)
    assert v["criteria"]["compatibility"]["result"] == "inconclusive"
    assert "UNAVAILABLE" in v["criteria"]["compatibility"]["reason"]
