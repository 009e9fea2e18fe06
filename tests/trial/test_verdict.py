"""Verdict rules on report data: each criterion decides, with its reason."""

from __future__ import annotations

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


def test_overall_verdict_for_the_ui_filter() -> None:
    assert overall_verdict({"a": "REJECT", "b": "ADOPT"}) == "ADOPT"
    assert overall_verdict({"a": "REJECT", "b": "INCONCLUSIVE"}) == "INCONCLUSIVE"
    assert overall_verdict({"a": "REJECT"}) == "REJECT"
