"""Trials (issue 31, point 6): what a trial may replay and where it may send the worker.

Against a real metering over mTLS, as `switchyard trial start` asks it (request_grant), and
through Temporal as the Temporal UI starts a trial (the worker's UI principal):

- both workload fields, `inputs.workload` and `performance.generation.workload`, need
  `workloads:read` on the route each was captured at, not on the spec's model, and the grant's
  subject names both;
- a path naming its executor by host:port (the worker would dial it with its own certificate)
  needs `admin` on *; a name the worker was configured with does not.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import pytest_asyncio
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from services.metering.metering_server import RunningMetering, start_metering
from switchyard import tls
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as mgrpc
from switchyard.grpcio import ServerOptions
from tests.trial.conftest import temporal_env
from workflows.activities import authorization
from workflows.activities.connections import Connections, WorkerConfig
from workflows.spec.canonical import spec_sha256
from workflows.spec.trial_io import TrialInput
from workflows.spec.trial_spec import parse_spec
from workflows.trial import TrialWorkflow
from workflows.worker import build_worker

__all__ = ["temporal_env"]

OTHER = "other.0001"  # a workload captured at another team's route
SHA = "a" * 64
PRINCIPALS = {
    "mlp-team": [("trials:run", "model:mlp"), ("workloads:read", "model:mlp")],
    "ui": [("trials:run", "*")],  # what `switchyard up` gives the temporal-ui principal
    "both": [("trials:run", "model:mlp"), ("workloads:read", "model:other")],
    "root": [("admin", "*")],
}


@dataclass
class Cluster:
    metering: RunningMetering
    ids: dict[str, tls.Security]
    keys: dict[str, str]


@pytest_asyncio.fixture(scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    root = tmp_path_factory.mktemp("trial-authz")
    dirs = tls.ensure_local_pki(root / "tls", ["metering", "worker", "operator"])
    ids = {name: tls.Security.from_dir(folder) for name, folder in dirs.items()}
    metering = await start_metering(
        f"sqlite:///{root / 'ledger.db'}", ServerOptions(port=0, security=ids["metering"])
    )
    keys = {}
    async with tls.aio_channel(metering.address, security=ids["operator"], expect=tls.METERING) as channel:
        stub = mgrpc.MeteringStub(channel)
        for name, roles in PRINCIPALS.items():
            await stub.CreatePrincipal(mpb.CreatePrincipalRequest(name=name, kind="user", team="t"))
            for role, scope in roles:
                await stub.GrantRole(mpb.RoleRequest(principal=name, role=role, scope=scope))
            keys[name] = (await stub.CreateKey(mpb.CreateKeyRequest(principal=name))).key
    yield Cluster(metering, ids, keys)
    await metering.stop(0)


def _paths(executor: str = "nowhere") -> list[dict[str, str]]:
    return [
        {"name": "a", "executor": executor, "mode": "eager"},
        {"name": "b", "executor": "nowhere-b", "mode": "eager"},
    ]


def _replay(workload: str, executor: str = "nowhere") -> dict[str, Any]:
    """A trial of model mlp replaying `workload` as its inputs."""
    return {
        "model": {"name": "mlp"},
        "inputs": {"workload": workload, "sha256": SHA},
        "paths": _paths(executor),
        "reference": "a",
        "timeouts": {"activity_s": 20, "heartbeat_s": 10, "max_attempts": 1},
    }


def _tensors(executor: str) -> dict[str, Any]:
    """A trial of model mlp on seeded tensors, its path `a` on `executor`."""
    return {
        **_replay("", executor),
        "inputs": {"seed": 1, "tensors": [{"name": "x", "datatype": "FP32", "shape": [2, 16]}]},
    }


def _generation(workload: str) -> dict[str, Any]:
    """A generation trial of model mlp whose load replays `workload`'s prompts."""
    prompts = {"count": 2, "length": {"distribution": "fixed", "value": 4}, "max_tokens": 4, "high": 32}
    return {
        "model": {"name": "mlp"},
        "inputs": {"seed": 1, "prompts": prompts},
        "paths": _paths(),
        "reference": "a",
        "performance": {
            "scenarios": ["generation"],
            "generation": {"requests": 2, "concurrency": [1], "workload": workload, "sha256": SHA},
        },
        "timeouts": {"activity_s": 20, "heartbeat_s": 10, "max_attempts": 1},
    }


async def _grant(cluster: Cluster, who: str, spec: dict[str, Any], workflow_id: str = "t") -> str:
    return await authorization.request_grant(
        cluster.metering.address, parse_spec(spec), workflow_id, cluster.keys[who], cluster.ids["worker"]
    )


async def _refused(cluster: Cluster, who: str, spec: dict[str, Any]) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _grant(cluster, who, spec)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    return str(refused.value.details())


def _subject(grant: str) -> str:
    payload = grant.rpartition(".")[0]
    return str(json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))["s"])


async def test_inputs_workload_is_scoped_to_its_own_route(cluster: Cluster) -> None:
    """The issue's attack: workloads:read on model:mlp got a grant to replay another route."""
    message = await _refused(cluster, "mlp-team", _replay(OTHER))
    assert "lacks `workloads:read` on model:other" in message
    assert "switchyard roles grant mlp-team workloads:read --scope model:other" in message
    assert await _grant(cluster, "mlp-team", _replay("mlp.0001"))  # its own route
    assert await _grant(cluster, "both", _replay(OTHER))


async def test_the_generation_workload_needs_workloads_read_on_its_route(cluster: Cluster) -> None:
    """The issue's attack: trials:run on * alone (the temporal-ui principal) replayed any
    route's captured prompts through performance.generation.workload."""
    assert "lacks `workloads:read` on model:other" in await _refused(cluster, "ui", _generation(OTHER))
    assert "lacks `workloads:read` on model:other" in await _refused(cluster, "mlp-team", _generation(OTHER))
    assert await _grant(cluster, "both", _generation(OTHER))


async def test_the_grant_names_both_workloads_and_holds_only_for_them(cluster: Cluster) -> None:
    spec = _generation(OTHER)
    grant = await _grant(cluster, "both", spec, "t-named")
    sha = spec_sha256(parse_spec(spec))
    assert _subject(grant) == f"t-named|mlp||{OTHER}|spec:{sha}"
    need = authorization.needs(parse_spec(spec), "t-named")
    async with tls.aio_channel(
        cluster.metering.address, security=cluster.ids["worker"], expect=tls.METERING
    ) as channel:
        stub = mgrpc.MeteringStub(channel)

        def verify(subject: str, more: list[list[str]]) -> Any:
            bindings = [mpb.RoleBinding(role=r, scope=s) for r, s in more]
            request = mpb.VerifyGrantRequest(
                grant=grant, subject=subject, roles=need.roles, scope=need.scope, more=bindings, run_id="r1"
            )
            return stub.VerifyGrant(request, timeout=10)

        assert (await verify(need.subject, need.more)).principal.name == "both"
        for subject, more in (
            (f"t-named|mlp|||spec:{sha}", []),  # the workload swapped out of the spec
            (f"t-named|mlp||mlp.0001|spec:{sha}", [["workloads:read", "model:mlp"]]),  # swapped for another
            (need.subject, []),  # the workload's role dropped from the check
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await verify(subject, more)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, subject


async def test_an_executor_named_by_address_needs_admin(cluster: Cluster) -> None:
    spec = _tensors("10.0.0.9:8101")
    assert "lacks `admin` on *" in await _refused(cluster, "mlp-team", spec)
    assert "lacks `admin` on *" in await _refused(cluster, "ui", spec)
    assert await _grant(cluster, "root", spec)
    assert await _grant(cluster, "mlp-team", _tensors("cpu"))  # a name the worker is configured with


async def _run_from_ui(env: WorkflowEnvironment, cluster: Cluster, spec: dict[str, Any]) -> Any:
    """A trial started without a grant, as the Temporal UI starts one: it runs as the
    worker's UI principal (`ui`: trials:run on *)."""
    queue = f"q-{uuid.uuid4().hex[:8]}"
    config = WorkerConfig(
        metering=cluster.metering.address, ui_key=cluster.keys["ui"], executors={"cpu": "x:1"}
    )
    connections = Connections(config, security=cluster.ids["worker"])
    try:
        async with build_worker(env.client, connections, task_queue=queue):
            handle = await env.client.start_workflow(
                TrialWorkflow.run,
                TrialInput.from_json(spec),
                id=f"t-ui-{uuid.uuid4().hex[:6]}",
                task_queue=queue,
            )
            try:
                return await handle.result()
            except WorkflowFailureError as err:
                return err
    finally:
        await connections.close()


def _not_authorised(outcome: Any) -> str:
    assert isinstance(outcome, WorkflowFailureError), outcome
    cause = outcome.cause
    assert isinstance(cause, ApplicationError) and cause.type == "TrialNotAuthorized"
    return cause.message


async def test_the_worker_refuses_a_ui_trial_replaying_another_route_or_dialing_an_address(
    temporal_env: WorkflowEnvironment, cluster: Cluster
) -> None:
    """Through Temporal: the worker's own check, not the starter's, refuses both."""
    message = _not_authorised(await _run_from_ui(temporal_env, cluster, _generation(OTHER)))
    assert "lacks `workloads:read` on model:other" in message
    message = _not_authorised(await _run_from_ui(temporal_env, cluster, _tensors("127.0.0.1:9")))
    assert "lacks `admin` on *" in message
