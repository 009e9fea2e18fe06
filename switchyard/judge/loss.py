"""Comparison of training loss curves (CompareLoss): per-step deviation, final loss, steps to target.

Two paths running the same optimiser steps on the same seeded data start from identical
weights, so their curves differ only by accumulated rounding: the per-step relative deviation
stays near the forward pass's own relative error early on and grows slowly. The default limit
is 1% (fp32) or 5% (bf16/fp16) per step, an order of magnitude above what a correct fp32 port
drifts over tens of steps and well below what a wrong gradient (a sign, a missing term, a bad
learning rate) produces within a few steps. A candidate must also reach the target loss, when
one is given, no later than `max_steps_to_target_ratio` (default 1.1) times the reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from switchyard.judge.judge_errors import BadCriteria

DEFAULT_DEVIATION = {"fp32": 0.01, "fp16": 0.05, "bf16": 0.05}
DEFAULT_STEPS_RATIO = 1.1


@dataclass(frozen=True)
class LossCriteria:
    target_loss: float = 0.0
    max_relative_deviation: float = 0.0
    precision: str = "fp32"
    max_steps_to_target_ratio: float = 0.0


@dataclass(frozen=True)
class LossComparison:
    deviation: list[float]
    max_relative_deviation: float
    final_reference: float
    final_candidate: float
    reference_steps_to_target: int
    candidate_steps_to_target: int
    passed: bool
    reasons: list[str] = field(default_factory=list)
    justification: str = ""

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "FAIL"


def steps_to_target(curve: list[float], target: float) -> int:
    """1-based step at which the loss first reaches `target`; -1 when it never does."""
    for i, value in enumerate(curve):
        if math.isfinite(value) and value <= target:
            return i + 1
    return -1


def _check_curves(
    reference: list[float], candidate: list[float], criteria: LossCriteria, precision: str
) -> None:
    if precision not in DEFAULT_DEVIATION:
        raise BadCriteria(f"precision {precision!r} is not one of {', '.join(DEFAULT_DEVIATION)}")
    if not reference:
        raise BadCriteria("reference: the loss curve is empty; run at least one training step")
    if len(candidate) != len(reference):
        raise BadCriteria(
            f"candidate: {len(candidate)} steps but the reference has {len(reference)}; "
            "both paths must run the same training plan"
        )
    if not all(math.isfinite(v) for v in reference):
        raise BadCriteria("reference: the loss curve has NaN or Inf; the reference itself diverged")
    for name in ("max_relative_deviation", "max_steps_to_target_ratio", "target_loss"):
        value = getattr(criteria, name)
        if not math.isfinite(value) or value < 0:
            raise BadCriteria(f"{name} must be a finite number >= 0, got {value}")


def compare_loss(reference: list[float], candidate: list[float], criteria: LossCriteria) -> LossComparison:
    precision = criteria.precision or "fp32"
    _check_curves(reference, candidate, criteria, precision)
    limit = criteria.max_relative_deviation or DEFAULT_DEVIATION[precision]
    ratio = criteria.max_steps_to_target_ratio or DEFAULT_STEPS_RATIO
    deviation = [
        abs(c - r) / max(abs(r), 1e-12) if math.isfinite(c) else math.inf
        for r, c in zip(reference, candidate, strict=True)
    ]
    worst = max(deviation)
    worst_step = deviation.index(worst) + 1
    reasons = [
        f"per-step relative deviation max {worst:.3g} (step {worst_step}) <= {limit:g}: "
        + ("pass" if worst <= limit else "fail")
    ]
    passed = worst <= limit
    ref_steps = cand_steps = -1
    if criteria.target_loss > 0:
        ref_steps = steps_to_target(reference, criteria.target_loss)
        cand_steps = steps_to_target(candidate, criteria.target_loss)
        if ref_steps < 0:
            reasons.append(f"steps to loss {criteria.target_loss:g}: the reference never reached it (noted)")
        else:
            allowed = math.ceil(ref_steps * ratio)
            ok = 0 < cand_steps <= allowed
            reached = str(cand_steps) if cand_steps > 0 else "never"
            reasons.append(
                f"steps to loss {criteria.target_loss:g}: candidate {reached} "
                f"<= {ratio:g} x reference {ref_steps} = {allowed}: {'pass' if ok else 'fail'}"
            )
            passed = passed and ok
    justification = (
        f"Same seeded data and initial weights on both paths, so the curves differ only by "
        f"accumulated rounding; {limit:g} relative per step is the {precision} limit"
        + (" given in the request" if criteria.max_relative_deviation else " (default)")
        + f"; reaching a target loss may take at most {ratio:g}x the reference's steps."
    )
    return LossComparison(
        deviation=deviation,
        max_relative_deviation=worst,
        final_reference=reference[-1],
        final_candidate=candidate[-1],
        reference_steps_to_target=ref_steps,
        candidate_steps_to_target=cand_steps,
        passed=passed,
        reasons=reasons,
        justification=justification,
    )
