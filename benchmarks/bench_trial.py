"""Trial orchestration overhead: a trial's wall time against the time its activities ran.

Starts a real Temporal dev server, the evaluator, metering (SQLite in a temp dir), a CPU
executor and an in-process trial worker, then runs a small tiny-lm trial (cpu-eager against
cpu-eager, so the work is identical and short) RUNS times. From each workflow's history it
takes every activity's [started, completed] interval; their union is the critical path (the
activities of one host run one after another; the describe calls that run in parallel
count once). Overhead = wall - critical path: scheduling, workflow tasks, payload transfer.
Target (docs/architecture.md#trials benchmark): overhead <= 10% of the critical path + 2 s.

Usage: python benchmarks/bench_trial.py [--runs 2] [--min-seconds 0.5]
Writes out/bench/trial.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from benchmarks.common import write_report
from services.evaluator.evaluator_server import start_evaluator
from services.executor.executor_config import ExecutorConfig
from services.executor.executor_server import start_executor
from services.metering.metering_server import start_metering
from switchyard import tls
from switchyard.gen.switchyard.v1 import executor_pb2 as xpb
from switchyard.gen.switchyard.v1 import executor_pb2_grpc as xgrpc
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as mgrpc
from switchyard.grpcio import ServerOptions
from tests.trial.trial_helpers import minimal_spec
from workflows.activities.connections import Connections, WorkerConfig
from workflows.spec.trial_io import TrialInput
from workflows.trial import SEARCH_ATTRIBUTES, TrialWorkflow
from workflows.worker import build_worker

ROOT = Path(__file__).resolve().parent.parent


def spec(min_seconds: float) -> dict[str, Any]:
    return {
        **minimal_spec({"ref": "eager", "cand": "eager"}),
        "criteria": {"logits": True},
        "performance": {"warmup": 2, "min_iterations": 10, "min_seconds": min_seconds, "batch_sizes": [1]},
        "training": {"steps": 2, "lr": 0.01, "batch_size": 2},
    }


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


async def activity_intervals(
    client: Client, workflow_id: str
) -> tuple[list[tuple[float, float]], float, int]:
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    started: dict[int, float] = {}
    intervals = []
    events = history.events
    for e in events:
        t = e.event_time.ToDatetime().timestamp()
        if e.HasField("activity_task_started_event_attributes"):
            started[e.activity_task_started_event_attributes.scheduled_event_id] = t
        elif e.HasField("activity_task_completed_event_attributes"):
            intervals.append((started[e.activity_task_completed_event_attributes.scheduled_event_id], t))
    span = events[-1].event_time.ToDatetime().timestamp() - events[0].event_time.ToDatetime().timestamp()
    return intervals, span, len(events)


async def main(runs: int, min_seconds: float) -> dict[str, Any]:
    temporal = ROOT / ".venv" / "bin" / "temporal"
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(temporal),
        search_attributes=SEARCH_ATTRIBUTES,
        dev_server_log_level="error",
    )
    evaluator = await start_evaluator(ServerOptions(port=0))
    tmp = tempfile.mkdtemp(prefix="trial-bench-")
    tls.set_default(tls.Security.plaintext())  # by name: this measures trials, not TLS
    metering = await start_metering(f"sqlite:///{tmp}/ledger.db", ServerOptions(port=0))
    executor = await start_executor(ExecutorConfig(backend="cpu", port=0))
    async with grpc.aio.insecure_channel(executor.address) as ch:
        d = await xgrpc.ExecutorControlStub(ch).Describe(xpb.DescribeRequest())
    async with grpc.aio.insecure_channel(metering.address) as ch:
        await mgrpc.MeteringStub(ch).SetPrice(
            mpb.SetPriceRequest(
                price=mpb.Price(
                    price_key=d.price_key, micros_per_hour=3_600_000, currency="USD", effective_from_unix_us=1
                )
            )
        )
    config = WorkerConfig(
        evaluator=evaluator.address, metering=metering.address, executors={"cpu": executor.address}
    )
    connections = Connections(config)
    results = []
    try:
        async with build_worker(env.client, connections, task_queue="bench"):
            for i in range(runs):
                workflow_id = f"bench-{i}-{uuid.uuid4().hex[:6]}"
                t0 = time.perf_counter()
                await env.client.execute_workflow(
                    TrialWorkflow.run,
                    TrialInput.from_json(spec(min_seconds)),
                    id=workflow_id,
                    task_queue="bench",
                )
                wall = time.perf_counter() - t0
                intervals, span, events = await activity_intervals(env.client, workflow_id)
                critical = _union(intervals)
                overhead = wall - critical
                target = 0.10 * critical + 2.0
                results.append(
                    {
                        "run": i,
                        "wall_s": round(wall, 3),
                        "history_span_s": round(span, 3),
                        "critical_path_s": round(critical, 3),
                        "activity_sum_s": round(sum(b - a for a, b in intervals), 3),
                        "activities": len(intervals),
                        "history_events": events,
                        "overhead_s": round(overhead, 3),
                        "overhead_ratio": round(overhead / critical, 4) if critical else None,
                        "target_s": round(target, 3),
                        "within_target": overhead <= target,
                    }
                )
    finally:
        await connections.close()
        await executor.stop(0)
        await metering.stop(0)
        await evaluator.drain(0)
        await env.shutdown()
    return {
        "benchmark": "trial",
        "configuration": {
            "model": "tiny-lm",
            "inputs": "input_ids INT64 [1, 32]",
            "paths": "cpu-eager (reference) vs cpu-eager, one host (serialised)",
            "performance": {
                "scenarios": ["single-stream", "offline b1"],
                "min_iterations": 10,
                "min_seconds": min_seconds,
            },
            "training_steps": 2,
            "worker": "in-process, dev server local",
        },
        "baseline": "union of activity execution intervals (critical path) from the same run's history",
        "runs": results,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--min-seconds", type=float, default=0.5)
    args = parser.parse_args()
    report = asyncio.run(main(args.runs, args.min_seconds))
    for r in report["runs"]:
        print(
            f"run {r['run']}: wall {r['wall_s']:.2f} s, critical path {r['critical_path_s']:.2f} s "
            f"({r['activities']} activities), overhead {r['overhead_s']:.2f} s = {r['overhead_ratio']:.1%} "
            f"of the critical path; target <= {r['target_s']:.2f} s: "
            f"{'met' if r['within_target'] else 'MISSED'}"
        )
    print(f"configuration: {json.dumps(report['configuration'])}")
    write_report("trial", report)
