"""What a correctness comparison holds a candidate to: the knobs shared by the trial spec's
`criteria` (workflows/spec/trial_spec.py, which validates them) and the evaluator's `Criteria`
(switchyard/judge/compare.py, which resolves them per precision). Pure: it runs inside
Temporal's workflow sandbox as well as in the evaluator.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerances:
    """Zero fields mean "the default for the precision" (the evaluator's DEFAULTS)."""

    error_multiplier: float = 0.0
    min_cosine: float = 0.0
    min_top1_agreement: float = 0.0
    min_topk_agreement: float = 0.0
    top_k: int = 0
    max_kl: float = 0.0
    logits: bool = False
    atol_floor: float = 0.0
