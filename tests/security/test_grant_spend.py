"""Grant replay and spec swap (issue 31, point 4), against a real metering over mTLS, as an
insider who can read a trial's memo in Temporal would try them, on SQLite and on PostgreSQL:

- the grant, copied out of the memo, verified for a second run of the same workflow id: refused,
  naming the run that spent it, and audited; the first run's retries (the activity retried, a
  worker killed mid-activity) still pass;
- a spec swapped under the same workflow id, model, workloads and roles: refused (the grant
  binds the spec's sha256), and the refusal spends nothing;
- many runs racing on one grant across two metering replicas, as the runtime database role:
  exactly one spends it.

The same attacks through Temporal, a workflow restarted with the memo copied, are in
test_grant_replay.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from sqlalchemy import select

from services.metering import grants
from services.metering.metering_server import RunningMetering, start_metering
from services.metering.schema import AUDIT, GRANT_SPENDS
from switchyard import tls
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as mgrpc
from switchyard.grpcio import ServerOptions
from tests.metering.conftest import pg_roles_db
from workflows.activities.authorization import TrialAuthorization, needs, request_grant
from workflows.spec.canonical import spec_sha256
from workflows.spec.trial_spec import parse_spec

__all__ = ["pg_roles_db"]


def _spec(**overrides: Any) -> dict[str, Any]:
    return {
        "model": {"name": "mlp"},
        "inputs": {"seed": 1, "tensors": [{"name": "x", "datatype": "FP32", "shape": [2, 16]}]},
        "paths": [
            {"name": "a", "executor": "cpu", "mode": "eager"},
            {"name": "b", "executor": "cpu", "mode": "compile"},
        ],
        "reference": "a",
        **overrides,
    }


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tls.Security]:
    dirs = tls.ensure_local_pki(tmp_path_factory.mktemp("grant-pki"), ["metering", "worker", "operator"])
    return {name: tls.Security.from_dir(folder) for name, folder in dirs.items()}


@dataclass
class Cluster:
    meterings: list[RunningMetering]
    ids: dict[str, tls.Security]
    key: str  # the runner's: trials:run on model:mlp

    async def grant(self, spec: dict[str, Any], workflow_id: str) -> str:
        """What `switchyard trial start` puts in the memo."""
        address = self.meterings[0].address
        return await request_grant(address, parse_spec(spec), workflow_id, self.key, self.ids["worker"])

    def rows(self, table: Any, *where: Any) -> list[Any]:
        with self.meterings[0].ledger.engines.read.connect() as conn:
            return list(conn.execute(select(table).where(*where)).all())

    def audit(self, resource: str) -> list[Any]:
        return sorted(self.rows(AUDIT, AUDIT.c.resource == resource), key=lambda r: r.seq)


async def _cluster(url: str, ids: dict[str, tls.Security], replicas: int = 1) -> Cluster:
    options = ServerOptions(port=0, security=ids["metering"])
    meterings = [await start_metering(url, options) for _ in range(replicas)]
    address = meterings[0].address
    async with tls.aio_channel(address, security=ids["operator"], expect=tls.METERING) as channel:
        stub = mgrpc.MeteringStub(channel)
        await stub.CreatePrincipal(mpb.CreatePrincipalRequest(name="runner", kind="user", team="t"))
        await stub.GrantRole(mpb.RoleRequest(principal="runner", role="trials:run", scope="model:mlp"))
        key = (await stub.CreateKey(mpb.CreateKeyRequest(principal="runner"))).key
    return Cluster(meterings, ids, key)


@pytest.fixture
async def cluster(db_url: str, anchor: Path, ids: dict[str, tls.Security]) -> AsyncIterator[Cluster]:
    running = await _cluster(db_url, ids)
    try:
        yield running
    finally:
        for m in running.meterings:
            await m.stop(0.5)


async def verify(
    metering: RunningMetering, ids: dict[str, tls.Security], grant: str, need: TrialAuthorization, run_id: str
) -> tuple[str, str]:
    """The worker's VerifyGrant, as its authorize_trial activity sends it: 'ok' and the
    principal's name, or the status code's name and the details."""
    request = mpb.VerifyGrantRequest(
        grant=grant,
        subject=need.subject,
        roles=need.roles,
        scope=need.scope,
        action="trial.authorize",
        resource=f"trial/{need.subject.split('|')[0]}",
        run_id=run_id,
    )
    async with tls.aio_channel(metering.address, security=ids["worker"], expect=tls.METERING) as channel:
        try:
            answer = await mgrpc.MeteringStub(channel).VerifyGrant(request, timeout=10)
        except grpc.aio.AioRpcError as err:
            return err.code().name, str(err.details())
    return "ok", answer.principal.name


def test_the_spec_hash_is_of_what_the_worker_runs() -> None:
    """Key order, a default written out or a null left out change nothing; a value does."""
    spec = _spec()
    same = {**dict(reversed(list(_spec().items()))), "training": None, "timeouts": {"max_attempts": 3}}
    assert spec_sha256(parse_spec(same)) == spec_sha256(parse_spec(spec))
    looser = _spec(policy={"max_p95_regression": 5.0})
    assert spec_sha256(parse_spec(looser)) != spec_sha256(parse_spec(spec))
    assert needs(parse_spec(spec), "t").subject.endswith(f"|spec:{spec_sha256(parse_spec(spec))}")


async def test_a_second_run_cannot_spend_the_grant_while_the_first_runs_retries(cluster: Cluster) -> None:
    spec, workflow_id = _spec(), "t-replay"
    grant = await cluster.grant(spec, workflow_id)
    need = needs(parse_spec(spec), workflow_id)
    metering = cluster.meterings[0]
    # run A spends it; its activity's retries (same run id) pass
    for _ in range(3):
        assert await verify(metering, cluster.ids, grant, need, "run-A") == ("ok", "runner")
    # the insider: the same workflow id started again with the memo copied is another run
    code, why = await verify(metering, cluster.ids, grant, need, "run-B")
    assert code == "PERMISSION_DENIED", why
    assert "spent by run run-A" in why and "not run run-B" in why
    assert await verify(metering, cluster.ids, grant, need, "run-A") == ("ok", "runner")

    (spent,) = cluster.rows(GRANT_SPENDS)
    assert (spent.grant_id, spent.run_id, spent.subject) == (grants.grant_id(grant), "run-A", need.subject)
    rows = cluster.audit(f"trial/{workflow_id}")
    assert [r.outcome for r in rows] == ["ok", "ok", "ok", "ok", "denied", "ok"]  # issued, then verified
    details = [json.loads(r.detail_json) for r in rows]
    assert [d.get("spent") for d in details[1:4]] == ["now", *["earlier, by this run (a retry)"] * 2]
    assert {d["run_id"] for d in details[1:]} == {"run-A", "run-B"}
    refused = details[4]
    assert (refused["run_id"], refused["spent_by"]) == ("run-B", "run-A")
    assert refused["grant_principal"] == details[1]["on_behalf_of"] == rows[0].principal
    async with tls.aio_channel(metering.address, security=cluster.ids["operator"], expect=tls.METERING) as ch:
        assert (await mgrpc.MeteringStub(ch).VerifyAudit(mpb.VerifyAuditRequest())).ok


async def test_a_spec_swapped_under_the_workflow_id_is_refused(cluster: Cluster) -> None:
    """Same workflow id, model, workloads and roles; a policy that adopts anything."""
    spec, workflow_id = _spec(), "t-swap"
    grant = await cluster.grant(spec, workflow_id)
    swapped = needs(parse_spec(_spec(policy={"max_p95_regression": 100.0})), workflow_id)
    genuine = needs(parse_spec(spec), workflow_id)
    assert (swapped.roles, swapped.scope, swapped.more) == (genuine.roles, genuine.scope, genuine.more)
    metering = cluster.meterings[0]
    code, why = await verify(metering, cluster.ids, grant, swapped, "run-swap")
    assert code == "PERMISSION_DENIED", why
    assert "the trial grant is for another spec" in why and spec_sha256(parse_spec(spec))[:16] in why
    assert not cluster.rows(GRANT_SPENDS)  # the refusal spent nothing
    assert await verify(metering, cluster.ids, grant, genuine, "run-genuine") == ("ok", "runner")
    denied = [r for r in cluster.audit(f"trial/{workflow_id}") if r.outcome == "denied"]
    assert len(denied) == 1 and "another spec" in json.loads(denied[0].detail_json)["reason"]


async def test_a_verification_must_name_its_run(cluster: Cluster) -> None:
    spec = _spec()
    grant = await cluster.grant(spec, "t-norun")
    code, why = await verify(cluster.meterings[0], cluster.ids, grant, needs(parse_spec(spec), "t-norun"), "")
    assert code == "INVALID_ARGUMENT" and "run_id is empty" in why
    assert not cluster.rows(GRANT_SPENDS)


@pytest.mark.postgres
async def test_runs_racing_on_one_grant_across_replicas_spend_it_once(
    pg_roles_db: dict[str, str], anchor: Path, ids: dict[str, tls.Security]
) -> None:
    """Two replicas on one PostgreSQL ledger as the runtime role; 16 runs at once."""
    running = await _cluster(pg_roles_db["runtime"], ids, replicas=2)
    try:
        spec = _spec()
        grant = await running.grant(spec, "t-race")
        need = needs(parse_spec(spec), "t-race")
        answers = await asyncio.gather(
            *(verify(running.meterings[i % 2], ids, grant, need, f"run-{i}") for i in range(16))
        )
        winners = [i for i, (code, _) in enumerate(answers) if code == "ok"]
        assert len(winners) == 1, answers
        (spent,) = running.rows(GRANT_SPENDS)
        assert spent.run_id == f"run-{winners[0]}"
        refusals = {why for code, why in answers if code != "ok"}
        assert {code for code, _ in answers} == {"ok", "PERMISSION_DENIED"}
        assert all(f"spent by run run-{winners[0]} " in why for why in refusals), refusals
    finally:
        for m in running.meterings:
            await m.stop(0.5)
