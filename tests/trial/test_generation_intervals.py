"""A generation level's p99 TTFT and TPOT, and the cost per million tokens, judged on paired
block-bootstrap intervals (workflows/generation/latency.py), on seeded synthetic blocks: a
candidate 2x slower fails with an interval that excludes the bound, 1.05x slower is never
rejected, an A/A pair is never rejected, and a level with too few requests for blocks is
judged on the two figures and says so. Also how measure.py cuts a level into blocks."""

from __future__ import annotations

import random
from typing import Any

import pytest

from workflows.generation.latency import judge_level, time_per_token
from workflows.generation.measure import block_count, per_block, slices
from workflows.report.results import FAIL, PASS, UNKNOWN
from workflows.tensor.intervals import decide, percentile, rescaled

LEVEL = "concurrency 1"


def level(seed: int, blocks: int = 10, per: int = 16, scale: float = 1.0) -> dict[str, Any]:
    """A level's summary as measure.py writes it: p99s of the pooled samples and the blocks."""
    rng = random.Random(seed)
    cut = [
        {
            "ttft_ms": [scale * 30 * rng.lognormvariate(0, 0.2) for _ in range(per)],
            "tpot_ms": [scale * 12 * rng.lognormvariate(0, 0.1) for _ in range(per)],
        }
        for _ in range(blocks)
    ]
    pooled = {m: [v for b in cut for v in b[m]] for m in ("ttft_ms", "tpot_ms")}
    lengths = {"mean": 16.0, "min": 16, "max": 16, "total": 16 * blocks * per}
    return {
        "ttft_ms": {"p99": percentile(pooled["ttft_ms"], 99)},
        "tpot_ms": {"p99": percentile(pooled["tpot_ms"], 99)},
        "blocks": cut,
        "completed": blocks * per,
        "input_tokens": lengths,
        "output_tokens": lengths,
    }


@pytest.mark.parametrize("metric", ["ttft_ms", "tpot_ms"])
def test_twice_as_slow_fails_with_the_bound_outside_the_interval(metric: str) -> None:
    for seed in range(5):
        j = judge_level(LEVEL, metric, level(100 + seed, scale=2.0), level(seed), 0.1, 0.95)
        assert j is not None and j.result == FAIL, j
        assert "the whole interval is beyond the allowed 1.1" in j.reason and "noise floor" in j.reason
        assert j.excess > 0 and f"p99 {metric[:4].upper()} ratio" in j.figure


@pytest.mark.parametrize("metric", ["ttft_ms", "tpot_ms"])
def test_five_percent_slower_or_the_same_path_is_never_rejected(metric: str) -> None:
    for seed in range(10):
        slower = judge_level(LEVEL, metric, level(200 + seed, scale=1.05), level(seed), 0.1, 0.95)
        same = judge_level(LEVEL, metric, level(300 + seed), level(seed), 0.1, 0.95)
        assert slower is not None and slower.result in (PASS, UNKNOWN), slower
        assert same is not None and same.result in (PASS, UNKNOWN), same
        if slower.result == UNKNOWN:  # it names what would settle it
            assert "more requests" in slower.reason or "sits on the bound" in slower.reason


def test_a_level_without_blocks_is_judged_on_the_two_figures_and_says_so() -> None:
    mine, theirs = level(1, scale=2.0), level(2)
    mine["blocks"] = theirs["blocks"] = []
    j = judge_level(LEVEL, "ttft_ms", mine, theirs, 0.1, 0.95)
    assert j is not None and j.result == FAIL and "judged on the two figures" in j.reason, j
    mine["tpot_ms"]["p99"] = None  # one output token per request: no TPOT
    assert judge_level(LEVEL, "tpot_ms", mine, theirs, 0.1, 0.95) is None


def test_the_cost_ratio_takes_the_spread_of_the_time_per_token_over_every_level() -> None:
    mine = {LEVEL: level(1, scale=2.0), "concurrency 4": level(3, blocks=4, scale=2.0)}
    theirs = {LEVEL: level(2), "concurrency 4": level(4, blocks=4)}
    spread = time_per_token(mine, theirs, 0.95)
    assert spread is not None and spread.blocks == 14 and 1.8 < spread.ratio < 2.2, spread
    cost = rescaled(spread, 1.5)  # the exact ledger ratio, with the time's relative spread
    assert cost.ratio == 1.5 and cost.low / cost.ratio == pytest.approx(spread.low / spread.ratio)
    assert decide(cost, -0.0, "cost ratio").result == FAIL  # the whole interval costs more
    assert time_per_token({LEVEL: {**level(1), "blocks": []}}, {LEVEL: level(2)}, 0.95) is None


def test_a_block_holds_the_load_of_its_level() -> None:
    assert per_block({"arrival": "concurrency", "concurrency": 4}) == 4
    assert per_block({"arrival": "poisson", "request_rate": 8.0}) == 8  # a second of arrivals
    assert per_block({"arrival": "poisson", "request_rate": 0.5, "max_concurrency": 2}) == 4
    assert block_count(16, {"arrival": "concurrency", "concurrency": 1}, 10) == 10
    assert block_count(16, {"arrival": "concurrency", "concurrency": 4}, 10) == 4
    assert block_count(8, {"arrival": "concurrency", "concurrency": 4}, 10) == 1  # 2 < MIN_BLOCKS
    runs = slices(10, 4)
    assert [len(r) for r in runs] == [3, 3, 2, 2] and [i for r in runs for i in r] == list(range(10))
