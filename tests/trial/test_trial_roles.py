"""`trials:run` (and `workloads:read` for a captured workload) is checked when a trial starts,
with mutual TLS on: real metering, a real Temporal dev server, the trial worker in-process with
its own certificate. The starter's key never enters Temporal: the workflow's memo holds a grant
metering signed, and the first activity has metering verify it (workflows/activities/authorization.py)."""

from __future__ import annotations

import argparse
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from sqlalchemy import select
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from clients import trial_commands
from services.metering.metering_server import RunningMetering, start_metering
from services.metering.schema import AUDIT
from switchyard import tls
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as mgrpc
from switchyard.grpcio import ServerOptions
from tests.trial.conftest import codec_key_file
from workflows.activities.authorization import GRANT_MEMO, needs, request_grant
from workflows.activities.connections import Connections, WorkerConfig
from workflows.spec.trial_io import TrialInput
from workflows.spec.trial_spec import parse_spec
from workflows.trial import TrialWorkflow
from workflows.worker import build_worker


def _spec(model: str = "mlp", workload: str = "") -> dict[str, Any]:
    inputs: dict[str, Any] = {"seed": 1, "tensors": [{"name": "x", "datatype": "FP32", "shape": [2, 16]}]}
    if workload:
        inputs = {"workload": workload, "sha256": "0" * 64}
    return {
        "model": {"name": model},
        "inputs": inputs,
        # executors this worker does not know: each path ends INCONCLUSIVE at once, which is
        # enough to see that the trial got past its authorisation
        "paths": [
            {"name": "a", "executor": "nowhere-a", "mode": "eager"},
            {"name": "b", "executor": "nowhere-b", "mode": "eager"},
        ],
        "reference": "a",
        "timeouts": {"activity_s": 20, "heartbeat_s": 10, "max_attempts": 1},
    }


@dataclass
class Setup:
    metering: RunningMetering
    ids: dict[str, tls.Security]
    dirs: dict[str, Path]
    keys: dict[str, str]  # principal name -> API key


@pytest_asyncio.fixture(scope="module")
async def setup(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Setup]:
    root = tmp_path_factory.mktemp("roles")
    dirs = tls.ensure_local_pki(root / "tls", ["metering", "worker", "router", "operator"])
    ids = {name: tls.Security.from_dir(folder) for name, folder in dirs.items()}
    metering = await start_metering(
        f"sqlite:///{root / 'ledger.db'}", ServerOptions(port=0, security=ids["metering"])
    )
    keys = {}
    async with tls.aio_channel(metering.address, security=ids["operator"], expect=tls.METERING) as channel:
        stub = mgrpc.MeteringStub(channel)
        for name, roles in (
            ("runner", [("trials:run", "model:mlp")]),
            ("reader", [("trials:run", "model:mlp"), ("workloads:read", "model:mlp")]),
            ("user", [("infer", "*")]),
            ("leaver", [("trials:run", "*")]),
        ):
            await stub.CreatePrincipal(mpb.CreatePrincipalRequest(name=name, kind="user", team="t"))
            for role, scope in roles:
                await stub.GrantRole(mpb.RoleRequest(principal=name, role=role, scope=scope))
            keys[name] = (await stub.CreateKey(mpb.CreateKeyRequest(principal=name))).key
    yield Setup(metering, ids, dirs, keys)
    await metering.stop(0)


def _audit(setup: Setup, action: str) -> list[Any]:
    with setup.metering.ledger.engines.write.connect() as conn:
        return list(conn.execute(select(AUDIT).where(AUDIT.c.action == action).order_by(AUDIT.c.seq)).all())


async def _grant(setup: Setup, who: str, spec: dict[str, Any], workflow_id: str) -> str:
    return await request_grant(
        setup.metering.address, parse_spec(spec), workflow_id, setup.keys[who], setup.ids["router"]
    )


async def test_authorize_names_the_missing_role_and_audits_each_answer(setup: Setup) -> None:
    before = len(_audit(setup, "trial.authorize"))
    with pytest.raises(grpc.aio.AioRpcError) as denied:
        await _grant(setup, "user", _spec(), "t-user")
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "lacks `trials:run` on model:mlp" in str(denied.value.details())
    assert "switchyard roles grant user trials:run --scope model:mlp" in str(denied.value.details())
    with pytest.raises(grpc.aio.AioRpcError) as scoped:  # trials:run on mlp says nothing of tiny-lm
        await _grant(setup, "runner", _spec("tiny-lm"), "t-runner-lm")
    assert scoped.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.aio.AioRpcError) as workload:  # a captured workload needs workloads:read
        await _grant(setup, "runner", _spec(workload="mlp.0001"), "t-runner-wl")
    assert workload.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "lacks `workloads:read` on model:mlp" in str(workload.value.details())
    assert await _grant(setup, "reader", _spec(workload="mlp.0001"), "t-reader-wl")
    with pytest.raises(grpc.aio.AioRpcError) as bad_key:
        await request_grant(
            setup.metering.address, parse_spec(_spec()), "t-x", "sk_0.nope", setup.ids["router"]
        )
    assert bad_key.value.code() == grpc.StatusCode.UNAUTHENTICATED
    rows = _audit(setup, "trial.authorize")[before:]
    assert [r.outcome for r in rows] == ["denied", "denied", "denied", "ok"]
    assert rows[-1].resource == "trial/t-reader-wl"
    assert all(r.principal.startswith("p_") for r in rows)  # the key's principal, authenticated


async def test_only_the_worker_verifies_grants_and_a_tampered_one_fails(setup: Setup) -> None:
    spec = _spec()
    grant = await _grant(setup, "runner", spec, "t-verify")
    subject = needs(parse_spec(spec), "t-verify").subject  # ends with the spec's sha256
    request = mpb.VerifyGrantRequest(
        grant=grant,
        subject=subject,
        roles=["trials:run"],
        scope="model:mlp",
        action="trial.authorize",
        run_id="run-1",
    )
    async with tls.aio_channel(
        setup.metering.address, security=setup.ids["router"], expect=tls.METERING
    ) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as router:
            await mgrpc.MeteringStub(channel).VerifyGrant(request)
    assert router.value.code() == grpc.StatusCode.PERMISSION_DENIED
    async with tls.aio_channel(
        setup.metering.address, security=setup.ids["worker"], expect=tls.METERING
    ) as channel:
        stub = mgrpc.MeteringStub(channel)
        ok = await stub.VerifyGrant(request)
        assert ok.principal.name == "runner"
        payload, _, tag = grant.rpartition(".")
        forged = payload[:-2] + ("AA" if payload[-2:] != "AA" else "BB") + "." + tag
        for bad, why in (
            (
                mpb.VerifyGrantRequest(
                    grant=forged, subject=request.subject, roles=["trials:run"], scope="model:mlp"
                ),
                "signature",
            ),
            (
                mpb.VerifyGrantRequest(
                    grant=grant,
                    subject=needs(parse_spec(spec), "t-other").subject,
                    roles=["trials:run"],
                    scope="model:mlp",
                ),
                "is for",
            ),
            (
                mpb.VerifyGrantRequest(
                    grant=grant, subject=request.subject, roles=["infer"], scope="model:mlp"
                ),
                "this trial needs",
            ),
            (
                mpb.VerifyGrantRequest(
                    grant="", subject=request.subject, roles=["trials:run"], scope="model:mlp"
                ),
                "missing",
            ),
        ):
            bad.run_id = request.run_id  # the run that holds the grant: only the tampering differs
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.VerifyGrant(bad)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, why
            assert why in str(refused.value.details())


async def _run(
    env: WorkflowEnvironment,
    setup: Setup,
    spec: dict[str, Any],
    workflow_id: str,
    grant: str,
    ui_key: str = "",
) -> tuple[Any, Any]:
    queue = f"q-{uuid.uuid4().hex[:8]}"
    config = WorkerConfig(metering=setup.metering.address, ui_key=ui_key)
    connections = Connections(config, security=setup.ids["worker"])
    try:
        async with build_worker(env.client, connections, task_queue=queue):
            handle = await env.client.start_workflow(
                TrialWorkflow.run,
                TrialInput.from_json(spec),
                id=workflow_id,
                task_queue=queue,
                memo={GRANT_MEMO: grant} if grant else None,
            )
            try:
                return await handle.result(), handle
            except WorkflowFailureError as err:
                return err, handle
    finally:
        await connections.close()


def _not_authorised(outcome: Any) -> str:
    assert isinstance(outcome, WorkflowFailureError), outcome
    cause = outcome.cause
    assert isinstance(cause, ApplicationError) and cause.type == "TrialNotAuthorized" and cause.non_retryable
    return cause.message


async def _scheduled(handle: Any) -> list[str]:
    history = await handle.fetch_history()
    return [
        e.activity_task_scheduled_event_attributes.activity_type.name
        for e in history.events
        if e.HasField("activity_task_scheduled_event_attributes")
    ]


async def test_a_trial_runs_only_with_a_grant_its_principal_still_holds(
    temporal_env: WorkflowEnvironment, setup: Setup
) -> None:
    spec = _spec()
    # no grant (as the Temporal UI would start it): refused before anything is measured or written
    outcome, handle = await _run(temporal_env, setup, spec, f"t-none-{uuid.uuid4().hex[:6]}", "")
    assert "carries no grant" in _not_authorised(outcome)
    assert await _scheduled(handle) == ["authorize_trial"]

    # a grant of the runner's, for this workflow: the trial runs (its paths end INCONCLUSIVE: the
    # executors are nowhere), and the worker's check is audited on the runner's behalf
    workflow_id = f"t-ok-{uuid.uuid4().hex[:6]}"
    grant = await _grant(setup, "runner", spec, workflow_id)
    memo_only = json.dumps(spec)
    assert setup.keys["runner"].split(".")[1] not in memo_only + grant  # no secret goes to Temporal
    report, handle = await _run(temporal_env, setup, spec, workflow_id, grant)
    assert not isinstance(report, WorkflowFailureError), report
    assert report.status == "completed"
    assert (await _scheduled(handle))[:2] == ["authorize_trial", "record_trial"]
    verified = [r for r in _audit(setup, "trial.authorize") if r.resource == f"trial/{workflow_id}"]
    assert [r.outcome for r in verified] == ["ok", "ok"]  # issued (CLI), verified (worker)
    assert verified[1].principal == "spiffe://switchyard/worker"
    assert json.loads(verified[1].detail_json)["on_behalf_of"] == verified[0].principal

    # the same grant on another workflow id is not this trial's
    outcome, _ = await _run(temporal_env, setup, spec, f"t-copy-{uuid.uuid4().hex[:6]}", grant)
    assert "the trial grant is for" in _not_authorised(outcome)

    # a role revoked between start and the first activity stops the trial
    workflow_id = f"t-left-{uuid.uuid4().hex[:6]}"
    grant = await _grant(setup, "leaver", spec, workflow_id)
    async with tls.aio_channel(
        setup.metering.address, security=setup.ids["operator"], expect=tls.METERING
    ) as channel:
        await mgrpc.MeteringStub(channel).RevokeRole(
            mpb.RoleRequest(principal="leaver", role="trials:run", scope="*")
        )
    outcome, _ = await _run(temporal_env, setup, spec, workflow_id, grant)
    assert "no longer holds trials:run" in _not_authorised(outcome)


async def test_a_trial_from_the_temporal_ui_runs_as_the_workers_ui_principal(
    temporal_env: WorkflowEnvironment, setup: Setup
) -> None:
    spec = _spec()
    # the UI principal holds trials:run on mlp: a grantless trial runs, checked and audited as it
    workflow_id = f"t-ui-{uuid.uuid4().hex[:6]}"
    report, handle = await _run(temporal_env, setup, spec, workflow_id, "", ui_key=setup.keys["runner"])
    assert not isinstance(report, WorkflowFailureError), report
    assert report.status == "completed"
    assert (await _scheduled(handle))[:2] == ["authorize_trial", "record_trial"]
    rows = [r for r in _audit(setup, "trial.authorize") if r.resource == f"trial/{workflow_id}"]
    assert [r.outcome for r in rows] == ["ok", "ok"]  # issued to the UI key, verified by the worker
    assert json.loads(rows[1].detail_json)["on_behalf_of"] == rows[0].principal
    # its roles are checked like anyone's: trials:run on mlp says nothing of tiny-lm
    outcome, handle = await _run(
        temporal_env, setup, _spec("tiny-lm"), f"t-ui-lm-{uuid.uuid4().hex[:6]}", "", setup.keys["runner"]
    )
    message = _not_authorised(outcome)
    assert "the worker's UI principal may not run this trial" in message
    assert "lacks `trials:run` on model:tiny-lm" in message
    assert await _scheduled(handle) == ["authorize_trial"]
    # a revoked or unknown UI key is refused too
    outcome, _ = await _run(temporal_env, setup, spec, f"t-ui-bad-{uuid.uuid4().hex[:6]}", "", "sk_0.nope")
    assert "the worker's UI principal may not run this trial" in _not_authorised(outcome)


async def test_trial_start_refuses_a_key_without_the_role_before_starting(
    temporal_env: WorkflowEnvironment,
    setup: Setup,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv(tls.INSECURE_ENV, raising=False)
    monkeypatch.setenv(tls.TLS_DIR_ENV, str(setup.dirs["operator"]))
    monkeypatch.setenv("SWITCHYARD_API_KEY", setup.keys["user"])
    (tmp_path / "spec.json").write_text(json.dumps(_spec()))
    workflow_id = f"t-cli-{uuid.uuid4().hex[:6]}"
    args = argparse.Namespace(
        spec=str(tmp_path / "spec.json"),
        id=workflow_id,
        wait=False,
        task_queue="nobody-polls",
        temporal=str(temporal_env.client.service_client.config.target_host),
        namespace="default",
        metering=setup.metering.address,
        temporal_tls=False,
        temporal_tls_ca="",
        temporal_tls_cert="",
        temporal_tls_key="",
        temporal_tls_server_name="",
        codec_key_file=codec_key_file(temporal_env),  # the grant is sealed in the memo
    )
    assert await trial_commands._start(args) == 2
    err = capsys.readouterr().err
    assert "trial not started: PERMISSION_DENIED" in err and "lacks `trials:run`" in err
    with pytest.raises(Exception, match="not found"):
        await temporal_env.client.get_workflow_handle(workflow_id).describe()
    # with the role: started, the grant in its memo
    monkeypatch.setenv("SWITCHYARD_API_KEY", setup.keys["runner"])
    assert await trial_commands._start(args) == 0
    handle = temporal_env.client.get_workflow_handle(workflow_id)
    memo = await (await handle.describe()).memo()
    assert memo[GRANT_MEMO].count(".") == 1 and setup.keys["runner"].split(".")[1] not in memo[GRANT_MEMO]
    await handle.terminate("test done")


async def test_workloads_commands_need_workloads_read(
    setup: Setup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real captured workload (the router's Capturer), read through `switchyard workloads`."""
    import asyncio

    from clients.cli import main as switchyard
    from services.router.capture import Capturer, CaptureSpec
    from switchyard.gen.inference import grpc_service_pb2 as ipb
    from switchyard.judge.capture_format import list_workloads

    folder = tmp_path / "workloads"
    capturer = Capturer("mlp", CaptureSpec(share=1.0), folder / "mlp")
    capturer.start()
    request = ipb.ModelInferRequest(model_name="mlp")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    request.raw_input_contents.append(b"\0" * 16)
    capturer.offer(request.SerializeToString())
    await capturer.close()
    (entry,) = list_workloads(folder)

    monkeypatch.delenv(tls.INSECURE_ENV, raising=False)
    monkeypatch.setenv(tls.TLS_DIR_ENV, str(setup.dirs["router"]))  # a certificate, but no role
    common = ["--dir", str(folder), "--metering", setup.metering.address]

    async def run(who: str, *command: str) -> int:
        monkeypatch.setenv("SWITCHYARD_API_KEY", setup.keys[who])
        return await asyncio.to_thread(switchyard, ["workloads", *command, *common])

    before = len(_audit(setup, "workloads.read"))
    capsys.readouterr()
    assert await run("runner", "show", entry["id"]) == 2
    err = capsys.readouterr().err
    assert "PERMISSION_DENIED" in err and "lacks `workloads:read` on model:mlp" in err
    assert await run("reader", "show", entry["id"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 1
    out = tmp_path / "copy.rec"
    assert await run("reader", "export", entry["id"], "-o", str(out)) == 0
    assert out.exists()
    assert await run("reader", "list") == 2  # workloads:read on mlp does not cover every route
    assert "lacks `workloads:read` on *" in capsys.readouterr().err
    rows = _audit(setup, "workloads.read")[before:]
    assert [(r.outcome, r.resource) for r in rows] == [
        ("denied", f"workload/{entry['id']}"),
        ("ok", f"workload/{entry['id']}"),
        ("ok", f"workload/{entry['id']}"),
        ("denied", f"workloads/{folder}"[:200]),
    ]
