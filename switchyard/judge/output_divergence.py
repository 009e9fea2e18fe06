"""The router shadow's local comparison of two answers' outputs, when no evaluator service is
configured or it is down: per output the max absolute error, the cosine similarity and the
share of elements outside atol + rtol·|reference|; the worst output decides.

It is the quick online check, not the trial's justified rule (compare.py): the shadow sees
no float64 run and no repeat, so it flags a divergence for an operator to look at, and a
trial decides. BYTES outputs (object arrays) must be equal.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Divergence:
    max_abs_error: float
    cosine: float
    mismatch_share: float
    diverged: bool
    reason: str = ""


def _one(name: str, a: np.ndarray, b: np.ndarray, atol: float, rtol: float) -> Divergence:
    if a.dtype == object or b.dtype == object:
        same = bool(np.array_equal(a, b))
        return Divergence(0.0 if same else math.inf, 1.0 if same else 0.0, 0.0 if same else 1.0, not same)
    diff = np.abs(a - b)
    max_abs = float(diff.max()) if diff.size else 0.0
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    cosine = float(np.dot(a.ravel(), b.ravel()) / (na * nb)) if na and nb else float(na == nb)
    outside = diff > atol + rtol * np.abs(a)
    share = float(outside.mean()) if diff.size else 0.0
    return Divergence(max_abs, cosine, share, bool(outside.any()), f"{name}: max |Δ| {max_abs:.3g}")


def outputs_divergence(
    reference: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray], atol: float, rtol: float
) -> Divergence:
    """Compare every output (by name) of two answers; the worst output decides."""
    if set(reference) != set(candidate):
        return Divergence(
            math.inf, 0.0, 1.0, True, f"outputs differ: {sorted(reference)} vs {sorted(candidate)}"
        )
    worst = Divergence(0.0, 1.0, 0.0, False)
    for name, a in reference.items():
        b = candidate[name]
        if a.shape != b.shape:
            return Divergence(math.inf, 0.0, 1.0, True, f"{name}: shape {a.shape} vs {b.shape}")
        d = _one(name, a, b, atol, rtol)
        if d.max_abs_error >= worst.max_abs_error or d.diverged:
            worst = Divergence(
                max(d.max_abs_error, worst.max_abs_error),
                min(d.cosine, worst.cosine),
                max(d.mismatch_share, worst.mismatch_share),
                d.diverged or worst.diverged,
                d.reason,
            )
    return worst
