"""Authorisation for work done outside metering on a principal's behalf (trials, workload reads).

`Authorize` answers whether the caller (its API key's principal, or the operator's certificate,
which acts as a cluster admin) holds every role asked for on a scope, audits the answer once
under the action named (trial.authorize, workloads.read ...), and, given a subject, returns a
signed grant of it (services/metering/grants.py). `VerifyGrant` is the trial worker's: the
grant must be one metering signed, unexpired, for this subject, roles and scope, and its
principal must hold the roles still; and it is spent by the Temporal run that first verifies
it (services/metering/grant_spends.py), so another run is refused. Each answer is audited
once, a spend in the transaction that records it. Domain code: no gRPC here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Connection

from services.metering import access, audit, grant_spends, grants
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


Pairs = tuple[tuple[str, str], ...]  # (role, scope)


def check_more(more: Sequence[tuple[str, str]]) -> Pairs:
    """The (role, scope) pairs also needed, each checked as `check_request` checks one."""
    if len(more) > MAX_ROLES:
        raise BadInput(f"more names {len(more)} roles; at most {MAX_ROLES}")
    pairs = []
    for role, scope in more:
        (checked,), on = check_request([role], scope)
        pairs.append((checked, on))
    return tuple(dict.fromkeys(pairs))


def missing(held: Pairs, needed: Sequence[str], scope: str, more: Pairs) -> list[tuple[str, str]]:
    """What of `needed` on `scope`, and of `more` on each pair's scope, `held` does not cover."""
    out = [(role, scope) for role in access.missing_roles(held, needed, scope)]
    return out + [(r, s) for r, s in more if access.missing_roles(held, [r], s)]


class Authorizer:
    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._key = grants.grant_key(ledger.tx.audit_key)

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
        more: Sequence[tuple[str, str]] = (),
    ) -> Authorized:
        """Runs on a ledger thread: authenticates `key` (else the operator), checks, audits."""
        needed, scope = check_request(roles, scope)
        also = check_more(more)
        if len(subject) > 400:
            raise BadInput(f"grant_subject is {len(subject)} characters; at most 400")
        if key:
            identity = self.ledger.access.authenticate(
                key[: authz.MAX_AUDIT_STRING], actor
            )  # audits a failure
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
        lacking = missing(held, needed, scope, also)
        if lacking:
            detail_of = {"missing": [r for r, _ in lacking], "scope": scope}
            if also:
                detail_of["missing_on"] = [f"{r} on {s}" for r, s in lacking]
            self.ledger.audit.append(actor, action, resource, "denied", detail_of)
            (role, on) = lacking[0]
            raise PermissionDenied(
                f"principal {principal.name!r} lacks {', '.join(f'`{r}` on {s}' for r, s in lacking)}, "
                f"needed for {action}; ask an admin for `switchyard roles grant {principal.name} "
                f"{role} --scope {on}`"
            )
        granted = Authorized(principal)
        if subject:
            expires = self.ledger.tx.clock() + grants.LIFETIME_US
            token = grants.sign(
                self._key, grants.Grant(principal.principal_id, subject, needed, scope, expires, also)
            )
            granted = Authorized(principal, token, expires)
        detail: dict[str, object] = {"roles": list(needed), "scope": scope, "grant": bool(subject)}
        if also:
            detail["more"] = [f"{r} on {s}" for r, s in also]
        self.ledger.audit.append(actor, action, resource, "ok", detail)
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
        more: Sequence[tuple[str, str]] = (),
        run_id: str = "",
    ) -> Authorized:
        """Runs on a ledger thread: checks the grant, then spends it on `run_id` (its retries pass)."""
        resource = authz.cap(resource or subject)
        if not run_id or len(run_id) > grant_spends.MAX_RUN_ID:
            raise BadInput(
                f"run_id is {'empty' if not run_id else f'{len(run_id)} characters'}; name the Temporal "
                f"workflow run the grant is spent by (at most {grant_spends.MAX_RUN_ID} characters)"
            )
        try:
            needed, scope = check_request(roles, scope)
            also = check_more(more)
            grant = grants.verify(self._key, token, subject, self.ledger.tx.clock())
            if grant.roles != needed or grant.scope != scope or grant.more != also:
                raise grants.GrantRefused(
                    f"the trial grant is for {_said(grant.roles, grant.scope, grant.more)}; this trial "
                    f"needs {_said(needed, scope, also)}"
                )
            if grant.principal_id == OPERATOR.principal_id:
                principal = OPERATOR
            else:
                principal, held = self.ledger.tx.read(
                    lambda conn: (
                        access.find_principal(conn, grant.principal_id),
                        access.roles_of(conn, grant.principal_id),
                    )
                )
                lacking = missing(held, needed, scope, also)
                if lacking:
                    raise grants.GrantRefused(
                        f"principal {principal.name!r} no longer holds "
                        f"{', '.join(f'{r} on {s}' for r, s in lacking)}"
                    )
        except (grants.GrantRefused, UnknownEntity) as exc:
            detail = {"status": "PERMISSION_DENIED", "reason": authz.cap(str(exc), 512)}
            self.ledger.audit.append(actor, action, resource, "denied", detail)
            raise grants.GrantRefused(str(exc)) from None
        on_behalf = dataclasses.replace(actor, on_behalf_of=principal.principal_id)
        checked: dict[str, object] = {"roles": list(needed), "scope": scope}
        self._spend(token, grant, run_id, actor, on_behalf, (action, resource), checked)
        return Authorized(principal, "", grant.expires_us)

    def _spend(
        self,
        token: str,
        grant: grants.Grant,
        run_id: str,
        actor: Actor,
        on_behalf: Actor,
        what: tuple[str, str],
        checked: dict[str, object],
    ) -> None:
        """Spend the grant on `run_id` and audit that in one transaction; GrantRefused (audited
        too) when another run spent it first."""
        action, resource = what
        gid = grants.grant_id(token)

        def run(conn: Connection, now: int) -> str:
            spent = grant_spends.spend(conn, gid, run_id, grant.subject, grant.principal_id, now)
            detail = {**checked, "grant": gid[:16], "run_id": run_id}
            if not spent.allows(run_id):
                reason = (
                    f"the trial grant was spent by run {spent.spent_by} of this trial; a grant "
                    f"authorises one run, not run {run_id} too: start the trial again with "
                    "`switchyard trial start`"
                )
                refused = {**detail, "status": "PERMISSION_DENIED", "reason": reason}
                refused["spent_by"] = spent.spent_by
                refused["grant_principal"] = grant.principal_id
                audit.append(conn, actor, action, resource, "denied", now, refused)
                return reason
            detail["spent"] = "now" if spent.first else "earlier, by this run (a retry)"
            audit.append(conn, on_behalf, action, resource, "ok", now, detail)
            return ""

        reason = self.ledger.tx.write(run)
        if reason:
            raise grants.GrantRefused(reason)


def _said(roles: Sequence[str], scope: str, more: Pairs) -> str:
    return ", ".join([f"{list(roles)} on {scope}", *(f"{r} on {s}" for r, s in more)])
