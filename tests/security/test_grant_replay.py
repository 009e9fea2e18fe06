"""Grant replay and spec swap (issue 31, point 4) through Temporal, as an insider who can read
a trial's memo would try them: a real metering over mTLS, a real Temporal dev server, the trial
worker in-process with its own certificate.

- A trial runs with its grant. The insider reads the memo and starts the same workflow id
  again (a new run) with it: refused, naming the run that spent the grant.
- The insider starts the workflow id again with another spec and the copied memo: refused,
  the grant is for another spec.
- The worker dies after metering verified the grant but before Temporal heard back: the
  activity's retry (the same run) passes, and the trial completes.

The same attacks on metering alone, on SQLite and PostgreSQL, are in test_grant_spend.py.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio
from sqlalchemy import select
from temporalio import activity
from temporalio.client import WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from services.metering.metering_server import RunningMetering, start_metering
from services.metering.schema import AUDIT
from switchyard import tls
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as mgrpc
from switchyard.grpcio import ServerOptions
from tests.trial.conftest import temporal_env
from workflows.activities.authorization import (
    GRANT_MEMO,
    AuthorizationActivities,
    TrialAuthorization,
    TrialPrincipal,
    request_grant,
)
from workflows.activities.connections import Connections, WorkerConfig
from workflows.spec.trial_io import TrialInput
from workflows.spec.trial_spec import parse_spec
from workflows.trial import TrialWorkflow
from workflows.worker import activities, with_trial_converter

__all__ = ["temporal_env"]


def _spec(max_attempts: int = 1, **overrides: Any) -> dict[str, Any]:
    return {
        "model": {"name": "mlp"},
        "inputs": {"seed": 1, "tensors": [{"name": "x", "datatype": "FP32", "shape": [2, 16]}]},
        # executors this worker does not know: each path ends INCONCLUSIVE at once, which is
        # enough to see whether the trial got past its authorisation
        "paths": [
            {"name": "a", "executor": "nowhere-a", "mode": "eager"},
            {"name": "b", "executor": "nowhere-b", "mode": "eager"},
        ],
        "reference": "a",
        "timeouts": {"activity_s": 20, "heartbeat_s": 10, "max_attempts": max_attempts},
        **overrides,
    }


@dataclass
class Cluster:
    metering: RunningMetering
    ids: dict[str, tls.Security]
    key: str  # the runner's: trials:run on model:mlp

    def audit(self, workflow_id: str) -> list[Any]:
        with self.metering.ledger.engines.read.connect() as conn:
            where = (AUDIT.c.resource == f"trial/{workflow_id}") & (AUDIT.c.action == "trial.authorize")
            return list(conn.execute(select(AUDIT).where(where).order_by(AUDIT.c.seq)).all())


@pytest_asyncio.fixture(scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    root = tmp_path_factory.mktemp("grant-replay")
    dirs = tls.ensure_local_pki(root / "tls", ["metering", "worker", "operator"])
    ids = {name: tls.Security.from_dir(folder) for name, folder in dirs.items()}
    metering = await start_metering(
        f"sqlite:///{root / 'ledger.db'}", ServerOptions(port=0, security=ids["metering"])
    )
    async with tls.aio_channel(metering.address, security=ids["operator"], expect=tls.METERING) as channel:
        stub = mgrpc.MeteringStub(channel)
        await stub.CreatePrincipal(mpb.CreatePrincipalRequest(name="runner", kind="user", team="t"))
        await stub.GrantRole(mpb.RoleRequest(principal="runner", role="trials:run", scope="model:mlp"))
        key = (await stub.CreateKey(mpb.CreateKeyRequest(principal="runner"))).key
    yield Cluster(metering, ids, key)
    await metering.stop(0)


class DiesOnce:
    """authorize_trial on a worker that dies on its first attempt after metering verified the
    grant, before Temporal heard back; the retry is the real activity's."""

    def __init__(self, real: AuthorizationActivities) -> None:
        self.real = real

    @activity.defn(name="authorize_trial")
    async def authorize_trial(self, request: TrialAuthorization) -> TrialPrincipal:
        principal = await self.real.authorize_trial(request)
        if activity.info().attempt == 1:
            raise RuntimeError("worker killed after VerifyGrant answered")
        return principal


async def _run(
    env: WorkflowEnvironment,
    cluster: Cluster,
    spec: dict[str, Any],
    workflow_id: str,
    grant: str,
    dies: bool = False,
) -> tuple[Any, WorkflowHandle[Any, Any]]:
    """Start `workflow_id` with `grant` in its memo, as `switchyard trial start` (or an insider
    with a copied memo) does; the report, or the failure."""
    queue = f"q-{uuid.uuid4().hex[:8]}"
    connections = Connections(WorkerConfig(metering=cluster.metering.address), security=cluster.ids["worker"])
    steps = list(activities(connections))
    if dies:
        steps = [DiesOnce(AuthorizationActivities(connections)).authorize_trial] + [
            a for a in steps if getattr(a, "__name__", "") != "authorize_trial"
        ]
    worker = Worker(
        with_trial_converter(env.client), task_queue=queue, workflows=[TrialWorkflow], activities=steps
    )
    try:
        async with worker:
            handle = await env.client.start_workflow(
                TrialWorkflow.run,
                TrialInput.from_json(spec),
                id=workflow_id,
                task_queue=queue,
                memo={GRANT_MEMO: grant},
            )
            try:
                return await handle.result(), handle
            except WorkflowFailureError as err:
                return err, handle
    finally:
        await connections.close()


def _refusal(outcome: Any) -> str:
    assert isinstance(outcome, WorkflowFailureError), outcome
    cause = outcome.cause
    assert isinstance(cause, ApplicationError) and cause.type == "TrialNotAuthorized" and cause.non_retryable
    return cause.message


async def _grant(cluster: Cluster, spec: dict[str, Any], workflow_id: str) -> str:
    return await request_grant(
        cluster.metering.address, parse_spec(spec), workflow_id, cluster.key, cluster.ids["worker"]
    )


async def test_a_workflow_restarted_with_the_memo_copied_is_refused(
    temporal_env: WorkflowEnvironment, cluster: Cluster
) -> None:
    spec, workflow_id = _spec(), f"t-replay-{uuid.uuid4().hex[:6]}"
    report, first = await _run(
        temporal_env, cluster, spec, workflow_id, await _grant(cluster, spec, workflow_id)
    )
    assert not isinstance(report, WorkflowFailureError), report
    assert report.status == "completed"
    first_run = (await first.describe()).run_id

    # the insider reads the memo in Temporal ...
    copied = (await (await first.describe()).memo())[GRANT_MEMO]
    # ... and starts the same workflow id again, the same spec: a new run, refused
    outcome, second = await _run(temporal_env, cluster, spec, workflow_id, copied)
    message = _refusal(outcome)
    assert f"the trial grant was spent by run {first_run}" in message
    second_run = (await second.describe()).run_id
    assert second_run != first_run and f"not run {second_run}" in message

    # ... or with another spec (a policy that adopts anything): refused, another spec
    swapped = _spec(policy={"max_p95_regression": 100.0, "min_cost_saving": -0.99})
    outcome, _ = await _run(temporal_env, cluster, swapped, workflow_id, copied)
    assert "the trial grant is for another spec" in _refusal(outcome)

    rows = cluster.audit(workflow_id)
    assert [r.outcome for r in rows] == ["ok", "ok", "denied", "denied"]  # issued, spent, 2 refused
    spent, replay = json.loads(rows[1].detail_json), json.loads(rows[2].detail_json)
    assert (spent["run_id"], spent["spent"]) == (first_run, "now")
    assert (replay["run_id"], replay["spent_by"]) == (second_run, first_run)
    assert "another spec" in json.loads(rows[3].detail_json)["reason"]


async def test_the_authorization_retried_after_a_worker_died_passes(
    temporal_env: WorkflowEnvironment, cluster: Cluster
) -> None:
    spec, workflow_id = _spec(max_attempts=2), f"t-retry-{uuid.uuid4().hex[:6]}"
    grant = await _grant(cluster, spec, workflow_id)
    report, handle = await _run(temporal_env, cluster, spec, workflow_id, grant, dies=True)
    assert not isinstance(report, WorkflowFailureError), report
    assert report.status == "completed"
    run_id = (await handle.describe()).run_id
    history = await handle.fetch_history()
    started = [e for e in history.events if e.HasField("activity_task_started_event_attributes")]
    assert started[0].activity_task_started_event_attributes.attempt == 2  # authorize_trial, retried
    rows = cluster.audit(workflow_id)
    assert [r.outcome for r in rows] == ["ok", "ok", "ok"]  # issued, spent, the retry
    details = [json.loads(r.detail_json) for r in rows[1:]]
    assert [(d["run_id"], d["spent"]) for d in details] == [
        (run_id, "now"),
        (run_id, "earlier, by this run (a retry)"),
    ]
