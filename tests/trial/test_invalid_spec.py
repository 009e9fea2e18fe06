"""An invalid spec is rejected at once, as a non-retryable failure that names the field."""

from __future__ import annotations

import argparse
import uuid

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from clients import trial_commands
from switchyard.grpcio import RunningServer
from tests.trial.conftest import codec_key_file
from tests.trial.trial_helpers import minimal_spec
from workflows.activities.connections import Connections, WorkerConfig
from workflows.worker import build_worker


async def test_invalid_spec_fails_the_workflow_at_once_naming_the_field(
    temporal_env: WorkflowEnvironment, evaluator: RunningServer, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = minimal_spec({"a": "eager", "b": "warp-speed"}, shape=(2, 4), high=9)
    queue = f"q-{uuid.uuid4().hex[:8]}"
    connections = Connections(WorkerConfig(evaluator=evaluator.address, metering="127.0.0.1:1"))
    async with build_worker(temporal_env.client, connections, task_queue=queue):
        workflow_id = f"bad-{uuid.uuid4().hex[:8]}"
        # by type name with the JSON object, as the Temporal UI and CLI start it
        handle = await temporal_env.client.start_workflow(
            "TrialWorkflow", spec, id=workflow_id, task_queue=queue
        )
        with pytest.raises(WorkflowFailureError) as err:
            await handle.result()
    cause = err.value.cause
    assert isinstance(cause, ApplicationError)
    assert cause.type == "InvalidTrialSpec" and cause.non_retryable
    assert "paths[1].mode" in cause.message and "'warp-speed' is not one of eager" in cause.message
    assert cause.details == ({"field": "paths[1].mode"},)
    history = await handle.fetch_history()
    assert sum(1 for e in history.events if e.HasField("activity_task_scheduled_event_attributes")) == 0
    await connections.close()
    # what `switchyard trial status ID` prints for it
    address = str(temporal_env.client.service_client.config.target_host)
    status = argparse.Namespace(
        trial_id=workflow_id,
        temporal=address,
        namespace="default",
        temporal_tls=False,
        temporal_tls_ca="",
        temporal_tls_cert="",
        temporal_tls_key="",
        temporal_tls_server_name="",
        codec_key_file=codec_key_file(temporal_env),
    )
    assert await trial_commands._status(status) == 1
    assert "FAILED: invalid trial spec: paths[1].mode" in capsys.readouterr().out


async def test_a_misspelt_top_level_key_from_the_ui_is_named_not_dropped(
    temporal_env: WorkflowEnvironment, evaluator: RunningServer
) -> None:
    # Temporal's dataclass conversion drops keys TrialInput does not define; the worker's
    # payload converter keeps them so the spec parser names the misspelling
    spec = {
        **minimal_spec({"a": "eager", "b": "eager"}, shape=(2, 4), high=None),
        "polcy": {"min_cost_saving": 0.1},
    }
    queue = f"q-{uuid.uuid4().hex[:8]}"
    connections = Connections(WorkerConfig(evaluator=evaluator.address, metering="127.0.0.1:1"))
    async with build_worker(temporal_env.client, connections, task_queue=queue):
        handle = await temporal_env.client.start_workflow(
            "TrialWorkflow", spec, id=f"typo-{uuid.uuid4().hex[:8]}", task_queue=queue
        )
        with pytest.raises(WorkflowFailureError) as err:
            await handle.result()
    await connections.close()
    cause = err.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "InvalidTrialSpec"
    assert cause.message.startswith("invalid trial spec: polcy: is not a known field here")
    assert cause.details == ({"field": "polcy"},)


def test_trial_input_is_the_spec_object_both_ways() -> None:
    from temporalio.converter import DataConverter

    from workflows.spec.trial_io import TRIAL_CONVERTER, TrialInput

    spec = {"model": {"name": "tiny-lm"}, "reference": "a", "team": "", "polcy": 1}
    trial = TrialInput.from_json(spec)
    assert trial.unknown == {"polcy": 1} and trial.to_json() == spec
    # sent by a client with Temporal's default converter, read by the worker's: the same spec
    for sender in (DataConverter.default, TRIAL_CONVERTER):
        payloads = sender.payload_converter.to_payloads([trial])
        (read,) = TRIAL_CONVERTER.payload_converter.from_payloads(payloads, [TrialInput])
        assert read.to_json() == spec
