"""Building small trial specs, running them on a worker, capturing a workload for them, and
reading the ledger back."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import sqlalchemy as sa

from services.router import router_config
from services.router.router_server import start_router
from switchyard.gen.switchyard.v1 import executor_pb2 as xpb
from switchyard.gen.switchyard.v1 import executor_pb2_grpc as xgrpc
from switchyard.grpcio import ServerOptions
from switchyard.judge.capture_format import list_workloads
from tests.trial.stack import Stack
from workflows.activities.connections import Connections, WorkerConfig
from workflows.spec.trial_io import TrialInput
from workflows.trial import TrialWorkflow
from workflows.worker import build_worker

TINY_INPUTS = {
    "seed": 1234,
    "tensors": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 32], "high": 512}],
}
QUICK_PERF = {
    "warmup": 2,
    "min_iterations": 10,
    "min_seconds": 0.3,
    "batch_sizes": [1, 4],
    "offline_concurrency": 2,
}


def minimal_spec(
    modes: dict[str, str], seed: int = 1, shape: tuple[int, int] = (1, 32), high: int | None = 512
) -> dict[str, Any]:
    """The least a tiny-lm trial spec says: its `input_ids` tensor and one cpu path per
    name -> mode, the first the reference; everything else is left to the documented defaults."""
    tensor: dict[str, Any] = {"name": "input_ids", "datatype": "INT64", "shape": list(shape)}
    if high is not None:
        tensor["high"] = high
    return {
        "model": {"name": "tiny-lm"},
        "inputs": {"seed": seed, "tensors": [tensor]},
        "paths": [{"name": name, "executor": "cpu", "mode": mode} for name, mode in modes.items()],
        "reference": next(iter(modes)),
    }


def tiny_spec(paths: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"name": "tiny-lm"},
        "inputs": copy.deepcopy(TINY_INPUTS),
        "paths": paths,
        "reference": paths[0]["name"],
        "criteria": {"logits": True},
        "performance": dict(QUICK_PERF),
        "timeouts": {"heartbeat_s": 10, "activity_s": 600, "max_attempts": 3},
        "team": "test",
    }
    spec.update(extra)
    return spec


def connections(stack: Stack) -> Connections:
    return Connections(
        WorkerConfig(evaluator=stack.evaluator, metering=stack.metering, executors=stack.executors())
    )


@contextlib.asynccontextmanager
async def trial_worker(stack: Stack, config: WorkerConfig | None = None) -> AsyncIterator[str]:
    """A trial worker on the stack's Temporal, with the stack's services (or `config`'s), on a
    fresh task queue: yields the queue's name; closes the worker's connections afterwards."""
    queue = f"q-{uuid.uuid4().hex[:8]}"
    conns = connections(stack) if config is None else Connections(config)
    try:
        async with build_worker(stack.env.client, conns, task_queue=queue):
            yield queue
    finally:
        await conns.close()


async def run_trial(
    stack: Stack, spec: dict[str, Any], prefix: str = "trial", config: WorkerConfig | None = None
) -> dict[str, Any]:
    async with trial_worker(stack, config) as queue:
        result = await stack.env.client.execute_workflow(
            TrialWorkflow.run,
            TrialInput.from_json(spec),
            id=f"{prefix}-{uuid.uuid4().hex[:8]}",
            task_queue=queue,
        )
    return result.to_json()  # the report, as the ledger stores it


async def captured_workload(
    stack: Stack,
    model: str,
    path: str,
    send: Callable[[str], object],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> dict[str, Any]:
    """The workload a router writes that captures all of `model`'s traffic to the stack's cpu
    executor (deployment path `path`) while `send(router address)` runs in a thread, the model
    loaded first; SWITCHYARD_WORKLOADS_DIR points at it for the rest of the test."""
    async with grpc.aio.insecure_channel(stack.cpu) as channel:
        await xgrpc.ExecutorControlStub(channel).LoadModel(
            xpb.LoadModelRequest(model_name=model), timeout=300
        )
    workloads = tmp_path / "workloads"
    cfg = router_config.parse(
        {
            "router": {
                "require_auth": False,
                "fleet": f"{path}-{uuid.uuid4().hex[:8]}",
                "workloads_dir": str(workloads),
            },
            "deployments": {"cpu": {"address": stack.cpu, "path": path}},
            "routes": {model: {"policy": "pinned", "targets": ["cpu"], "capture": {"share": 1.0}}},
        }
    )
    router = await start_router(cfg, "", ServerOptions(), tmp_path / "spool")
    try:
        await asyncio.to_thread(send, router.address)
    finally:
        await router.stop(0)  # closes the capture into a workload
    (workload,) = list_workloads(workloads)
    monkeypatch.setenv("SWITCHYARD_WORKLOADS_DIR", str(workloads))
    return workload


def ledger_state(stack: Stack, trial_id: str) -> dict[str, Any]:
    """Reservations of the trial with their line totals, read straight from the ledger file."""
    engine = sa.create_engine(stack.database_url)
    try:
        with engine.connect() as conn:
            reservations = conn.execute(
                sa.text("SELECT reservation_id, state, cost_micros FROM reservations WHERE trial_id = :t"),
                {"t": trial_id},
            ).all()
            lines = {
                r.reservation_id: conn.execute(
                    sa.text(
                        "SELECT COALESCE(SUM(amount_micros), 0) FROM ledger_lines WHERE reservation_id = :r"
                    ),
                    {"r": r.reservation_id},
                ).scalar_one()
                for r in reservations
            }
            trial = conn.execute(
                sa.text("SELECT status, report_json, verdicts_json FROM trials WHERE trial_id = :t"),
                {"t": trial_id},
            ).first()
            audit = [
                row.action
                for row in conn.execute(
                    sa.text("SELECT action FROM audit_log WHERE resource = :r ORDER BY seq"),
                    {"r": f"trial/{trial_id}"},
                )
            ]
    finally:
        engine.dispose()
    return {
        "reservations": [
            (r.reservation_id, r.state, r.cost_micros, lines[r.reservation_id]) for r in reservations
        ],
        "trial": trial,
        "audit": audit,
    }
