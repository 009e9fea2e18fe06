"""The cost model's arithmetic, pure and exact: prices in force, charges, idle allocation.

Money is integer micro-units. A charge is rounded once, when its line is created (half up,
on exact integers). A reservation's total is computed from the exact sum over the price
segments it spans, rounded once; its idle line is what remains after the busy and
preparation lines, so lines always add up to the total exactly. Idle cost (and idle time) is
shared to the reservation's jobs in proportion to their busy time by the largest-remainder
method, which distributes every micro-unit and is deterministic (ties broken by job id).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from services.metering.metering_errors import MoneyOverflow

US_PER_HOUR = 3_600_000_000
INT64_MAX = 2**63 - 1
IDLE_METHOD = "busy_time_proportional/largest_remainder"
UNALLOCATED_METHOD = "unallocated/no_busy_jobs"


@dataclass(frozen=True)
class Price:
    price_key: str
    micros_per_hour: int
    currency: str
    effective_from_us: int
    version: str


class PriceBook:
    """The dated prices of some price keys; `at` answers the price in force at a time."""

    def __init__(self, prices: Iterable[Price]) -> None:
        self._by_key: dict[str, list[Price]] = {}
        for price in sorted(prices, key=lambda p: (p.price_key, p.effective_from_us)):
            self._by_key.setdefault(price.price_key, []).append(price)
        self._starts = {k: [p.effective_from_us for p in v] for k, v in self._by_key.items()}

    def has_key(self, price_key: str) -> bool:
        return price_key in self._by_key

    def at(self, price_key: str, t_us: int) -> Price | None:
        starts = self._starts.get(price_key)
        if not starts:
            return None
        i = bisect.bisect_right(starts, t_us) - 1
        return self._by_key[price_key][i] if i >= 0 else None

    def segments(self, price_key: str, start_us: int, end_us: int) -> list[tuple[int, int, Price | None]]:
        """[start, end) cut where the price changes; None where no price was in force."""
        out: list[tuple[int, int, Price | None]] = []
        t = start_us
        prices = self._by_key.get(price_key, [])
        while t < end_us:
            current = self.at(price_key, t)
            later = [p.effective_from_us for p in prices if p.effective_from_us > t]
            stop = min([end_us, *later])
            out.append((t, stop, current))
            t = stop
        return out


def check_int64(value: int, what: str) -> int:
    if not -INT64_MAX <= value <= INT64_MAX:
        raise MoneyOverflow(f"{what} would be {value} micro-units, beyond the 64-bit range; split it")
    return value


def round_div(numerator: int, denominator: int) -> int:
    """Integer division rounded half away from zero (exact, no floats)."""
    q, r = divmod(abs(numerator), denominator)
    if 2 * r >= denominator:
        q += 1
    return q if numerator >= 0 else -q


def charge(duration_us: int, price: Price, what: str = "charge") -> int:
    """Cost of `duration_us` at `price`, rounded once to the micro-unit."""
    return check_int64(round_div(duration_us * price.micros_per_hour, US_PER_HOUR), what)


@dataclass(frozen=True)
class ReservedCost:
    total_micros: int | None  # None: some of the interval had no price in force
    currency: str | None
    versions: tuple[str, ...]


def reserved_cost(book: PriceBook, price_key: str, start_us: int, end_us: int) -> ReservedCost:
    """Reserved time x the price in force, summed exactly over price segments, rounded once."""
    exact = 0
    versions: list[str] = []
    currencies = set()
    for seg_start, seg_end, price in book.segments(price_key, start_us, end_us):
        if price is None:
            return ReservedCost(None, None, ())
        exact += (seg_end - seg_start) * price.micros_per_hour
        versions.append(price.version)
        currencies.add(price.currency)
    if not versions:  # zero-length reservation: priced at the start price, costs nothing
        price = book.at(price_key, start_us)
        if price is None:
            return ReservedCost(None, None, ())
        return ReservedCost(0, price.currency, (price.version,))
    total = check_int64(round_div(exact, US_PER_HOUR), "the reservation's cost")
    return ReservedCost(total, currencies.pop(), tuple(versions))


def largest_remainder(amount: int, weights: Mapping[str, int]) -> dict[str, int]:
    """Split `amount` (may be negative) over keys by non-negative weights; parts sum exactly."""
    total_weight = sum(weights.values())
    if not weights or total_weight <= 0:
        raise ValueError("largest_remainder needs a positive total weight")
    sign = -1 if amount < 0 else 1
    whole = abs(amount)
    parts: dict[str, int] = {}
    remainders: list[tuple[int, str]] = []
    for key in sorted(weights):
        q, r = divmod(whole * weights[key], total_weight)
        parts[key] = q
        remainders.append((r, key))
    left = whole - sum(parts.values())
    # Biggest remainder first; among equals the smaller key, so the result is reproducible.
    for _r, key in sorted(remainders, key=lambda rk: (-rk[0], rk[1]))[:left]:
        parts[key] += 1
    return {k: sign * v for k, v in parts.items()}
