"""A generation path's latency against the reference's, per load level and metric (p99 TTFT,
p99 TPOT), decided as a tensor path's is (workflows/tensor/intervals.py): on the paired
block-bootstrap interval of the ratio at the policy's confidence when both paths kept blocks
of the level, beside the reference's own A/A spread, failing only when the whole interval
lies beyond the allowed regression and passing only when it lies within. A level measured
in one block (too few requests for MIN_BLOCKS blocks that hold its load,
workflows/generation/measure.py) is judged on the two figures, and says so.
Pure: runs in the workflow sandbox.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from workflows.generation.metrics import lengths_label
from workflows.report.results import FAIL, PASS, Result
from workflows.tensor.intervals import RatioInterval, decide, mean, noise_floor, ratio_interval

PERCENTILE = 99.0


@dataclass(frozen=True)
class LevelJudgement:
    result: Result
    reason: str
    figure: str
    excess: float  # how far beyond the bound the estimate lies (negative: within), to rank levels


def judge_level(
    label: str, metric: str, mine: dict[str, Any], theirs: dict[str, Any], allowed: float, level: float
) -> LevelJudgement | None:
    """One level's p99 of `metric` (ttft_ms, tpot_ms) on both paths; None when either has none
    (e.g. TPOT with one output token per request)."""
    a, b = mine[metric]["p99"], theirs[metric]["p99"]
    if a is None or b is None or not b:
        return None
    name = metric.split("_")[0].upper()
    what = f"p99 {name} ratio"
    head = f"{label} ({lengths_label(mine)}): p99 {name} {a:.2f} ms vs {b:.2f} ms"
    try:
        interval = ratio_interval(_blocks(mine, metric), _blocks(theirs, metric), q=PERCENTILE, level=level)
    except ValueError as err:
        change = a / b - 1
        figure = f"p99 {name} {change:+.1%} at {label} (allowed {allowed:+.0%})"
        reason = (
            f"{head}, {change:+.1%} (allowed {allowed:+.0%}); no interval ({err}): judged on the two figures"
        )
        return LevelJudgement(PASS if change <= allowed else FAIL, reason, figure, change - allowed)
    # blocks are thinned (measure.py): count the requests that were measured
    interval = dataclasses.replace(interval, samples=max(interval.samples, int(mine.get("completed", 0))))
    decision = decide(interval, allowed, what)
    try:
        aa = noise_floor(_blocks(theirs, metric), q=PERCENTILE, level=level).bracket()
    except ValueError:
        aa = "not measured (fewer than 8 reference blocks)"
    reason = f"{head}: {decision.reason}; noise floor (reference A/A) {aa}"
    figure = f"{interval.text(what)} at {label}, allowed {1 + allowed:.3g}; A/A {aa}"
    return LevelJudgement(decision.result, reason, figure, interval.low - (1 + allowed))


def time_per_token(
    mine: dict[str, dict[str, Any]], theirs: dict[str, dict[str, Any]], level: float
) -> RatioInterval | None:
    """The paired interval of the mean TPOT ratio over every level's blocks (block i of a level
    with block i of the same level), whose relative spread the cost ratio takes; None without
    enough blocks on both paths."""
    a: list[list[float]] = []
    b: list[list[float]] = []
    for label in (lab for lab in mine if lab in theirs):
        ours, ref = _blocks(mine[label], "tpot_ms"), _blocks(theirs[label], "tpot_ms")
        n = min(len(ours), len(ref))
        a, b = a + ours[:n], b + ref[:n]
    try:
        return ratio_interval(a, b, level=level, stat=mean)
    except ValueError:
        return None


def _blocks(summary: dict[str, Any], metric: str) -> list[list[float]]:
    return [list(block[metric]) for block in summary.get("blocks") or []]
