"""Money for people: exact micro-units as decimals, and a cost per job that stays readable
when a job costs less than one micro-unit.

The ledger stores integer micro-units. A cost per job is total / jobs, an exact fraction;
rounded to the micro-unit, a job that costs 3/7 of one reads 0.000000, which says nothing.
So wherever per-job costs are shown, they are shown per job, per 1,000 jobs or per
1,000,000 jobs: the smallest of these at which every non-zero cost is at least one
micro-unit, with the exact fraction alongside when it is not a whole number of micro-units.
"""

from __future__ import annotations

from collections.abc import Iterable
from fractions import Fraction

SCALES = (1, 1_000, 1_000_000)


def decimal(micros: int) -> str:
    """Integer micro-units as an exact decimal with six places (never through a float)."""
    sign = "-" if micros < 0 else ""
    whole, frac = divmod(abs(micros), 1_000_000)
    return f"{sign}{whole}.{frac:06d}"


def round_half_up(value: Fraction) -> int:
    return int((abs(value) + Fraction(1, 2)) // 1) * (1 if value >= 0 else -1)


def per_job(total_micros: int, jobs: int) -> Fraction:
    """The exact cost of one job, in micro-units."""
    return Fraction(total_micros, jobs)


def scale_for(costs: Iterable[Fraction]) -> int:
    """Jobs per figure (1, 1,000 or 1,000,000) at which every non-zero cost is >= 1 micro-unit."""
    nonzero = [abs(c) for c in costs if c]
    for scale in SCALES:
        if all(c * scale >= 1 for c in nonzero):
            return scale
    return SCALES[-1]


def per_label(scale: int) -> str:
    return "per job" if scale == 1 else f"per {scale:,} jobs"


def scaled_micros(cost: Fraction, scale: int) -> int:
    """The cost of `scale` jobs, rounded half up to the micro-unit."""
    return round_half_up(cost * scale)


def exact_note(cost: Fraction, currency: str = "") -> str:
    """'' for a whole number of micro-units, else 'exactly 3/7 micro-USD per job'."""
    if cost.denominator == 1:
        return ""
    return f"exactly {cost.numerator}/{cost.denominator} micro-{currency or 'units'} per job"


def per_job_text(total_micros: int, jobs: int, currency: str = "", scale: int = 0) -> str:
    """'0.000429 USD per 1,000 jobs (exactly 3/7 micro-USD per job)', or a plain per-job cost."""
    cost = per_job(total_micros, jobs)
    scale = scale or scale_for([cost])
    text = f"{decimal(scaled_micros(cost, scale))} {currency}".rstrip() + f" {per_label(scale)}"
    note = exact_note(cost, currency)
    return f"{text} ({note})" if note else text


def per_million_tokens(total_micros: int, tokens: int) -> Fraction:
    """The exact cost of a million tokens, in micro-units."""
    return Fraction(total_micros * 1_000_000, tokens)


def per_million_tokens_text(total_micros: int, tokens: int, currency: str = "") -> str:
    """'2.500000 USD per 1M tokens', with the exact fraction where it is not whole micro-units:
    '0.142857 USD per 1M tokens (exactly 1000000/7 micro-USD per 1M tokens)'."""
    cost = per_million_tokens(total_micros, tokens)
    text = f"{decimal(round_half_up(cost))} {currency}".rstrip() + " per 1M tokens"
    if cost.denominator == 1:
        return text
    return f"{text} (exactly {cost.numerator}/{cost.denominator} micro-{currency or 'units'} per 1M tokens)"
