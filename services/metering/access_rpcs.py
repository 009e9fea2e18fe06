"""Metering's RPCs of access and audit: principals, API keys, role bindings, authentication and
authorization, and the audit trail.
"""

from __future__ import annotations

import json
from typing import Any

from services.metering import rowmac
from services.metering.guard import bearer
from services.metering.ledger_calls import LedgerCalls
from services.metering.metering_errors import BadInput
from services.metering.metering_messages import (
    actor_of,
    audit_msg,
    authorized_msg,
    trace_id_of,
)
from services.metering.records import Actor
from switchyard import authz, tls
from switchyard.errors import PermissionDenied
from switchyard.gen.switchyard.v1 import metering_pb2 as pb

MAX_AUDIT_LIMIT = 10_000
MAX_ACTION = 64
MAX_DETAIL_JSON = 8192


class AccessRpcs(LedgerCalls):
    """CreatePrincipal, CreateKey, RevokeKey, GrantRole, RevokeRole, Authenticate, Authorize,
    VerifyGrant, AppendAudit, QueryAudit, VerifyAudit."""

    async def CreatePrincipal(self, request: pb.CreatePrincipalRequest, context: Any) -> pb.Principal:
        r = request
        who = await self._w(
            lambda: self.ledger.access.create_principal(actor_of(r.actor, context), r.name, r.kind, r.team)
        )
        return pb.Principal(principal_id=who.principal_id, name=who.name, kind=who.kind, team=who.team)

    async def CreateKey(self, request: pb.CreateKeyRequest, context: Any) -> pb.CreateKeyResponse:
        r = request
        key = await self._w(
            lambda: self.ledger.access.create_key(actor_of(r.actor, context), r.principal, r.expires_unix_us)
        )
        return pb.CreateKeyResponse(
            key_id=key.key_id, secret=key.secret, key=key.key, expires_unix_us=key.expires_us
        )

    async def RevokeKey(self, request: pb.RevokeKeyRequest, context: Any) -> pb.RevokeKeyResponse:
        await self._w(lambda: self.ledger.access.revoke_key(actor_of(request.actor, context), request.key_id))
        return pb.RevokeKeyResponse()

    async def GrantRole(self, request: pb.RoleRequest, context: Any) -> pb.RoleResponse:
        r = request
        await self._w(
            lambda: self.ledger.access.grant_role(actor_of(r.actor, context), r.principal, r.role, r.scope)
        )
        return pb.RoleResponse()

    async def RevokeRole(self, request: pb.RoleRequest, context: Any) -> pb.RoleResponse:
        r = request
        await self._w(
            lambda: self.ledger.access.revoke_role(actor_of(r.actor, context), r.principal, r.role, r.scope)
        )
        return pb.RoleResponse()

    async def Authenticate(self, request: pb.AuthenticateRequest, context: Any) -> pb.AuthenticateResponse:
        peer = Actor(source=authz.cap(str(context.peer())), trace_id=trace_id_of(context))
        key = request.key[: authz.MAX_AUDIT_STRING]  # a real key is far shorter; its id is audited
        ident = await self._r(lambda: self.ledger.access.authenticate(key, peer))
        p = ident.principal
        return pb.AuthenticateResponse(
            principal=pb.Principal(principal_id=p.principal_id, name=p.name, kind=p.kind, team=p.team),
            roles=[pb.RoleBinding(role=role, scope=scope) for role, scope in ident.roles],
            key_id=ident.key_id,
        )

    async def Authorize(self, request: pb.AuthorizeRequest, context: Any) -> pb.AuthorizeResponse:
        r = request
        caller = authz.CALLER.get()
        operator = caller is not None and not caller.insecure and caller.service == tls.OPERATOR
        action = authz.cap(r.action or "authorize", MAX_ACTION)
        actor = actor_of(r.actor, context)
        key = bearer(context)
        done = await self._w(
            lambda: self.authorizer.authorize(
                key,
                operator,
                list(r.roles),
                r.scope,
                action,
                r.resource,
                r.grant_subject,
                actor,
                _pairs(r.more),
            )
        )
        return authorized_msg(done)

    async def VerifyGrant(self, request: pb.VerifyGrantRequest, context: Any) -> pb.AuthorizeResponse:
        r = request
        action = authz.cap(r.action or "grant.verify", MAX_ACTION)
        actor = actor_of(pb.Actor(source="trial worker"), context)
        done = await self._w(
            lambda: self.authorizer.verify(
                r.grant,
                r.subject,
                list(r.roles),
                r.scope,
                action,
                r.resource,
                actor,
                _pairs(r.more),
                r.run_id,
            )
        )
        return authorized_msg(done)

    async def AppendAudit(self, request: pb.AppendAuditRequest, context: Any) -> pb.AuditRecord:
        r = request
        if not r.action:
            raise BadInput("action is empty; name what happened, e.g. request.denied")
        if len(r.action) > MAX_ACTION:
            raise BadInput(f"action is {len(r.action)} characters; at most {MAX_ACTION}")
        if len(r.detail_json) > MAX_DETAIL_JSON:
            raise BadInput(f"detail_json is {len(r.detail_json)} characters; at most {MAX_DETAIL_JSON}")
        caller = authz.CALLER.get()
        refusal = (r.action, r.outcome) == ("rpc.denied", "denied")
        reason = ""
        if caller is not None and caller.service in ("executor", "evaluator") and not refusal:
            reason = f"{caller.identity} may append only its refusals (rpc.denied, denied)"
        elif r.action in rowmac.METERING_ONLY_ACTIONS:  # they vouch for rows (rowmac.py)
            reason = f"{r.action} is recorded by metering itself, never through AppendAudit"
        if reason:
            who = caller.identity if caller is not None else r.actor.principal
            actor = Actor(authz.cap(who), authz.cap(f"metering {caller.peer if caller else ''}".strip()))
            detail_of = {"status": "PERMISSION_DENIED", "reason": reason}
            await self._w(
                lambda: self.ledger.audit.append(
                    actor, "rpc.denied", "/switchyard.v1.Metering/AppendAudit", "denied", detail_of
                )
            )
            raise PermissionDenied(reason)
        if r.outcome not in ("ok", "denied", "failed"):
            raise BadInput(f"outcome {r.outcome!r} is not ok, denied or failed")
        try:
            detail = json.loads(r.detail_json) if r.detail_json else {}
        except ValueError as exc:
            raise BadInput(f"detail_json is not valid JSON: {exc}") from None
        if not isinstance(detail, dict):
            raise BadInput("detail_json must be a JSON object")
        rec = await self._w(
            lambda: self.ledger.audit.append(
                actor_of(r.actor, context), r.action, authz.cap(r.resource), r.outcome, detail
            )
        )
        return audit_msg(rec)

    async def QueryAudit(self, request: pb.QueryAuditRequest, context: Any) -> pb.QueryAuditResponse:
        r = request
        if r.limit < 0 or r.limit > MAX_AUDIT_LIMIT:
            raise BadInput(f"limit {r.limit} is outside 0..{MAX_AUDIT_LIMIT} (0 = 100)")
        recs = await self._r(
            lambda: self.ledger.audit.query(
                r.action, r.principal, r.since_unix_us, r.until_unix_us, r.limit or 100
            )
        )
        return pb.QueryAuditResponse(records=[audit_msg(x) for x in recs])

    async def VerifyAudit(self, request: pb.VerifyAuditRequest, context: Any) -> pb.VerifyAuditResponse:
        v = await self._r(self.ledger.audit.verify)
        return pb.VerifyAuditResponse(
            ok=v.ok, rows_checked=v.rows_checked, first_broken_seq=v.first_broken_seq, problem=v.problem
        )


def _pairs(bindings: Any) -> list[tuple[str, str]]:
    """A request's `more`: (role, scope) pairs."""
    return [(b.role, b.scope) for b in bindings]
