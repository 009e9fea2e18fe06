"""Who may call which Metering RPC (with mTLS; an explicitly insecure metering trusts every caller).

A caller is the service its certificate names (spiffe://switchyard/<service>) and, when it
sends `authorization: Bearer <key>`, the key's principal as well:

- admin RPCs (principals, keys, roles, prices, reversals) need a key with role `admin`
  (scope *) or the operator's certificate (what `switchyard up` issues for the CLI on the
  machine, as a cluster admin's kubeconfig would be);
- RecordUsage, AppendAudit and the reservation and job RPCs take only the router's and the
  trial worker's certificates (executors and the evaluator may append only their own refusals);
- reads (reports, exports, trial reports, audit queries) need `ledger:read` (or admin), or a
  service that reads them for its work (the worker its trial's costs, the router the fleet's
  route changes);
- Authorize takes any valid key (it checks the roles the work needs itself) and the operator's
  certificate; VerifyGrant, the check of a trial's grant, is the trial worker's;
- Authenticate is the router's; a route or limit change (SaveRouteChange, SaveLimitChange)
  comes from the router on behalf of the admin whose key it checked, or from an admin.

A key that does not authenticate gets UNAUTHENTICATED (audited once, as `auth.denied`, by
the ledger's authenticate); a caller with neither a key nor a switchyard identity gets
UNAUTHENTICATED, and a known caller without the right PERMISSION_DENIED; both audited once
as `rpc.denied`, every string capped. The admitted caller is in `authz.CALLER`, and the
servicer writes it as the actor of every audit row.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from services.metering.ledger import Ledger
from services.metering.metering_errors import AuthFailed
from services.metering.records import Actor
from switchyard import authz, tls
from switchyard.errors import PermissionDenied, Unauthenticated

T = TypeVar("T")

ADMIN_RPCS = frozenset(
    ("CreatePrincipal", "CreateKey", "RevokeKey", "GrantRole", "RevokeRole", "SetPrice", "ReverseUsage")
)
READ_RPCS = frozenset(
    (
        "GetJobCost",
        "CostReport",
        "Export",
        "GetTrialReport",
        "ListRouteChanges",
        "ListLimitChanges",
        "QueryAudit",
        "VerifyAudit",
        "ListPaths",
    )
)
# service -> the RPCs its certificate alone allows (without a key)
# what both the router and the trial worker write: usage, its audit, reservations, jobs, paths
USAGE_WRITES = (
    "RecordUsage",
    "AppendAudit",
    "OpenReservation",
    "CloseReservation",
    "CompleteJob",
    "RegisterPath",
)
SERVICE_RPCS: dict[str, frozenset[str]] = {
    tls.ROUTER: frozenset(
        (
            "Authenticate",
            *USAGE_WRITES,
            "SaveRouteChange",
            "ListRouteChanges",
            "SaveLimitChange",
            "ListLimitChanges",
        )
    ),
    tls.WORKER: frozenset(
        (
            *USAGE_WRITES,
            "RecordTrial",
            "GetTrialReport",
            "GetJobCost",
            "CostReport",
            "VerifyGrant",
        )
    ),
    # refusals they audit (the servicer checks that it is one)
    tls.EXECUTOR: frozenset(("AppendAudit",)),
    tls.EVALUATOR: frozenset(("AppendAudit",)),
    # The operator reserves capacity for a window (the demo's idle-time window, say); usage and
    # jobs on it still come only from the router and the worker.
    tls.OPERATOR: ADMIN_RPCS
    | READ_RPCS
    | {
        "RegisterPath",
        "SaveRouteChange",
        "SaveLimitChange",
        "RecordTrial",
        "OpenReservation",
        "CloseReservation",
        "Authorize",
    },
}
# Any valid key may ask about itself (Authorize checks the roles the work needs).
KEY_RPCS = frozenset(("Authorize",))
# Only these services' certificates carry the data plane, whatever a key says.
DATA_PLANE = frozenset(
    ("RecordUsage", "AppendAudit", "OpenReservation", "CloseReservation", "CompleteJob", "Authenticate")
)


def _role_rpcs(roles: tuple[tuple[str, str], ...]) -> frozenset[str]:
    granted: set[str] = set()
    for role, scope in roles:
        if scope not in ("*", ""):
            continue
        if role == "admin":
            granted |= (
                ADMIN_RPCS | READ_RPCS | {"RegisterPath", "SaveRouteChange", "SaveLimitChange", "RecordTrial"}
            )
        elif role == "ledger:read":
            granted |= READ_RPCS
    return frozenset(granted - DATA_PLANE)


def bearer(context: Any) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else str(value)
            scheme, _, token = text.strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


class MeteringGuard:
    def __init__(self, security: tls.Security, ledger: Ledger, writer: ThreadPoolExecutor) -> None:
        self.security = security
        self.ledger = ledger
        self._writer = writer

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(
            self._writer, contextvars.copy_context().run, fn
        )

    async def admit(self, method: str, context: Any) -> None:
        caller = authz.caller_of(context, self.security)
        authz.CALLER.set(caller)
        if caller.insecure:
            return
        name = method.rsplit("/", 1)[-1]
        service = caller.service if authz.known(caller.identity) else ""
        allowed = set(SERVICE_RPCS.get(service, ()))
        key = bearer(context)
        if key is not None:
            key = key[: authz.MAX_AUDIT_STRING]  # a real key is far shorter; its id is audited
            source = authz.cap(f"{caller.identity or '-'} {caller.peer}")
            try:
                ident = await self._run(lambda: self.ledger.access.authenticate(key, Actor(source=source)))
            except AuthFailed as exc:  # audited once by authenticate, as auth.denied
                raise Unauthenticated(str(exc)) from None
            caller = authz.Caller(caller.identity, caller.peer, principal=ident.principal.principal_id)
            authz.CALLER.set(caller)
            allowed |= _role_rpcs(ident.roles) | KEY_RPCS
        if name in allowed:
            return
        who = caller.principal or caller.identity
        if not who or (key is None and not service):
            reason = (
                f"{name} needs an API key (metadata `authorization: Bearer <key>`) or a switchyard "
                f"service certificate; got {authz.cap(caller.identity, 80) or 'no identity'}"
            )
            await self._refuse(caller, method, "UNAUTHENTICATED", reason)
            raise Unauthenticated(reason)
        if name in DATA_PLANE:
            need = "the router's or the trial worker's certificate"
        elif name in ADMIN_RPCS:
            need = "a key with role `admin` (scope *)"
        elif name in READ_RPCS:
            need = "a key with role `ledger:read` (scope *)"
        else:
            need = "a key with role `admin` (scope *)"
        reason = f"{authz.cap(who, 80)} may not call {name}: it needs {need}"
        await self._refuse(caller, method, "PERMISSION_DENIED", reason)
        raise PermissionDenied(reason)

    async def _refuse(self, caller: authz.Caller, method: str, status: str, reason: str) -> None:
        refusal = authz.Refusal(caller.principal or caller.identity, caller.peer, method, status, reason)
        request = authz.audit_request(refusal, "metering")
        actor = Actor(request.actor.principal, request.actor.source)
        detail = {"status": status, "reason": authz.cap(reason, 512)}
        await self._run(
            lambda: self.ledger.audit.append(actor, "rpc.denied", request.resource, "denied", detail)
        )
