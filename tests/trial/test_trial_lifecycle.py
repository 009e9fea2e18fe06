"""A trial survives its worker being killed mid-performance, and cancel leaves the ledger whole."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import uuid
from typing import Any

import pytest
from temporalio.client import WorkflowHandle

from tests.trial.stack import ROOT, Stack, worker_command
from tests.trial.trial_helpers import ledger_state, tiny_spec, trial_worker
from workflows.spec.trial_io import TrialInput
from workflows.trial import TrialWorkflow

# Long enough that the kill, 1 s after the candidate enters its performance phase, lands in
# the activity: its single-stream and offline scenarios are at least 1 s per path each (4 s
# of blocks for the two), which no host load makes shorter.
LONG_PERF = {
    "warmup": 1,
    "min_iterations": 5,
    "min_seconds": 1.0,
    "batch_sizes": [1],
    "offline_concurrency": 1,
}


async def _wait_for_phase(
    handle: WorkflowHandle[Any, Any], path: str, phase: str, timeout_s: float = 120
) -> None:
    async with asyncio.timeout(timeout_s):
        while True:
            progress = await handle.query(TrialWorkflow.progress)
            state = progress["paths"].get(path, {})
            if state.get("phase") == phase and state.get("status") == "running":
                return
            await asyncio.sleep(0.2)


def _spawn_worker(stack: Stack, queue: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        worker_command(stack, queue), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


async def test_killed_worker_resumes_mid_performance_and_completes(stack: Stack) -> None:
    spec = tiny_spec(
        [
            {"name": "cpu-eager", "executor": "cpu", "mode": "eager"},
            {"name": "cpu-eager-2", "executor": "cpu", "mode": "eager"},
        ],
        performance=LONG_PERF,
        # The kill is seen after heartbeat_s at most. At 3 s, live retries timed out on a busy
        # host too (two spurious attempts, ~20 s lost), while a scenario's end (its jobs
        # recorded, its answers checked) sent no heartbeat; it does now (41febfd), and 6 s
        # leaves room for the gRPC calls between blocks that still send none.
        timeouts={"heartbeat_s": 6, "activity_s": 300, "max_attempts": 5},
    )
    queue = f"kill-{uuid.uuid4().hex[:8]}"
    first = _spawn_worker(stack, queue)
    second = None
    try:
        handle = await stack.env.client.start_workflow(
            TrialWorkflow.run, TrialInput.from_json(spec), id=f"kill-{uuid.uuid4().hex[:8]}", task_queue=queue
        )
        # the two (one loaded instance) are measured together in alternating blocks: once the
        # candidate is in its performance phase too, the one activity measures both
        await _wait_for_phase(handle, "cpu-eager-2", "performance")
        await asyncio.sleep(1.0)  # mid-scenario
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        second = _spawn_worker(stack, queue)
        report = (await asyncio.wait_for(handle.result(), 240)).to_json()
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(20)
    assert report["status"] == "completed"
    assert report["verdicts"]["cpu-eager-2"]["criteria"]["correctness"]["result"] == "pass"
    perf = report["paths"]["cpu-eager"]["performance"]
    assert "scenarios" in perf, report["paths"]["cpu-eager"]  # what ended the phase, if it failed
    assert [s["scenario"] for s in perf["scenarios"]] == ["single-stream", "offline"]
    history = await handle.fetch_history()
    names = {}
    retried = []
    for event in history.events:
        if event.HasField("activity_task_scheduled_event_attributes"):
            names[event.event_id] = event.activity_task_scheduled_event_attributes.activity_type.name
        if event.HasField("activity_task_started_event_attributes"):
            attrs = event.activity_task_started_event_attributes
            if attrs.attempt > 1:
                retried.append(names[attrs.scheduled_event_id])
    assert "measure_interleaved" in retried, retried
    state = ledger_state(stack, report["trial_id"])
    assert all(status == "closed" and cost == lines for _, status, cost, lines in state["reservations"])


@pytest.mark.parametrize("how", ["update", "temporal-cancel"])
async def test_cancel_stops_the_trial_and_leaves_the_ledger_consistent(stack: Stack, how: str) -> None:
    spec = tiny_spec(
        [
            {"name": "cpu-eager", "executor": "cpu", "mode": "eager"},
            {"name": "cpu-eager-2", "executor": "cpu", "mode": "eager"},
        ],
        performance={**LONG_PERF, "min_seconds": 120.0},
    )
    async with trial_worker(stack) as queue:
        handle = await stack.env.client.start_workflow(
            TrialWorkflow.run,
            TrialInput.from_json(spec),
            id=f"cancel-{uuid.uuid4().hex[:8]}",
            task_queue=queue,
        )
        await _wait_for_phase(handle, "cpu-eager", "performance")
        async with asyncio.timeout(60):
            if how == "update":  # the `cancel` update (what `switchyard trial cancel` sends)
                status = await handle.execute_update(TrialWorkflow.cancel, "operator changed their mind")
            else:  # the Temporal UI's Cancel button: a workflow cancellation request
                await handle.cancel()
                status = "cancelled"
            report = (await handle.result()).to_json()
    assert status == "cancelled"
    reason = "operator changed their mind" if how == "update" else "workflow cancellation requested"
    assert report["status"] == "cancelled" and report["cancel_reason"] == reason
    assert report["verdicts"]["cpu-eager-2"]["verdict"] == "INCONCLUSIVE"
    state = ledger_state(stack, report["trial_id"])
    assert state["trial"].status == "cancelled"
    assert "trial.cancel" in state["audit"]
    assert state["reservations"]
    for rid, status_, cost, lines in state["reservations"]:
        assert status_ == "closed", f"{rid} left open"
        assert cost == lines
