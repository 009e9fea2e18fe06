"""The stopping rule of a measurement that extends itself: after the planned blocks, while a
candidate's single-stream p95 interval straddles its bound, measure more paired blocks and
look again, until every interval is decided or the budget is spent.

Pure: no grpc, no temporal. The activity that measures in alternating blocks
(workflows/tensor/performance.py) hands `extend` two callables, one that reads every path's
blocks so far and one that measures a `Round` more of them, so the rule is tested here with
any latencies (tests/trial/test_extension.py).

The rule, looked at after the planned blocks and after every round:

1. Each candidate's interval is the verdict's (workflows/tensor/verdict.py): the paired block
   bootstrap of the p95 ratio against the reference at the policy's confidence, the blocks
   thinned as the report keeps them, decided by `intervals.decide` against
   1 + `max_p95_regression`. When every one is decided (pass or fail), stop: "decided".
2. Otherwise the next round measures, per path, at least the most "run at least N more
   requests" of the undecided ones, and at least the remaining budget shared over the rounds
   left (at most MAX_ROUNDS), in paired blocks of the planned blocks' size (smaller when the
   budget left is), an even number of them, so that the order keeps alternating (AB, BA, ...)
   and neither path leads more often.
3. Stop with "budget" when less than one pair of blocks (2 requests) is left; with "on the
   bound" when every undecided ratio sits on its bound (no count of requests settles it); with
   "no interval" when one cannot be computed.

Each look is a chance to stop on a wrong decision (optional stopping). The first look is the
one the trial makes without extending, at the policy's confidence c, so an interval decided
there is decided as before. Every later look, and the verdict of an extended measurement, is
at `extended_level(c)` = 1 - (1 - c) / (2 MAX_ROUNDS) (98.75% for 95%): the MAX_ROUNDS later
looks together spend at most half the first look's error again (Bonferroni), so a false
decision is at most 1.5 (1 - c) over the whole measurement instead of growing with each look.
On a busy host, an A/A trial whose planned interval was 1.997 [1.023, 6.429] at 95% was
rejected after 2 more blocks at 95% (3.610 [1.228, 7.720]): the reason for the stricter level.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from workflows.pipeline.types import Extension, ExtensionRule, ScenarioResult
from workflows.report.results import UNKNOWN
from workflows.tensor.intervals import (
    Blocks,
    Decision,
    RatioInterval,
    decide,
    level_text,
    ratio_interval,
    thin,
)

MAX_ROUNDS = 2  # extension rounds, so at most 3 looks at the intervals


@dataclass(frozen=True)
class Round:
    """More paired blocks to measure: `slots` time slots, each path `size` requests in each."""

    slots: int
    size: int

    @property
    def requests(self) -> int:
        """Requests per path."""
        return self.slots * self.size


@dataclass(frozen=True)
class Look:
    """Every candidate's interval and decision at one point of the measurement."""

    intervals: dict[str, RatioInterval]
    decisions: dict[str, Decision]
    problem: str = ""  # why no interval could be computed

    def undecided(self) -> list[str]:
        return [name for name, d in self.decisions.items() if d.result == UNKNOWN]

    def need(self) -> int:
        """The most requests an undecided candidate's interval asks for; -1 when every
        undecided ratio sits on its bound, 0 when none is undecided."""
        wanted = [self.decisions[n].more_requests for n in self.undecided()]
        if not wanted:
            return 0
        return max(wanted) if any(w > 0 for w in wanted) else -1


def extended_level(confidence: float) -> float:
    """The level of every look after the planned one (module doc)."""
    return 1.0 - (1.0 - confidence) / (2 * MAX_ROUNDS)


def verdict_level(record: Extension | None, confidence: float) -> float:
    """The level the verdict judges a single-stream latency at: the policy's, or the stricter
    one of an extended measurement."""
    return extended_level(confidence) if record is not None and record.rounds else confidence


def look(rule: ExtensionRule, blocks: Mapping[str, Blocks], keep: int, level: float) -> Look:
    """The candidates' intervals as the verdict will compute them from the report's blocks
    (each thinned to `keep` values, the requests counted as measured), at `level`."""
    reference = [thin(b, keep) for b in blocks[rule.reference]]
    intervals: dict[str, RatioInterval] = {}
    decisions: dict[str, Decision] = {}
    for name, mine in blocks.items():
        if name == rule.reference:
            continue
        try:
            interval = ratio_interval([thin(b, keep) for b in mine], reference, level=level)
        except ValueError as err:
            return Look(intervals, decisions, f"{name}: {err}")
        interval = dataclasses.replace(interval, samples=max(interval.samples, sum(len(b) for b in mine)))
        intervals[name] = interval
        decisions[name] = decide(interval, rule.max_p95_regression)
    return Look(intervals, decisions)


def block_size(blocks: Blocks) -> int:
    """Requests per planned block (their mean, rounded up): extra blocks are alike."""
    filled = [len(b) for b in blocks if b]
    return max(1, math.ceil(sum(filled) / len(filled))) if filled else 1


def next_round(need: int, remaining: int, size: int, rounds_left: int) -> Round | None:
    """The round that measures at least `need` requests per path and the budget left shared
    over the rounds left, within `remaining`, in pairs of blocks of at most `size`; None when
    less than one pair fits."""
    if remaining < 2 or rounds_left < 1:
        return None
    size = max(1, min(size, remaining // 2))
    want = min(remaining, max(need, math.ceil(remaining / rounds_left)))
    pairs = min(max(1, math.ceil(want / (2 * size))), remaining // (2 * size))
    return Round(2 * pairs, size)


def _text(record: Extension, problem: str) -> str:
    n, budget = record.extra_requests, record.budget
    before = "; ".join(f"{k} {v}" for k, v in record.before.items())
    level = level_text(record.level)
    added = f"{record.extra_blocks} more paired blocks in {record.rounds} round(s), judged at {level}"
    where = f"{added}; p95 ratio at the planned blocks: {before}"
    if record.stopped == "decided" and not n:
        return "not extended: every latency interval was decided at the planned blocks"
    if record.stopped == "decided":
        return f"measurement extended: interval decided after +{n:,} requests per path ({where})"
    if record.stopped == "budget":
        return f"measurement extended: budget of {budget:,} extra requests spent, +{n:,} per path ({where})"
    if record.stopped == "on the bound":
        return f"not extended further: the ratio sits on the bound, +{n:,} requests per path ({where})"
    return f"not extended: no interval ({problem})"


async def extend(
    rule: ExtensionRule,
    blocks: Callable[[], Mapping[str, Blocks]],
    measure: Callable[[Round], Awaitable[None]],
    keep: int,
) -> Extension:
    """Measure more paired blocks until every candidate's interval is decided or the budget
    is spent (module doc); what was measured and why it stopped."""
    current = look(rule, blocks(), keep, rule.confidence)
    record = Extension(budget=rule.max_extra_requests, level=rule.confidence)
    at = level_text(rule.confidence)
    record.before = {n: f"{current.intervals[n].bracket()} at {at}" for n in current.undecided()}
    size = block_size(blocks()[rule.reference])
    while True:
        if current.problem:
            record.stopped = "no interval"
            break
        if not current.undecided():
            record.stopped = "decided"
            break
        if current.need() < 0:
            record.stopped = "on the bound"
            break
        left = rule.max_extra_requests - record.extra_requests
        step = next_round(current.need(), left, size, MAX_ROUNDS - record.rounds)
        if step is None:
            record.stopped = "budget"
            break
        await measure(step)
        record.extra_requests += step.requests
        record.extra_blocks += step.slots
        record.rounds += 1
        record.level = extended_level(rule.confidence)
        current = look(rule, blocks(), keep, record.level)
    record.text = _text(record, current.problem)
    return record


def attach(done: list[ScenarioResult], record: Extension | None) -> None:
    """Put the record on a path's single-stream scenario (the one extended)."""
    for scenario in done if record is not None else []:
        if scenario.scenario == "single-stream":
            scenario.extension = record


def restored(saved: dict[str, object]) -> ScenarioResult:
    """A finished scenario from a retried attempt's heartbeat (its extension a dict there)."""
    extension = saved.get("extension")
    fields = {**saved, "extension": Extension(**extension) if isinstance(extension, dict) else None}
    return ScenarioResult(**fields)  # type: ignore[arg-type]
