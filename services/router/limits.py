"""Per-principal limits at the router: a request rate (token bucket) and requests in flight.

Defaults come from `[router] principal_rate_per_s`, `principal_burst` and
`principal_max_in_flight` (0 = no limit); RouterAdmin.SetPrincipalLimit overrides them for one
principal (for the whole fleet through metering: services/router/fleet_limits.py). A request over a
limit is refused with RESOURCE_EXHAUSTED and the trailing metadata `retry-after-ms` (when a
token is due, or a short pause for in-flight), and nothing is written to the ledger for it:
refusals are counted here (`refused`), so one tenant hammering the router cannot flood
metering. The tables are bounded (least recently seen principals go first).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from switchyard.errors import ResourceExhausted

MAX_PRINCIPALS = 100_000
IN_FLIGHT_RETRY_MS = 50


class RateLimited(ResourceExhausted):
    """Over a principal's limit; `retry_after_ms` goes to the caller as trailing metadata."""

    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(message)
        self.retry_after_ms = max(1, retry_after_ms)

    @property
    def trailers(self) -> tuple[tuple[str, str], ...]:
        return (("retry-after-ms", str(self.retry_after_ms)),)


@dataclass(frozen=True)
class Limit:
    rate_per_s: float = 0.0  # 0 = unlimited
    burst: int = 0  # bucket size; 0 = max(1, rate)
    max_in_flight: int = 0  # 0 = unlimited

    @property
    def capacity(self) -> float:
        return float(self.burst) if self.burst > 0 else max(1.0, self.rate_per_s)


@dataclass
class _Bucket:
    tokens: float
    at: float


class PrincipalLimits:
    def __init__(self, default: Limit) -> None:
        self.default = default
        self.overrides: dict[str, Limit] = {}
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self.in_flight: dict[str, int] = {}
        self.refused = 0

    def limit_for(self, principal: str) -> Limit:
        return self.overrides.get(principal, self.default)

    def set(self, principal: str, limit: Limit | None) -> None:
        """Overrides `principal`'s limit (None: back to the default)."""
        if limit is None:
            self.overrides.pop(principal, None)
        else:
            self.overrides[principal] = limit
        self._buckets.pop(principal, None)

    def acquire(self, principal: str) -> bool:
        """Takes a token and an in-flight slot, or raises RateLimited; True when a slot was
        counted (then pair it with `release`)."""
        limit = self.limit_for(principal)
        if limit.max_in_flight > 0 and self.in_flight.get(principal, 0) >= limit.max_in_flight:
            self.refused += 1
            raise RateLimited(
                f"principal {principal!r} has {limit.max_in_flight} requests in flight (its limit); "
                f"retry after {IN_FLIGHT_RETRY_MS} ms",
                IN_FLIGHT_RETRY_MS,
            )
        if limit.rate_per_s > 0:
            now = time.monotonic()
            bucket = self._buckets.get(principal)
            if bucket is None:
                bucket = self._buckets[principal] = _Bucket(limit.capacity, now)
                while len(self._buckets) > MAX_PRINCIPALS:
                    self._buckets.popitem(last=False)
            else:
                self._buckets.move_to_end(principal)
                bucket.tokens = min(limit.capacity, bucket.tokens + (now - bucket.at) * limit.rate_per_s)
                bucket.at = now
            if bucket.tokens < 1.0:
                self.refused += 1
                wait_ms = int((1.0 - bucket.tokens) / limit.rate_per_s * 1000) + 1
                raise RateLimited(
                    f"principal {principal!r} is over its rate of {limit.rate_per_s:g} requests/s; "
                    f"retry after {wait_ms} ms",
                    wait_ms,
                )
            bucket.tokens -= 1.0
        if limit.max_in_flight > 0:
            self.in_flight[principal] = self.in_flight.get(principal, 0) + 1
            return True
        return False

    def release(self, principal: str) -> None:
        count = self.in_flight.get(principal)
        if count is None:
            return
        if count <= 1:
            del self.in_flight[principal]
        else:
            self.in_flight[principal] = count - 1
