"""Whether each side repeats itself: the reference's run-to-run noise, which widens the
tolerance, and the candidate's determinism, judged apart from its error (compare.py).

A candidate whose two runs on the same inputs differ beyond its precision's tolerance (not
allclose at tol, and more than the reference's own noise scaled as the rmse rule scales
errors) is "non-deterministic"; one whose runs agree but whose values are wrong is "wrong but
stable"; without a repeat a failure is just "wrong".
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from switchyard.judge.tensors import DecodedTensor

Array = npt.NDArray[np.float64]


def rmse(a: Array, b: Array) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2))) if a.size else 0.0


def candidate_stability(
    cand: Array,
    candidate_repeat: DecodedTensor | None,
    tol: float,
    noise_allowance: float,
    precision: str,
    reasons: list[str],
) -> tuple[bool, float, float]:
    """(stable, max abs, rmse) of the candidate against its own repeat run; the reason comes
    first: a candidate that differs from itself is not "wrong by an amount"."""
    if candidate_repeat is None:
        return True, 0.0, 0.0
    stable, repeat_max, repeat_rmse, text = _repeatable(
        cand, candidate_repeat, tol, noise_allowance, precision
    )
    reasons.insert(0, text)
    return stable, repeat_max, repeat_rmse


def reference_noise(reference_repeat: DecodedTensor | None, ref: Array) -> tuple[float, float]:
    """(max abs, rmse) between the reference and its repeat run; zeros without a repeat."""
    if reference_repeat is None:
        return 0.0, 0.0
    repeat_max = float(np.max(np.abs(reference_repeat.values - ref))) if ref.size else 0.0
    return repeat_max, rmse(reference_repeat.values, ref)


def wrong_finding(candidate_repeat: DecodedTensor | None) -> str:
    """A failure whose runs agree: "wrong but stable" once a repeat showed it is stable."""
    return "wrong" if candidate_repeat is None else "wrong but stable"


def _repeatable(
    first: Array, repeat: DecodedTensor, tol: float, noise_allowance: float, precision: str
) -> tuple[bool, float, float, str]:
    """Whether two candidate runs on the same inputs agree within the precision's tolerance
    (allclose at tol, or within `noise_allowance`: the reference's own run-to-run noise scaled
    as the rmse rule scales errors). Returns (stable, max abs, rmse, reason)."""
    if repeat.shape != first.shape:
        text = (
            f"non-deterministic: the candidate's shape changed between two runs on the same inputs "
            f"({list(first.shape)}, then {list(repeat.shape)}): fail"
        )
        return False, math.inf, math.inf, text
    second = repeat.values
    both_finite = bool(np.isfinite(first).all() and np.isfinite(second).all())
    same_nan = bool(np.array_equal(np.isnan(first), np.isnan(second)))
    if not both_finite:
        # NaN in the same places twice is stable (the finiteness check fails it anyway)
        finite = np.isfinite(first) & np.isfinite(second)
        first, second = first[finite], second[finite]
    max_abs = float(np.max(np.abs(second - first))) if first.size else 0.0
    spread = rmse(first, second)
    close = bool(np.isclose(first, second, rtol=tol, atol=tol).all())
    stable = same_nan and (close or spread <= noise_allowance)
    if stable:
        text = (
            f"deterministic: two candidate runs on the same inputs differ by up to {max_abs:.3g}, "
            f"within the {precision} tolerance: pass"
        )
    else:
        text = (
            f"non-deterministic: two candidate runs on the same inputs differ by up to {max_abs:.3g} "
            f"(rmse {spread:.3g}), beyond the {precision} tolerance (allclose atol=rtol={tol:g}, "
            f"or {noise_allowance:.3g} rmse of the reference's own noise): fail"
        )
    return stable, max_abs, spread, text
