"""Confidence intervals for a candidate/reference ratio of a latency percentile, and the rule
that decides on the whole interval.

Pure statistics, standard library only (no grpc, no temporal, no numpy), so the verdict can
run it inside the workflow sandbox, and seeded, so a replayed workflow gets the same interval.

The method: each path's samples are kept in blocks of consecutive requests (measured in
alternating blocks when the paths share a host). A block bootstrap resamples block indices
with replacement, the same indices for both paths (paired: block i of the candidate was
measured next to block i of the reference, so drift on the host hits both alike), pools the
chosen blocks' samples and takes the ratio of the percentiles. The interval is the
percentile interval of those ratios at the policy's confidence level. The noise floor is the
same interval for the reference against itself: its even blocks against its odd ones (Diffy's
A/A difference).

The decision: FAIL only when the whole interval lies beyond the allowed regression, PASS only
when the whole interval lies within it, else INCONCLUSIVE, naming how many more requests would
settle it (an interval's width shrinks about as 1/sqrt(n)).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from workflows.report.results import FAIL, PASS, UNKNOWN, Result

RESAMPLES = 1000
MIN_BLOCKS = 4  # fewer blocks cannot give an interval (nor an A/A split into two halves)

Blocks = Sequence[Sequence[float]]


@dataclass(frozen=True)
class RatioInterval:
    """The candidate/reference ratio of a percentile, with its bootstrap interval."""

    ratio: float
    low: float
    high: float
    level: float
    blocks: int
    samples: int  # the candidate's samples in the paired blocks

    def bracket(self) -> str:
        return f"{self.ratio:.3f} [{self.low:.3f}, {self.high:.3f}]"

    def text(self, what: str = "p95 ratio") -> str:
        return f"{what} {self.bracket()}"


@dataclass(frozen=True)
class Decision:
    result: Result
    reason: str
    more_requests: int = 0  # for an inconclusive one: the estimate of what would settle it


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def split_blocks(samples: Sequence[float], count: int) -> list[list[float]]:
    """Consecutive samples in `count` blocks of near-equal size (the first ones one longer)."""
    if count < 1:
        raise ValueError("count must be at least 1")
    count = min(count, len(samples))
    size, extra = divmod(len(samples), count) if count else (0, 0)
    out, start = [], 0
    for i in range(count):
        end = start + size + (1 if i < extra else 0)
        out.append(list(samples[start:end]))
        start = end
    return out


def _pooled(blocks: Blocks, picks: Sequence[int]) -> list[float]:
    return [v for i in picks for v in blocks[i]]


def mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def ratio_interval(
    candidate: Blocks,
    reference: Blocks,
    q: float = 95.0,
    level: float = 0.95,
    seed: int = 0,
    resamples: int = RESAMPLES,
    stat: Callable[[Sequence[float]], float] | None = None,
) -> RatioInterval:
    """The paired block-bootstrap interval of percentile(candidate) / percentile(reference),
    or of another statistic of the pooled samples (`stat`, e.g. `mean`).

    Blocks pair by index; a path with more blocks has its extra ones left out."""
    figure = stat or (lambda values: percentile(values, q))
    if not 0.0 < level < 1.0:
        raise ValueError("level must be between 0 and 1")
    n = min(len(candidate), len(reference))
    cand = [list(b) for b in candidate[:n] if b]
    ref = [list(b) for b in reference[:n] if b]
    n = min(len(cand), len(ref))
    if n < MIN_BLOCKS:
        raise ValueError(f"{n} paired block(s): an interval needs at least {MIN_BLOCKS}")
    everything = list(range(n))
    base = figure(_pooled(ref, everything))
    if base <= 0:
        raise ValueError("the reference's figure is 0: no basis for a ratio")
    ratio = figure(_pooled(cand, everything)) / base
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        picks = [rng.randrange(n) for _ in range(n)]
        r = figure(_pooled(ref, picks))
        ratios.append(figure(_pooled(cand, picks)) / r if r > 0 else math.inf)
    tail = (1.0 - level) / 2 * 100
    low, high = percentile(ratios, tail), percentile(ratios, 100 - tail)
    samples = sum(len(b) for b in cand)
    return RatioInterval(ratio, min(low, ratio), max(high, ratio), level, n, samples)


def rescaled(spread: RatioInterval, ratio: float) -> RatioInterval:
    """Another ratio with `spread`'s relative interval (a cost ratio with the spread of the
    time ratio it follows)."""
    return replace(
        spread, ratio=ratio, low=ratio * spread.low / spread.ratio, high=ratio * spread.high / spread.ratio
    )


def noise_floor(reference: Blocks, q: float = 95.0, level: float = 0.95, seed: int = 0) -> RatioInterval:
    """The reference against itself: its even blocks against its odd ones (A/A)."""
    return ratio_interval(reference[1::2], reference[0::2], q, level, seed)


def more_requests(interval: RatioInterval, bound: float) -> int:
    """About how many more requests (per path) would shrink the interval off the bound.

    The half-width on the bound's side must fall to the ratio's distance from the bound;
    width scales as 1/sqrt(n), so n must grow by (half-width / distance)^2. Returns -1 when
    the ratio sits on the bound (no count of requests settles it)."""
    side = interval.high - interval.ratio if interval.ratio < bound else interval.ratio - interval.low
    distance = abs(bound - interval.ratio)
    if distance <= 1e-9 * max(1.0, bound):
        return -1
    factor = (side / distance) ** 2
    return max(1, math.ceil(interval.samples * (factor - 1.0)))


def level_text(level: float) -> str:
    """A confidence level as a percentage that keeps its digits: 95%, 99.9%."""
    return f"{level * 100:.4g}%"


def decide(interval: RatioInterval, allowed: float, what: str = "p95 ratio") -> Decision:
    """FAIL only if the whole interval lies above 1 + allowed, PASS only if it lies at or below."""
    bound = 1.0 + allowed
    stated = f"{interval.text(what)} at {level_text(interval.level)} over {interval.blocks} paired blocks"
    more = more_requests(interval, bound)
    return on_bound(interval.low, interval.high, bound, stated, more, f"{bound:.3g}", "ratio")


def on_bound(
    low: float, high: float, bound: float, stated: str, more: int, allowed: str, what: str
) -> Decision:
    """The rule every interval is decided by: FAIL only if the whole of [low, high] lies above
    `bound`, PASS only if it lies at or below, else INCONCLUSIVE naming the `more` requests
    that would settle it (-1: the estimate sits on the bound). `allowed` and `what` name the
    bound and the estimate in the reason."""
    if low > bound:
        return Decision(FAIL, f"{stated}: the whole interval is beyond the allowed {allowed}")
    if high <= bound:
        return Decision(PASS, f"{stated}: the whole interval is within the allowed {allowed}")
    settle = (
        f"the {what} sits on the bound; more requests will not settle it"
        if more < 0
        else f"run at least {more:,} more requests"
    )
    return Decision(UNKNOWN, f"{stated} straddles the allowed {allowed}: {settle}", max(more, 0))


@dataclass(frozen=True)
class Drift:
    """A path's own latency, its last third against its first third of the measurement (or,
    `paired_drift`, the candidate/reference ratio's)."""

    interval: RatioInterval
    beyond: bool  # the whole interval lies outside [1 / (1 + bound), 1 + bound]
    what: str = "p95 last third / first third"  # the percentile it compares, and of what

    def text(self) -> str:
        return self.interval.text(self.what)


def drift(blocks: Blocks, bound: float, q: float = 95.0, level: float = 0.95, seed: int = 0) -> Drift:
    """Whether latency moved during the measurement (a warm-up too short, or a path that slows).

    The samples in measured order are cut in thirds; the first and last are each split into
    MIN_BLOCKS blocks and compared with the same interval method."""
    samples = [v for b in blocks for v in b]
    third = len(samples) // 3
    if third < MIN_BLOCKS:
        raise ValueError(f"{len(samples)} samples: a drift interval needs at least {3 * MIN_BLOCKS}")
    first = split_blocks(samples[:third], MIN_BLOCKS)
    last = split_blocks(samples[-third:], MIN_BLOCKS)
    iv = ratio_interval(last, first, q, level, seed)
    return Drift(
        iv, iv.low > 1.0 + bound or iv.high < 1.0 / (1.0 + bound), f"p{q:g} last third / first third"
    )


def _thirds(blocks: Blocks) -> tuple[list[list[float]], list[list[float]]]:
    """A path's samples in measured order cut in thirds: the first and the last, each in
    MIN_BLOCKS blocks."""
    samples = [v for b in blocks for v in b]
    third = len(samples) // 3
    if third < MIN_BLOCKS:
        raise ValueError(f"{len(samples)} samples: a drift interval needs at least {3 * MIN_BLOCKS}")
    return split_blocks(samples[:third], MIN_BLOCKS), split_blocks(samples[-third:], MIN_BLOCKS)


def paired_drift(
    candidate: Blocks,
    reference: Blocks,
    bound: float,
    q: float = 95.0,
    level: float = 0.95,
    seed: int = 0,
    resamples: int = RESAMPLES,
) -> Drift:
    """Whether the candidate/reference ratio moved during the measurement: (candidate last
    third / reference last third) / (candidate first third / reference first third), with a
    bootstrap that draws the same blocks of each third for both paths. A host whose load
    changes while the two are measured in alternating blocks slows both alike, and cancels
    here (the Diffy subtraction); one path's own warm-up, too short, does not."""
    cand_first, cand_last = _thirds(candidate)
    ref_first, ref_last = _thirds(reference)

    def ratio(picks_first: Sequence[int], picks_last: Sequence[int]) -> float:
        def p(blocks: list[list[float]], picks: Sequence[int]) -> float:
            return max(percentile(_pooled(blocks, picks), q), 1e-12)

        late = p(cand_last, picks_last) / p(ref_last, picks_last)
        return late / (p(cand_first, picks_first) / p(ref_first, picks_first))

    everything = list(range(MIN_BLOCKS))
    point = ratio(everything, everything)
    rng = random.Random(seed)
    draws = [
        ratio(
            [rng.randrange(MIN_BLOCKS) for _ in everything], [rng.randrange(MIN_BLOCKS) for _ in everything]
        )
        for _ in range(resamples)
    ]
    tail = (1.0 - level) / 2 * 100
    low, high = percentile(draws, tail), percentile(draws, 100 - tail)
    samples = sum(len(b) for b in cand_last)
    iv = RatioInterval(point, min(low, point), max(high, point), level, MIN_BLOCKS, samples)
    beyond = iv.low > 1.0 + bound or iv.high < 1.0 / (1.0 + bound)
    return Drift(iv, beyond, f"p{q:g} ratio to the reference, last third / first third")


def thin(block: Sequence[float], keep: int) -> list[float]:
    """At most `keep` values that stand for a block: all of them, or its evenly spaced order
    statistics (ranks (j + 0.5) / keep), so that a report's payload stays small while the
    block's distribution (and so its percentiles) is kept."""
    if len(block) <= keep:
        return list(block)
    ordered = sorted(block)
    return [ordered[int((j + 0.5) * len(ordered) / keep)] for j in range(keep)]
