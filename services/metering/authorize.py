"""Authorisation for work done outside metering on a principal's behalf (trials, workload reads).

`Authorize` answers whether the caller (its API key's principal, or the operator's certificate,
which acts as a cluster admin) holds every role asked for on a scope, audits the answer once
under the action named (trial.authorize, workloads.read ...), and, given a subject, returns a
signed grant of it (services/metering/grants.py). `VerifyGrant` is the trial worker's: the
grant must be one metering signed, unexpired, for this subject, roles and scope, and its
principal must hold the roles still; each answer is audited once. Domain code: no gRPC here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from services.metering import access, grants
from services.metering.ledger import Ledger
from services.metering.metering_errors import BadInput, UnknownEntity
from services.metering.records import Actor
from switchyard import authz, tls
from switchyard.errors import PermissionDenied, Unauthenticated

MAX_ROLES = 8
# The operator's certificate (what `switchyard up` issues for the CLI on the machine) acts as
# a cluster admin, as it does for metering's admin RPCs.
OPERATOR = access.PrincipalInfo(tls.service_id(tls.OPERATOR), "operator", "service", "")


@dataclass(frozen=True)
class Authorized:
    principal: access.PrincipalInfo
    grant: str = ""
    expires_us: int = 0


def check_request(roles: Sequence[str], scope: str) -> tuple[tuple[str, ...], str]:
    scope = scope or "*"
    if not roles:
        raise BadInput("roles is empty; name the roles the work needs, e.g. trials:run")
    if len(roles) > MAX_ROLES:
        raise BadInput(f"roles names {len(roles)} roles; at most {MAX_ROLES}")
    for role in roles:
        if role not in access.ROLES:
            raise BadInput(f"role {authz.cap(role, 40)!r} is not one of {', '.join(access.ROLES)}")
    if scope != "*" and not (scope.startswith("model:") and 0 < len(scope) - 6 <= 200):
        raise BadInput(f"scope {authz.cap(scope, 80)!r} is not '*' or 'model:<name>'")
    return tuple(dict.fromkeys(roles)), scope


class Authorizer:
    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._key = grants.grant_key(ledger.audit_key)

    def authorize(
        self,
        key: str | None,
        operator: bool,
        roles: Sequence[str],
        scope: str,
        action: str,
        resource: str,
        subject: str,
        actor: Actor,
    ) -> Authorized:
        """Runs on a ledger thread: authenticates `key` (else the operator), checks, audits."""
        needed, scope = check_request(roles, scope)
        if len(subject) > 400:
            raise BadInput(f"grant_subject is {len(subject)} characters; at most 400")
        if key:
            identity = self.ledger.authenticate(key[: authz.MAX_AUDIT_STRING], actor)  # audits a failure
            principal, held = identity.principal, identity.roles
        elif operator:
            principal, held = OPERATOR, (("admin", "*"),)
        else:
            raise Unauthenticated(
                "Authorize needs an API key (SWITCHYARD_API_KEY, sent as `authorization: Bearer <key>`) "
                "or the operator's certificate"
            )
        actor = dataclasses.replace(actor, principal=principal.principal_id)
        resource = authz.cap(resource or scope)
        missing = access.missing_roles(held, needed, scope)
        if missing:
            self.ledger.append_audit(actor, action, resource, "denied", {"missing": missing, "scope": scope})
            raise PermissionDenied(
                f"principal {principal.name!r} lacks {', '.join(f'`{m}`' for m in missing)} on {scope}, "
                f"needed for {action}; ask an admin for `switchyard roles grant {principal.name} "
                f"{missing[0]} --scope {scope}`"
            )
        granted = Authorized(principal)
        if subject:
            expires = self.ledger.clock() + grants.LIFETIME_US
            token = grants.sign(
                self._key, grants.Grant(principal.principal_id, subject, needed, scope, expires)
            )
            granted = Authorized(principal, token, expires)
        detail = {"roles": list(needed), "scope": scope, "grant": bool(subject)}
        self.ledger.append_audit(actor, action, resource, "ok", detail)
        return granted

    def verify(
        self,
        token: str,
        subject: str,
        roles: Sequence[str],
        scope: str,
        action: str,
        resource: str,
        actor: Actor,
    ) -> Authorized:
        resource = authz.cap(resource or subject)
        try:
            needed, scope = check_request(roles, scope)
            grant = grants.verify(self._key, token, subject, self.ledger.clock())
            if grant.roles != needed or grant.scope != scope:
                raise grants.GrantRefused(
                    f"the trial grant is for {list(grant.roles)} on {grant.scope}; this trial needs "
                    f"{list(needed)} on {scope}"
                )
            if grant.principal_id == OPERATOR.principal_id:
                principal = OPERATOR
            else:
                principal, held = self.ledger.read(
                    lambda conn: (
                        access.find_principal(conn, grant.principal_id),
                        access.roles_of(conn, grant.principal_id),
                    )
                )
                missing = access.missing_roles(held, needed, scope)
                if missing:
                    raise grants.GrantRefused(
                        f"principal {principal.name!r} no longer holds {', '.join(missing)} on {scope}"
                    )
        except (grants.GrantRefused, UnknownEntity) as exc:
            detail = {"status": "PERMISSION_DENIED", "reason": authz.cap(str(exc), 512)}
            self.ledger.append_audit(actor, action, resource, "denied", detail)
            raise grants.GrantRefused(str(exc)) from None
        on_behalf = dataclasses.replace(actor, on_behalf_of=principal.principal_id)
        self.ledger.append_audit(on_behalf, action, resource, "ok", {"roles": list(needed), "scope": scope})
        return Authorized(principal, "", grant.expires_us)
