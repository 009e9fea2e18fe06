"""Memory growth per request (workflows/tensor/growth.py) and the memory criterion built on it:
a steady leak is fitted and failed on its interval, a flat path passes, one jump of the
allocator is not taken for a leak, growth the reference shows too is not the candidate's, and
the verdict names the growth beside the reference's."""

from __future__ import annotations

import random
import re

import pytest

from tests.trial.test_verdict import _state, judge
from workflows.pipeline.path_state import PathState
from workflows.report.results import FAIL, PASS, UNKNOWN
from workflows.spec.trial_spec import Policy
from workflows.tensor import growth

KIB = 1 << 10
PAGE = 4 * KIB


def _steps(per_request: int, count: int = 20, seed: int = 0, pages: int = 3) -> list[growth.Step]:
    """`count` sampling intervals of 10 requests each: `per_request` bytes kept per request,
    plus the page-sized noise of an allocator (up to `pages` pages either way per interval)."""
    rng = random.Random(seed)
    return [(10, per_request * 10 + PAGE * rng.randint(-pages, pages)) for _ in range(count)]


def _alone(steps: list[growth.Step]) -> growth.Judged:
    return growth.judge(steps, None, 1.0, "memory", 0.95)


def test_theil_sen_is_the_slope_of_a_straight_line_and_ignores_a_few_jumps() -> None:
    assert growth.theil_sen([(10, 160 * KIB)] * 8) == pytest.approx(16 * KIB)
    steps = [(10, 1000)] * 20
    steps[3] = (10, 8 << 20)  # one large jump among twenty steady steps: the median stays
    steps[15] = (10, -(8 << 20))
    assert growth.theil_sen(steps) == pytest.approx(100, rel=0.05)


def test_a_steady_leak_fails_on_an_interval_that_holds_its_rate() -> None:
    fit = growth.slope(_steps(16 * KIB))
    rate = 16 * KIB * 1000 / growth.MIB  # 15.625 MiB per 1,000 requests
    assert fit.low <= rate <= fit.high and fit.high - fit.low < 1.0, fit
    assert (fit.steps, fit.requests) == (14, 140)  # the first third is the path settling
    decision = _alone(_steps(16 * KIB)).decision
    assert decision.result == FAIL, decision
    assert decision.reason.startswith(f"memory grows {fit.mib:+.1f} MiB per 1,000 requests [")
    assert "not sampled (allowed 1.0): the whole interval is beyond the allowed growth" in decision.reason


def test_flat_memory_passes_and_the_fit_is_seeded() -> None:
    steps = _steps(0, seed=3)
    fit = growth.slope(steps)
    assert fit.low <= 0.0 <= fit.high and fit.high < 1.0, fit
    assert _alone(steps).decision.result == PASS
    assert growth.slope(steps) == fit  # a replayed workflow gets the same interval
    assert growth.slope(steps, seed=1) != fit


def test_one_jump_is_not_a_leak_but_is_not_passed_either() -> None:
    steps = _steps(0, seed=5)
    steps[10] = (10, 4 << 20)  # an arena filled once: 4 MiB in one interval, flat around it
    fit = growth.slope(steps)
    assert fit.low <= 1.0 < fit.high, fit  # draws without the jump are flat: the interval is wide
    decision = _alone(steps).decision
    assert decision.result == UNKNOWN and decision.more_requests > 0, decision
    assert f"straddles the allowed growth: run at least {decision.more_requests:,} more requests" in (
        decision.reason
    )


def test_what_a_path_allocates_as_it_starts_is_not_growth_per_request() -> None:
    steps = _steps(0, 21, seed=7)
    for i in range(6):  # threads' stacks and caches touched by the first requests: 3 MiB
        steps[i] = (10, 512 * KIB)
    assert _alone(steps).decision.result == PASS
    assert growth.settled(steps) == steps[7:]
    leak = _steps(16 * KIB, 21, seed=7)
    leak[:6] = [(10, 0)] * 6  # a leak whose first calls fill the heap's free holes
    assert _alone(leak).decision.result == FAIL


def test_growth_the_reference_shows_too_is_not_the_candidates() -> None:
    # both paths in one process that grows 2 KiB per request (a worker that keeps its samples)
    shared = growth.judge(
        _steps(2 * KIB, 40, 1, pages=1), _steps(2 * KIB, 40, 2, pages=1), 1.0, "memory", 0.95
    )
    assert shared.decision.result == PASS and "(the reference grows too)" in shared.decision.reason, shared
    assert re.fullmatch(
        r"memory grows \+[12]\.\d\d MiB per 1,000 requests \[.*\], [-+]0\.\d\d \[.*\] "
        r"beyond the reference's \+[12]\.\d\d \[.*\] \(allowed 1\.0\)",
        shared.figure,
    ), shared.figure
    alone = _alone(_steps(2 * KIB, 40, 1, pages=1))
    assert alone.decision.result == FAIL, alone  # by itself, 1.95 MiB per 1,000 is beyond 1.0
    leak = growth.judge(_steps(18 * KIB, 40, 1), _steps(2 * KIB, 40, 2), 1.0, "memory", 0.95)
    assert leak.decision.result == FAIL and "], +15." in leak.figure, leak


def test_steps_without_requests_join_the_next_and_many_are_merged() -> None:
    assert growth.merged([(0, 5), (10, 1), (0, 7)]) == [(10, 13)]
    many = growth.merged([(1, 2)] * 100)
    assert len(many) <= growth.MAX_STEPS and sum(s[0] for s in many) == 100
    assert sum(s[1] for s in many) == 200
    with pytest.raises(ValueError, match="at least 4"):
        growth.slope([(10, 1)] * 3)
    rows = [[10, 100, 7], [5, 50, 3]]
    assert growth.steps_of(rows, 1) == [(10, 100), (5, 50)] and growth.steps_of(rows, 2) == [(10, 7), (5, 3)]


def _sampled(per_request: int, seed: int, device: int | None = None) -> PathState:
    state = _state(2.0, 100)
    assert state.performance is not None
    rows = _steps(per_request, seed=seed)
    device_rows = _steps(device or 0, seed=seed + 1)
    state.performance.memory_steps = [[r, b, d] for (r, b), (_, d) in zip(rows, device_rows, strict=True)]
    state.performance.memory_device_reported = device is not None
    return state


def test_the_verdict_names_a_leak_beside_the_reference_slope() -> None:
    v = judge(_sampled(0, 1), _sampled(16 * KIB, 2), Policy(), training=False)
    memory = v["criteria"]["memory"]
    assert memory["result"] == "fail" and v["verdict"] == "REJECT", memory
    found = re.fullmatch(
        r"memory grows \+([\d.]+) MiB per 1,000 requests \[\+([\d.]+), \+([\d.]+)\], "
        r"\+([\d.]+) \[\+([\d.]+), \+[\d.]+\] beyond the reference's "
        r"([-+][\d.]+) \[([-+][\d.]+), ([-+][\d.]+)\] \(allowed 1\.0\)",
        memory["figure"],
    )
    assert found, memory["figure"]
    mib, low, high, beyond, beyond_low, floor, floor_low, floor_high = (float(g) for g in found.groups())
    assert low <= 15.625 <= high and low > 1.0 and abs(mib - 15.625) < 0.5, memory
    assert beyond_low > 1.0 and abs(beyond - mib + floor) < 0.05, memory
    assert floor_low <= 0.0 <= floor_high and abs(floor) < 1.0, memory
    assert "the whole interval is beyond the allowed growth" in memory["reason"]
    assert list(v["criteria"]) == ["correctness", "compatibility", "latency", "memory", "cost"]


def test_the_honest_path_passes_and_unsampled_or_unchecked_is_skipped() -> None:
    v = judge(_sampled(0, 1), _sampled(0, 2), Policy(), training=False)
    assert v["criteria"]["memory"]["result"] == "pass", v["criteria"]["memory"]
    plain = judge(_state(2.0, 100), _state(2.0, 100), Policy(), training=False)["criteria"]["memory"]
    assert plain["result"] == "skipped" and "reports no process memory" in plain["reason"]
    off = judge(_sampled(0, 1), _sampled(16 * KIB, 2), Policy(max_memory_growth_mib=0.0), training=False)
    assert off["criteria"]["memory"]["result"] == "skipped" and off["verdict"] != "REJECT"


def test_device_memory_is_judged_where_the_executor_reports_it() -> None:
    v = judge(_sampled(0, 1, device=0), _sampled(0, 2, device=64 * KIB), Policy(), training=False)
    memory = v["criteria"]["memory"]
    assert memory["result"] == "fail", memory
    host, device = memory["figure"].split("; device memory grows ")
    assert re.match(r"memory grows [-+]0\.\d\d MiB per 1,000 requests", host), memory
    assert re.match(r"\+6\d\.\d MiB per 1,000 requests \[", device), memory  # 62.5
    assert "device memory" in memory["reason"] and "beyond the allowed growth" in memory["reason"]
