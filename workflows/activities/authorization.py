"""Who started a trial, checked before it measures anything: `trials:run` on the model's scope,
`workloads:read` on the route of each captured workload it replays (`inputs.workload` and
`performance.generation.workload`, each on its own route), and `admin` on * when a path names
its executor by host:port rather than by a name the worker was configured with (the worker
would dial it with its own certificate).

The starter (`switchyard trial start`, the demo) asks metering's Authorize with its API key
(SWITCHYARD_API_KEY; else the operator's certificate, which acts as a cluster admin) and gets a
signed grant of the subject
"<workflow id>|<model>|<inputs' workload>|<generation's workload>|spec:<sha256>", the last the
sha256 of the parsed spec's canonical JSON (workflows/spec/canonical.py, which the workflow
hashes too, so a spec swapped under the same workflow id is not the grant's).
It travels in the workflow's memo, so the history holds the grant, never the key; the
workflow's first activity hands it to metering's VerifyGrant with the workflow's run id. The
first verification spends the grant on that run: a later one for another run (the same
workflow id started again with the memo copied) is refused, while a retry of the activity
(same run) passes. VerifyGrant also checks that the principal still holds the roles.

A trial without a grant (started from the Temporal UI or `temporal workflow start`) runs as the
worker's UI principal when the operator gave the worker one (`switchyard worker --ui-key-file`):
the worker asks Authorize with that key, exactly as a starter would, so the principal's roles are
checked and audited like anyone's. Without one it is refused, unless the worker is explicitly
insecure, where nothing is authenticated anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from temporalio import activity
from temporalio.exceptions import ApplicationError

from switchyard import tls
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as mgrpc
from switchyard.judge.capture_format import workload_route
from workflows.activities.connections import Connections, grpc_errors
from workflows.spec.canonical import spec_sha256
from workflows.spec.trial_spec import TrialSpec

GRANT_MEMO = "switchyard-grant"
ACTION = "trial.authorize"


@dataclass
class TrialAuthorization:
    grant: str
    subject: str
    roles: list[str]
    scope: str
    more: list[list[str]] = field(default_factory=list)  # [role, scope]: each on its own scope


@dataclass
class TrialPrincipal:
    principal_id: str  # "" when not checked (an insecure worker, no grant)
    name: str
    note: str = ""


def needs(spec: TrialSpec, workflow_id: str) -> TrialAuthorization:
    """What the trial needs, grant not yet filled in."""
    generation = spec.performance.generation
    workloads = (spec.inputs.workload, generation.workload if generation else "")
    more = [["workloads:read", f"model:{workload_route(w)}"] for w in dict.fromkeys(workloads) if w]
    if any(":" in path.executor for path in spec.paths):  # an address, not a configured name
        more.append(["admin", "*"])
    subject = "|".join((workflow_id, spec.model.name, *workloads, f"spec:{spec_sha256(spec)}"))
    return TrialAuthorization("", subject, ["trials:run"], f"model:{spec.model.name}", more)


def _bindings(need: TrialAuthorization) -> list[mpb.RoleBinding]:
    return [mpb.RoleBinding(role=role, scope=scope) for role, scope in need.more]


async def request_grant(
    metering: str, spec: TrialSpec, workflow_id: str, api_key: str = "", security: tls.Security | None = None
) -> str:
    """The grant for starting `spec` as `workflow_id`, from metering, with `api_key` or this
    process's certificate; "" on an explicitly insecure setup without a key (nothing to check).
    Raises grpc.aio.AioRpcError as metering refuses (PERMISSION_DENIED names the missing role)."""
    security = tls.resolve(security)
    if security.insecure and not api_key:
        return ""
    async with tls.aio_channel(metering, security=security, expect=tls.METERING) as channel:
        return await ask_grant(mgrpc.MeteringStub(channel), needs(spec, workflow_id), workflow_id, api_key)


async def ask_grant(
    metering: mgrpc.MeteringAsyncStub,
    need: TrialAuthorization,
    workflow_id: str,
    api_key: str,
    source: str = "switchyard trial start",
) -> str:
    """Metering's signed grant of `need` for `workflow_id`, asked with `api_key` as the call's
    bearer metadata (else as the certificate of the channel `metering` is on)."""
    answer = await metering.Authorize(
        mpb.AuthorizeRequest(
            roles=need.roles,
            scope=need.scope,
            action=ACTION,
            resource=f"trial/{workflow_id}",
            grant_subject=need.subject,
            actor=mpb.Actor(source=source),
            more=_bindings(need),
        ),
        metadata=(("authorization", f"Bearer {api_key}"),) if api_key else None,
        timeout=30,
    )
    return answer.grant


class AuthorizationActivities:
    def __init__(self, connections: Connections) -> None:
        self.connections = connections

    @activity.defn(name="authorize_trial")
    async def authorize_trial(self, request: TrialAuthorization) -> TrialPrincipal:
        workflow_id = request.subject.split("|", 1)[0]
        note = ""
        if not request.grant:
            if self.connections.security.insecure:
                return TrialPrincipal(
                    "", "", "not checked: the worker is insecure (plaintext, no identities)"
                )
            request.grant = await self._ui_grant(request, workflow_id)
            note = "started without a grant (Temporal UI or CLI): runs as the worker's UI principal"
        with grpc_errors("trial authorisation"):
            answer = await self.connections.metering().VerifyGrant(
                mpb.VerifyGrantRequest(
                    grant=request.grant,
                    subject=request.subject,
                    roles=request.roles,
                    scope=request.scope,
                    action=ACTION,
                    resource=f"trial/{workflow_id}",
                    more=_bindings(request),
                    run_id=activity.info().workflow_run_id or "",  # the run that spends the grant
                ),
                timeout=30,
            )
        return TrialPrincipal(answer.principal.principal_id, answer.principal.name, note)

    async def _ui_grant(self, request: TrialAuthorization, workflow_id: str) -> str:
        """The grant of the worker's UI principal for a trial started without one; refused
        (TrialNotAuthorized, naming the missing role or the fix) as metering refuses it."""
        ui_key = self.connections.config.ui_key
        if not ui_key:
            raise ApplicationError(
                "this trial carries no grant: start it with `switchyard trial start` and a key holding "
                f"{' and '.join(request.roles)} on {request.scope}"
                f"{''.join(f', {role} on {scope}' for role, scope in request.more)} "
                "(SWITCHYARD_API_KEY), or give the "
                "worker a UI principal's key (`switchyard worker --ui-key-file`) for trials started "
                "from the Temporal UI",
                type="TrialNotAuthorized",
                non_retryable=True,
            )
        try:
            return await ask_grant(  # on the worker's channel: its certificate, the UI key's principal
                self.connections.metering(),
                request,
                workflow_id,
                ui_key,
                source="trial worker, for a trial started without a grant",
            )
        except grpc.aio.AioRpcError as err:
            if err.code() not in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
                raise
            raise ApplicationError(
                f"the worker's UI principal may not run this trial: {err.details()}",
                type="TrialNotAuthorized",
                non_retryable=True,
            ) from None
