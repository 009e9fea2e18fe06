"""A trial naming a model or version the executors do not hold is refused early and precisely:
before any reservation or load, naming the spec field to fix and what the repository holds.
Real Temporal dev server, real CPU executor (its repository seeded with the built-ins) and ledger."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from temporalio.client import WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError

from tests.trial.stack import Stack
from tests.trial.trial_helpers import QUICK_PERF, connections, ledger_state, run_trial, tiny_spec
from workflows.worker import build_worker

PATHS = [
    {"name": "cpu-eager", "executor": "cpu", "mode": "eager"},
    {"name": "cpu-eager-2", "executor": "cpu", "mode": "eager"},
]


def _scheduled(history: Any) -> list[str]:
    return [
        e.activity_task_scheduled_event_attributes.activity_type.name
        for e in history.events
        if e.HasField("activity_task_scheduled_event_attributes")
    ]


async def _refused(stack: Stack, spec: dict[str, Any]) -> tuple[ApplicationError, WorkflowHandle[Any, Any]]:
    queue = f"q-{uuid.uuid4().hex[:8]}"
    conns = connections(stack)
    try:
        async with build_worker(stack.env.client, conns, task_queue=queue):
            # by type name with the JSON object, as the Temporal UI and CLI start it
            handle = await stack.env.client.start_workflow(
                "TrialWorkflow", spec, id=f"unknown-{uuid.uuid4().hex[:8]}", task_queue=queue
            )
            with pytest.raises(WorkflowFailureError) as err:
                await handle.result()
    finally:
        await conns.close()
    cause = err.value.cause
    assert isinstance(cause, ApplicationError)
    return cause, handle


async def test_an_unknown_model_is_refused_before_any_reservation_or_load(stack: Stack) -> None:
    spec = tiny_spec(PATHS)
    spec["model"] = {"name": "no-such-model"}
    cause, handle = await _refused(stack, spec)
    assert cause.type == "UnknownModel" and cause.non_retryable
    assert cause.details == ({"field": "model.name"},)
    assert "NOT_FOUND: model 'no-such-model' is not in the model repository of cpu" in cause.message
    assert "tiny-lm" in cause.message and "fix model.name" in cause.message  # what it holds, what to fix
    scheduled = _scheduled(await handle.fetch_history())
    # nothing loaded or reserved: only the role check, the trial's record and Describe ran
    assert set(scheduled) == {"authorize_trial", "record_trial", "describe_path"}, scheduled
    state = ledger_state(stack, handle.id)
    assert state["trial"].status == "failed" and not state["reservations"]
    assert not state["trial"].report_json  # nothing half-written: no report of a trial that never ran


async def test_an_unknown_version_of_the_reference_is_refused_naming_the_field(stack: Stack) -> None:
    spec = tiny_spec(PATHS)
    spec["model"] = {"name": "tiny-lm", "version": "v404"}
    cause, handle = await _refused(stack, spec)
    assert cause.type == "UnknownModel" and cause.details == ({"field": "model.version"},)
    assert "model tiny-lm has no version 'v404' on cpu (it has " in cause.message
    assert "fix model.version" in cause.message
    assert "prepare_path" not in _scheduled(await handle.fetch_history())


async def test_an_unknown_version_of_a_candidate_fails_that_path_before_it_prepares(stack: Stack) -> None:
    paths = [*PATHS, {"name": "no-such-version", "executor": "cpu", "mode": "eager", "version": "v999"}]
    report = await run_trial(stack, tiny_spec(paths, performance={**QUICK_PERF, "batch_sizes": [1]}))
    assert report["status"] == "completed"
    missing = report["paths"]["no-such-version"]
    assert missing["errors"]["prepare"].startswith("NOT_FOUND: model tiny-lm has no version 'v999' on cpu")
    assert "fix paths[2].version" in missing["errors"]["prepare"]
    assert "prepare" not in missing["timeline"] and not missing["reservation_id"]  # refused before it
    verdict = report["verdicts"]["no-such-version"]
    assert verdict["verdict"] == "INCONCLUSIVE" and "v999" in verdict["criteria"]["correctness"]["reason"]
    assert report["verdicts"]["cpu-eager-2"]["criteria"]["correctness"]["result"] == "pass"
