"""The latency criterion decided on intervals: the figure and reason carry the p95 ratio's
interval, the reference's A/A noise floor and how the paths were measured."""

from __future__ import annotations

import dataclasses
import random

from tests.trial.test_verdict import _state, judge
from workflows.pipeline.path_state import PathState
from workflows.spec.trial_spec import Policy
from workflows.tensor.intervals import split_blocks


def _measured(scale: float, seed: int, host: str, n: int = 400) -> PathState:
    rng = random.Random(seed)
    lat = [scale * 2.0 * rng.lognormvariate(0.0, 0.25) for _ in range(n)]
    state = _state(sorted(lat)[int(0.95 * (n - 1))], 100)
    assert state.performance is not None
    single = dataclasses.replace(state.performance.scenarios[0], blocks_ms=split_blocks(lat, 10))
    state.performance.scenarios = [single]
    state.host = host
    return state


def test_twice_as_slow_fails_with_the_interval_and_the_noise_floor() -> None:
    v = judge(_measured(1.0, 1, "h"), _measured(2.0, 2, "h"), Policy(), training=False)
    latency = v["criteria"]["latency"]
    assert latency["result"] == "fail" and v["verdict"] == "REJECT", latency
    assert "the whole interval is beyond the allowed 1.1" in latency["reason"]
    assert "noise floor (reference A/A) " in latency["reason"]
    assert "measured one after the other on host h, blocks paired in order" in latency["reason"]
    assert latency["figure"].startswith("p95 ratio ") and "at 95%, allowed 1.1; A/A " in latency["figure"]


def test_an_identical_path_is_never_rejected_on_latency() -> None:
    results = []
    for seed in range(20):
        v = judge(_measured(1.0, seed, "a"), _measured(1.0, 100 + seed, "b"), Policy(), training=False)
        results.append(v["criteria"]["latency"]["result"])
        assert "measured concurrently on separate hosts" in v["criteria"]["latency"]["reason"]
    assert "fail" not in results, results


def test_a_straddling_interval_is_inconclusive_with_what_would_settle_it() -> None:
    reference, candidate = _measured(1.0, 3, "h", n=40), _measured(1.1, 4, "h", n=40)
    v = judge(reference, candidate, Policy(), training=False)
    latency = v["criteria"]["latency"]
    assert latency["result"] == "inconclusive" and v["verdict"] == "INCONCLUSIVE", latency
    assert "more requests" in latency["reason"]


def test_the_policy_confidence_sets_the_level() -> None:
    reference, candidate = _measured(1.0, 5, "h"), _measured(1.0, 6, "h")
    wide = judge(reference, candidate, Policy(confidence=0.99), training=False)["criteria"]["latency"]
    narrow = judge(reference, candidate, Policy(confidence=0.8), training=False)["criteria"]["latency"]
    assert " at 99% over 10 paired blocks" in wide["reason"]
    assert " at 80% over 10 paired blocks" in narrow["reason"]


def test_too_few_blocks_is_inconclusive_not_decided() -> None:
    reference, candidate = _measured(1.0, 7, "h", n=3), _measured(3.0, 8, "h", n=3)
    latency = judge(reference, candidate, Policy(), training=False)["criteria"]["latency"]
    assert latency["result"] == "inconclusive" and latency["figure"] == "too few blocks", latency
    assert "an interval needs at least 4" in latency["reason"]


def test_slow_first_calls_make_latency_inconclusive_as_a_short_warm_up() -> None:
    reference, candidate = _measured(1.0, 9, "h"), _measured(1.0, 10, "h")
    assert candidate.performance is not None
    single = candidate.performance.scenarios[0]
    flat = [v for b in single.blocks_ms for v in b]
    flat[:130] = [v * 3 for v in flat[:130]]  # the first calls after warm-up three times slower
    candidate.performance.scenarios = [dataclasses.replace(single, blocks_ms=split_blocks(flat, 10))]
    latency = judge(reference, candidate, Policy(), training=False)["criteria"]["latency"]
    assert latency["result"] == "inconclusive", latency
    assert latency["reason"].startswith(
        "warm-up too short: p50 ratio to the reference, last third / first third "
    )
    assert "(candidate p50 last third / first third " in latency["reason"]  # whose warm-up: each path's own
    assert latency["figure"].startswith(
        "warm-up too short (p50 ratio to the reference, last third / first third "
    )
    unchecked = judge(reference, candidate, Policy(max_latency_drift=0.0), training=False)
    assert not unchecked["criteria"]["latency"]["reason"].startswith("warm-up too short")


def _costing(state: PathState, cpj: int) -> PathState:
    assert state.economics is not None
    state.economics = dataclasses.replace(
        state.economics, total_micros=cpj * 100, cost_per_completed_job_micros=cpj
    )
    return state


def test_a_cost_within_its_noise_is_inconclusive_never_rejected() -> None:
    # an identical path 1% dearer in the ledger, within its time's noise (about +-3% here):
    # no saving shown, none disproved
    for seed in range(10):
        reference = _measured(1.0, seed, "h")
        candidate = _costing(_measured(1.0, 50 + seed, "h"), 101)
        cost = judge(reference, candidate, Policy(), training=False)["criteria"]["cost"]
        assert cost["result"] == "inconclusive", cost
        assert "cost ratio 1.010 [" in cost["figure"] and "mean latency ratio" in cost["reason"]


def test_twice_the_cost_of_twice_the_time_fails_on_its_interval() -> None:
    reference, candidate = _measured(1.0, 11, "h"), _costing(_measured(2.0, 12, "h"), 200)
    cost = judge(reference, candidate, Policy(), training=False)["criteria"]["cost"]
    assert cost["result"] == "fail", cost
    assert cost["figure"].startswith("saving -100.0% (needs +0%); cost ratio 2.000 [")
    assert "the whole interval is beyond the allowed 1" in cost["reason"]
