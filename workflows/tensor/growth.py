"""How fast a path's process memory grows per request it serves, with a bootstrap interval, and
the rule that decides on the whole interval.

Pure statistics, standard library only (no grpc, no temporal, no numpy), so the verdict runs
it inside the workflow sandbox, and seeded, so a replayed workflow gets the same interval.

The samples: the measurement reads the path's executor's memory (Describe) at the edges of
each of the path's own blocks and within a long block (workflows/tensor/performance.py). A
step is what one sampling interval of the path's own measurement served and grew: (requests,
bytes). Steps are counted within the path's own blocks only, so paths that share one executor
process (measured in alternating blocks) are each charged only what grew while they were
served, and what grew between blocks (another path's turn, warm-up) is nobody's.

The settled part: the first third of the steps is left out (`settled`): what a path allocates
once as it starts serving is not growth per request.

The fit: the steps chained in order give the cumulative growth against requests served; the
slope is the median of the pairwise slopes of those points (Theil–Sen), which a noisy sample
moves less than a least-squares line. The interval: a bootstrap that draws the steps with replacement,
chains them in the drawn order and fits again. A path that keeps memory on every call grows
in every step, and every draw gives its slope again: a narrow interval. A path whose memory
jumped once (an arena, a cache filled once) grows in one step only: draws with that step
several times or not at all spread the interval wide, so one jump is not taken for a leak.

The decision, as the other criteria's (workflows/tensor/intervals.py), on whole intervals:
the reference's own slope is the noise floor, and the candidate's growth beyond it (the
difference of the slopes) is what it adds to a process both may share. FAIL only when both the
candidate's own interval and its interval beyond the reference's lie above the allowed growth,
PASS when either lies at or below it, else INCONCLUSIVE, naming about how many more requests
would settle it (`judge`).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from workflows.report.results import FAIL, PASS
from workflows.tensor.intervals import Decision, on_bound, percentile

MIB = 1 << 20
PER = 1000  # the slope's unit: MiB per PER requests
RESAMPLES = 400
MIN_STEPS = 4  # fewer sampling intervals give no interval
MAX_STEPS = 40  # more are merged pairwise: the fit is quadratic in the points, in the sandbox

Step = tuple[int, int]  # (requests served, bytes grown) over one sampling interval


@dataclass(frozen=True)
class Slope:
    """Memory growth in MiB per 1,000 requests, with its bootstrap interval."""

    mib: float
    low: float
    high: float
    level: float
    steps: int
    requests: int

    def bracket(self) -> str:
        return f"{_mib(self.mib)} [{_mib(self.low)}, {_mib(self.high)}]"

    def text(self, what: str = "memory") -> str:
        return f"{what} grows {_mib(self.mib)} MiB per {PER:,} requests [{_mib(self.low)}, {_mib(self.high)}]"


def _mib(value: float) -> str:
    return f"{value:+.1f}" if abs(value) >= 10 else f"{value:+.2f}"


def bound_text(allowed: float) -> str:
    """The policy's bound as written in reasons: 1.0, 0.25."""
    return f"{allowed:.1f}" if float(allowed).is_integer() else f"{allowed:g}"


def steps_of(rows: Sequence[Sequence[int]], column: int) -> list[Step]:
    """The (requests, bytes) steps of one column of a measurement's memory rows
    ([requests, rss bytes, device bytes] each: PerformanceResult.memory_steps)."""
    return [(int(r[0]), int(r[column])) for r in rows]


def merged(steps: Sequence[Step], most: int = MAX_STEPS) -> list[Step]:
    """The steps with none of 0 requests (its growth joins the next step's) and at most `most`
    of them (adjacent ones summed pairwise until they fit)."""
    out: list[Step] = []
    carry = 0
    for requests, grown in steps:
        if requests <= 0:
            carry += grown
            continue
        out.append((requests, grown + carry))
        carry = 0
    if carry and out:
        out[-1] = (out[-1][0], out[-1][1] + carry)
    while len(out) > most:
        out = [
            (sum(s[0] for s in out[i : i + 2]), sum(s[1] for s in out[i : i + 2]))
            for i in range(0, len(out), 2)
        ]
    return out


def theil_sen(steps: Sequence[Step]) -> float:
    """The median pairwise slope, in bytes per request, of the steps chained from (0, 0)."""
    xs, ys = [0], [0]
    for requests, grown in steps:
        xs.append(xs[-1] + requests)
        ys.append(ys[-1] + grown)
    slopes = [
        (ys[j] - ys[i]) / (xs[j] - xs[i])
        for i in range(len(xs))
        for j in range(i + 1, len(xs))
        if xs[j] > xs[i]
    ]
    return statistics.median(slopes)


def settled(steps: Sequence[Step]) -> list[Step]:
    """The steps after the first third of the measurement: what a path allocates once as it
    starts serving (its threads' stacks, lazily built caches, the heap's free holes filling)
    is done by then, and extrapolated to 1,000 requests from a short measurement it would
    read as a leak. A leak grows in every third alike."""
    return list(steps[len(steps) // 3 :])


def _prepared(steps: Sequence[Step], level: float) -> list[Step]:
    if not 0.0 < level < 1.0:
        raise ValueError("level must be between 0 and 1")
    kept = merged(settled(steps))
    if len(kept) < MIN_STEPS:
        raise ValueError(
            f"{len(kept)} settled memory sample interval(s) (after the first third): "
            f"a growth interval needs at least {MIN_STEPS}"
        )
    return kept


def _fits(kept: Sequence[Step], seed: int, resamples: int) -> list[float]:
    """The bootstrap's slopes (MiB per 1,000 requests): the steps drawn with replacement."""
    rng, n = random.Random(seed), len(kept)
    return [theil_sen([kept[rng.randrange(n)] for _ in range(n)]) * PER / MIB for _ in range(resamples)]


def _interval(point: float, fits: list[float], level: float, kept: Sequence[Step]) -> Slope:
    tail = (1.0 - level) / 2 * 100
    low, high = percentile(fits, tail), percentile(fits, 100 - tail)
    return Slope(point, min(low, point), max(high, point), level, len(kept), sum(s[0] for s in kept))


def slope(steps: Sequence[Step], level: float = 0.95, seed: int = 0, resamples: int = RESAMPLES) -> Slope:
    """The growth per 1,000 requests of a path's steps, with its bootstrap interval (module doc)."""
    kept = _prepared(steps, level)
    return _interval(theil_sen(kept) * PER / MIB, _fits(kept, seed, resamples), level, kept)


def excess(
    candidate: Sequence[Step],
    reference: Sequence[Step],
    level: float = 0.95,
    seed: int = 0,
    resamples: int = RESAMPLES,
) -> Slope:
    """How much faster the candidate's memory grows than the reference's: the difference of the
    two slopes, its interval from the two paths' bootstraps drawn independently (the steps of
    two paths need not pair: a sample one path missed shifts its steps against the other's)."""
    mine, theirs = _prepared(candidate, level), _prepared(reference, level)
    point = (theil_sen(mine) - theil_sen(theirs)) * PER / MIB
    pairs = zip(_fits(mine, seed, resamples), _fits(theirs, seed + 1, resamples), strict=True)
    return _interval(point, [a - b for a, b in pairs], level, mine)


def more_requests(fit: Slope, allowed: float) -> int:
    """About how many more requests would shrink the interval off the bound (-1: the slope sits
    on it). A bootstrap interval's width shrinks about as 1/sqrt(n), as in intervals.py."""
    side = fit.high - fit.mib if fit.mib < allowed else fit.mib - fit.low
    distance = abs(allowed - fit.mib)
    if distance <= 1e-9 * max(1.0, allowed):
        return -1
    return max(1, math.ceil(fit.requests * ((side / distance) ** 2 - 1.0)))


def decide(fit: Slope, allowed: float, stated: str) -> Decision:
    """FAIL only if the whole interval of `fit` lies above `allowed` (MiB per 1,000 requests),
    PASS only if it lies at or below, else INCONCLUSIVE with the requests that would settle it."""
    return on_bound(fit.low, fit.high, allowed, stated, more_requests(fit, allowed), "growth", "slope")


@dataclass(frozen=True)
class Judged:
    decision: Decision
    figure: str  # for the verdict line


def judge(
    candidate: Sequence[Step], reference: Sequence[Step] | None, allowed: float, what: str, level: float
) -> Judged:
    """The growth criterion of one memory column. The candidate is charged with growth only
    when both its own slope and its slope beyond the reference's (Diffy's subtraction: what
    the reference grows too, in a process both share or on the host, is not the candidate's)
    lie wholly above `allowed`; it passes when either lies wholly at or below. Without the
    reference's samples, its own slope decides. Raises ValueError when the candidate has too
    few samples."""
    mine = slope(candidate, level)
    bound = bound_text(allowed)
    try:
        floor = slope(reference, level) if reference else None
    except ValueError:
        floor = None
    if floor is None or reference is None:
        stated = f"{mine.text(what)} at {mine.level:.0%} over {mine.steps} settled sampled intervals of "
        stated += f"{mine.requests:,} requests, the reference not sampled (allowed {bound})"
        return Judged(decide(mine, allowed, stated), f"{mine.text(what)} (allowed {bound})")
    beyond = excess(candidate, reference, level)
    said = f"{mine.text(what)}, {beyond.bracket()} beyond the reference's {floor.bracket()}"
    stated = (
        f"{said} at {mine.level:.0%} over {mine.steps} and {floor.steps} settled sampled intervals of "
        f"{mine.requests:,} and {floor.requests:,} requests (allowed {bound})"
    )
    figure = f"{said} (allowed {bound})"
    if mine.high <= allowed:
        return Judged(Decision(PASS, f"{stated}: its whole interval is within the allowed growth"), figure)
    if beyond.high <= allowed:
        why = (
            "its growth beyond the reference's is wholly within the allowed growth (the reference grows too)"
        )
        return Judged(Decision(PASS, f"{stated}: {why}"), figure)
    if mine.low > allowed and beyond.low > allowed:
        why = "the whole interval is beyond the allowed growth, by itself and beyond the reference's"
        return Judged(Decision(FAIL, f"{stated}: {why}"), figure)
    return Judged(decide(beyond if mine.low > allowed else mine, allowed, stated), figure)
