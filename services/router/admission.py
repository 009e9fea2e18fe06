"""Admission, the router's first stage: who calls, whether they may, and within their limits.

A caller's bearer key is looked up through metering (`auth.Authenticator`, cached); the
identity must hold `infer` for the model (`auth.authorize`), or `admin` to change the router
(`require_admin`). Every refusal is audited with the reason (`request.denied`, capped so a
caller cannot grow an audit row), and goes back as the precise status. A request then takes a
slot of its principal's limits (`limits.PrincipalLimits`: a rate and requests in flight) or is
refused RESOURCE_EXHAUSTED with `retry-after-ms`; such a refusal is counted there, never
written to the ledger. Without authentication (require_auth = false) every caller is
ANONYMOUS, which may do everything.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from typing import Any

from services.router.auth import ANONYMOUS, Authenticator, Identity, authorize, bearer_key
from services.router.denials import Denials, source_of
from services.router.limits import Limit, PrincipalLimits
from services.router.spool import Spool
from switchyard import authz, telemetry
from switchyard.errors import PermissionDenied, SwitchyardError, Unauthenticated
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb

Metadata = Iterable[Any]  # (key, value) pairs; grpc.aio.Metadata or a plain sequence


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
