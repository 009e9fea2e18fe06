"""Admission, the router's first stage: who calls, whether they may, and within their limits.

A caller's bearer key is looked up through metering (`auth.Authenticator`, cached); the
identity must hold `infer` for the model (`auth.authorize`), or `admin` to change the router
(`require_admin`). Every refusal is audited with the reason (`request.denied`, capped so a
caller cannot grow an audit row), and goes back as the precise status. Without authentication
(require_auth = false) every caller is ANONYMOUS, which may do everything.

A request then takes a slot of its principal's limits (`PrincipalLimits`): a request rate
(token bucket) and requests in flight. Defaults come from `[router] principal_rate_per_s`,
`principal_burst` and `principal_max_in_flight` (0 = no limit); RouterAdmin.SetPrincipalLimit
overrides them for one principal (for the whole fleet through metering:
services/router/fleet_limits.py). A request over a limit is refused with RESOURCE_EXHAUSTED
and the trailing metadata `retry-after-ms` (`switchyard.errors.RateLimited`: when a token is
due, or a short pause for in-flight), and nothing is written to the ledger for it: refusals
are counted here (`refused`), so one tenant hammering the router cannot flood metering. The
tables are bounded (least recently seen principals go first).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from services.router.auth import ANONYMOUS, Authenticator, Identity, authorize, bearer_key
from services.router.denials import Denials, source_of
from services.router.spool import Spool
from switchyard import authz, telemetry
from switchyard.errors import PermissionDenied, RateLimited, SwitchyardError, Unauthenticated
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb

MAX_PRINCIPALS = 100_000
IN_FLIGHT_RETRY_MS = 50

Metadata = Iterable[Any]  # (key, value) pairs; grpc.aio.Metadata or a plain sequence


@dataclass(frozen=True)
class Limit:
    """One principal's limits: a rate (a token bucket of `burst`) and requests in flight."""

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
    """Every principal's limits (the default, and the overrides set for some) and what each
    has used of them: its bucket of tokens and its requests in flight."""

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


class Admission:
    def __init__(self, auth: Authenticator | None, spool: Spool | None, default_limit: Limit) -> None:
        self.auth = auth
        self.spool = spool
        self.limits = PrincipalLimits(default_limit)
        self.denials = Denials()

    async def identify(self, metadata: Metadata, resource: str, request_id: str, peer: str) -> Identity:
        """The caller's identity from its key; a refused key is audited and raised."""
        if self.auth is None:
            return ANONYMOUS
        self.flush_denials()
        try:
            key = bearer_key(metadata)
            # a known good key is never held up by its neighbours: only a key that needs a
            # lookup is checked against its source's refusals
            return await self.auth.identify(key, lambda: self.denials.check(source_of(peer)))
        except Unauthenticated as exc:
            if self.denials.denied(source_of(peer)):  # the window's first; the rest are counted
                self.audit_denial(None, resource, str(exc), "UNAUTHENTICATED", request_id, peer)
            raise

    def flush_denials(self, everything: bool = False) -> None:
        """One `request.denied` row per source for each closed window, with its count."""
        for source, count in self.denials.closed(everything):
            detail = json.dumps(
                {"status": "UNAUTHENTICATED", "count": count, "window_s": self.denials.window_s}
            )
            self.audit(None, "request.denied", f"source/{source}", "denied", detail, "", source)

    async def admit(self, metadata: Metadata, model: str, request_id: str, peer: str) -> Identity:
        """The caller's identity, if it may infer with `model`."""
        identity = await self.identify(metadata, f"model:{model}", request_id, peer)
        self.authorize(identity, model, request_id, peer)
        return identity

    def authorize(self, identity: Identity, model: str, request_id: str, peer: str) -> None:
        """Refuses (and audits) an identity that may not infer with `model`."""
        try:
            authorize(identity, model)
        except PermissionDenied as exc:
            self.audit_denial(identity, f"model:{model}", str(exc), "PERMISSION_DENIED", request_id, peer)
            raise

    def require_admin(self, identity: Identity, resource: str, request_id: str, peer: str) -> None:
        """Refuses (and audits) a caller without role `admin` a change to the router."""
        if identity.is_admin():
            return
        reason = f"principal {identity.name!r} lacks role `admin` (scope *) needed to change routes"
        self.audit_denial(identity, resource, reason, "PERMISSION_DENIED", request_id, peer)
        raise PermissionDenied(reason)

    @staticmethod
    def visible_models(identity: Identity, models: Iterable[str]) -> list[str]:
        """Those of `models` the caller may infer with (what a model listing shows it)."""
        out = []
        for model in models:
            try:
                authorize(identity, model)
            except SwitchyardError:
                continue
            out.append(model)
        return out

    @contextlib.contextmanager
    def principal_slot(self, identity: Identity) -> Iterator[None]:
        """Holds one of the principal's slots while the request runs (refused over its limits)."""
        counted = self.limits.acquire(identity.principal_id)
        try:
            yield
        finally:
            if counted:
                self.limits.release(identity.principal_id)

    def audit(
        self,
        identity: Identity | None,
        action: str,
        resource: str,
        outcome: str,
        detail_json: str,
        request_id: str,
        peer: str,
    ) -> None:
        if self.spool is None:
            return
        # every string capped: a caller's 64 MiB model name must not become a 64 MiB audit row
        actor = mpb.Actor(
            principal=authz.cap(identity.principal_id if identity else ""),
            source=authz.cap(f"router {peer}".strip()),
            request_id=request_id,
            trace_id=telemetry.current_trace_id(),
        )
        self.spool.audit(
            mpb.AppendAuditRequest(
                actor=actor,
                action=action,
                resource=authz.cap(resource),
                outcome=outcome,
                detail_json=detail_json if len(detail_json) <= authz.MAX_AUDIT_DETAIL else "{}",
            )
        )

    def audit_denial(
        self, identity: Identity | None, resource: str, reason: str, status: str, request_id: str, peer: str
    ) -> None:
        detail = json.dumps({"status": status, "reason": authz.cap(reason, 512)})
        self.audit(identity, "request.denied", resource, "denied", detail, request_id, peer)

    async def close(self) -> None:
        self.flush_denials(everything=True)
        if self.auth is not None:
            await self.auth.close()
