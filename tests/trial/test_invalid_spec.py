"""An invalid spec is rejected at once, as a non-retryable failure that names the field."""

from __future__ import annotations

import argparse
import uuid
from typing import Any

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from clients import trial_commands
from switchyard.grpcio import RunningServer
from workflows.connections import Connections, WorkerConfig
from workflows.worker import build_worker


async def test_invalid_spec_fails_the_workflow_at_once_naming_the_field(
    temporal_env: WorkflowEnvironment, evaluator: RunningServer, capsys: pytest.CaptureFixture[str]
) -> None:
    spec: dict[str, Any] = {
        "model": {"name": "tiny-lm"},
        "inputs": {
            "seed": 1,
            "tensors": [{"name": "input_ids", "datatype": "INT64", "shape": [2, 4], "high": 9}],
        },
        "paths": [
            {"name": "a", "executor": "cpu", "mode": "eager"},
            {"name": "b", "executor": "cpu", "mode": "warp-speed"},
        ],
        "reference": "a",
    }
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
    status = argparse.Namespace(trial_id=workflow_id, temporal=address, namespace="default")
    assert await trial_commands._status(status) == 1
    assert "FAILED: invalid trial spec: paths[1].mode" in capsys.readouterr().out
