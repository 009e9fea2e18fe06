"""What Temporal stores of a trial is sealed (issue 31, point 4): a real trial runs, with its
grant in the memo, through a real dev server and worker whose data converter carries the
payload codec (workflows/temporal_codec.py). An insider then reads the workflow straight from
the Temporal server with a plain client, as its database or `temporal workflow show` would
show it: neither the grant nor the spec is in the history or the memo. The same reads with
the codec give both back."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from tests.security.test_grant_replay import Cluster, _grant, _run, _spec, cluster
from tests.trial.conftest import temporal_env
from workflows.activities.authorization import GRANT_MEMO
from workflows.temporal_codec import ENCODING, KEY_ID, EncryptionCodec

__all__ = ["cluster", "temporal_env"]


async def test_a_plain_client_reads_neither_grant_nor_spec(
    temporal_env: WorkflowEnvironment, cluster: Cluster
) -> None:
    marker = f"team-{uuid.uuid4().hex}"  # a spec value that appears nowhere else
    spec, workflow_id = _spec(team=marker), f"t-sealed-{uuid.uuid4().hex[:6]}"
    grant = await _grant(cluster, spec, workflow_id)
    report, handle = await _run(temporal_env, cluster, spec, workflow_id, grant)
    assert report.status == "completed"

    address = str(temporal_env.client.service_client.config.target_host)
    plain = await Client.connect(address)  # no codec: what the server holds
    assert plain.data_converter.payload_codec is None
    raw = plain.get_workflow_handle(workflow_id)
    history = await raw.fetch_history()
    blob = history.to_json()
    assert len(history.events) > 10  # started, the activities, completed
    assert grant not in blob and grant.encode() not in b"".join(e.SerializeToString() for e in history.events)
    for secret in (marker, "nowhere-a"):
        at = blob.find(secret)
        assert at < 0, blob[max(0, at - 600) : at + 100]  # the spec's team, its executors
    started = history.events[0].workflow_execution_started_event_attributes
    (sealed,) = started.input.payloads
    assert sealed.metadata["encoding"] == ENCODING and sealed.metadata[KEY_ID] == b"k1"
    memo = (await raw.describe()).raw_description.workflow_execution_info.memo.fields[GRANT_MEMO]
    assert memo.metadata["encoding"] == ENCODING and grant.encode() not in memo.data

    # with the codec (the worker's, the CLI's, the UI's codec endpoint): all readable
    codec = temporal_env.client.data_converter.payload_codec
    assert isinstance(codec, EncryptionCodec)
    (opened,) = await codec.decode([sealed])
    assert marker.encode() in opened.data and b"nowhere-a" in opened.data
    assert (await (await handle.describe()).memo())[GRANT_MEMO] == grant
    scheduled = [
        e.activity_task_scheduled_event_attributes
        for e in history.events
        if e.HasField("activity_task_scheduled_event_attributes")
    ]
    authorize = next(s for s in scheduled if s.activity_type.name == "authorize_trial")
    (inputs,) = await codec.decode(list(authorize.input.payloads))
    assert grant.encode() in inputs.data  # the grant travels in the activity input, sealed
    assert grant.encode() not in b"".join(p.data for p in authorize.input.payloads)


async def test_a_trial_started_in_clear_is_read_and_answered_sealed(
    temporal_env: WorkflowEnvironment,
) -> None:
    """What the Temporal UI or `temporal workflow start` sends has no codec: the worker reads it,
    and what it writes back (here the refusal that names the bad field) is sealed."""
    from workflows.activities.connections import Connections, WorkerConfig
    from workflows.worker import build_worker

    address = str(temporal_env.client.service_client.config.target_host)
    plain = await Client.connect(address)
    spec = {**_spec(), "polcy": {}}
    queue, workflow_id = f"q-{uuid.uuid4().hex[:8]}", f"t-clear-{uuid.uuid4().hex[:6]}"
    connections = Connections(WorkerConfig(metering="127.0.0.1:1"))
    async with build_worker(temporal_env.client, connections, task_queue=queue):
        handle = await plain.start_workflow("TrialWorkflow", spec, id=workflow_id, task_queue=queue)
        with pytest.raises(KeyError, match="Unknown payload encoding binary/encrypted"):
            await handle.result()  # the plain client cannot read the answer
    await connections.close()
    history = await handle.fetch_history()
    failed = history.events[-1].workflow_execution_failed_event_attributes.failure
    assert failed.message == "Encoded failure" and "polcy" not in history.events[
        -1
    ].SerializeToString().decode(errors="replace")
    with pytest.raises(WorkflowFailureError) as err:
        await temporal_env.client.get_workflow_handle(workflow_id).result()
    cause = err.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "InvalidTrialSpec"
    assert cause.message.startswith("invalid trial spec: polcy:")


def test_a_secure_worker_or_trial_start_without_the_codec_keys_refuses(tmp_path: Path) -> None:
    """With service identities on (not insecure), neither the worker nor `trial start` puts a
    grant or a spec into Temporal unsealed: both refuse and name the setting."""
    import json
    import os
    import subprocess
    import sys

    from switchyard import tls
    from tests.conftest import ROOT

    folders = tls.ensure_local_pki(tmp_path / "tls", ["worker", "operator"])
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SWITCHYARD_SECURITY", "SWITCHYARD_TEMPORAL"))
    }
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(_spec()))
    for who, args in (
        ("worker", ["worker", "--temporal", "127.0.0.1:1"]),
        ("operator", ["trial", "start", str(spec), "--temporal", "127.0.0.1:1", "--metering", "127.0.0.1:1"]),
    ):
        child_env = {**env, "PYTHONPATH": str(ROOT), tls.TLS_DIR_ENV: str(folders[who])}
        done = subprocess.run(
            [sys.executable, "-m", "clients.cli", *args],
            cwd=ROOT,
            env=child_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, done.stderr
        assert "SWITCHYARD_TEMPORAL_CODEC_KEY_FILE" in done.stderr and "Traceback" not in done.stderr
