"""Verdict rules on report data: each criterion decides, with its reason."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from workflows.spec import Policy
from workflows.verdict import cost_per_job, judge, overall_verdict


def _state(p95: float, cpj: int, passed: bool = True, **econ: Any) -> dict[str, Any]:
    return {
        "errors": {},
        "correctness": {"passed": passed, "outputs": [{"output": "y", "reasons": ["rmse ...: pass"]}]},
        "performance": {"scenarios": [{"scenario": "single-stream", "batch_size": 1, "p95_ms": p95}]},
        "economics": {
            "cost_per_completed_job_micros": cpj,
            "currency": "USD",
            "jobs_completed": 100,
            "total_micros": cpj * 100,
            "prepare_micros": 0,
            "unpriced": False,
            **econ,
        },
        "training": {},
    }


def test_adopt_when_every_criterion_passes() -> None:
    v = judge(_state(10.0, 100), _state(9.0, 80), Policy(), training=False)
    assert v["verdict"] == "ADOPT"
    assert set(v["criteria"]) == {"correctness", "latency", "cost"}


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
    candidate["errors"]["performance"] = "2 compilation(s) or recompile(s) while measuring"
    v = judge(_state(10.0, 100), candidate, Policy(), training=False)
    assert v["verdict"] == "INCONCLUSIVE" and v["criteria"]["latency"]["result"] == "inconclusive"


def test_amortised_cost_spreads_preparation() -> None:
    econ = {
        "jobs_completed": 10,
        "total_micros": 10_000,
        "prepare_micros": 9_000,
        "cost_per_completed_job_micros": 1_000,
    }
    assert cost_per_job(econ, Policy()) == 1_000
    assert cost_per_job(econ, Policy(amortize_over_jobs=9_000)) == 100 + 1


def test_cost_below_one_micro_unit_per_job_is_still_compared() -> None:
    # figures of a real local trial: both paths' jobs cost less than a micro-unit each
    reference: dict[str, Any] = {"jobs_completed": 398, "total_micros": 146, "prepare_micros": 1}
    candidate: dict[str, Any] = {"jobs_completed": 210, "total_micros": 166, "prepare_micros": 34}
    assert cost_per_job(reference, Policy()) == Fraction(146, 398)
    mine, ref = cost_per_job(candidate, Policy()), cost_per_job(reference, Policy())
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
