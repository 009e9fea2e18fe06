"""A/A trials: the reference's own path as the candidate, judged with the spec's defaults.

Starts a real Temporal dev server, the evaluator, metering (SQLite in a temp dir, a price in
force), a CPU executor in a process of its own (as `switchyard up` runs it) and an
in-process trial worker, then runs RUNS trials per model (mlp,
tiny-lm) of cpu-eager against cpu-eager with the default performance plan and policy: the two
paths share the executor's one loaded instance and are measured in alternating blocks. An
identical path must never be rejected, and its p95 ratio interval should cover 1.0 in at
least 90% of runs (issue 30). With --serial N, N more runs per model measure the two paths one
after the other (`performance.interleave: false`, the method before alternating blocks), in
the same run, so both methods' verdicts and wall times are measured under the same load.

Usage: python benchmarks/bench_aa.py [--runs 10] [--models mlp,tiny-lm] [--serial 0]
Writes out/bench/aa.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from temporalio.testing import WorkflowEnvironment

from benchmarks.common import write_report
from services.evaluator.evaluator_server import start_evaluator
from services.metering.metering_server import start_metering
from switchyard import net, tls
from switchyard.gen.switchyard.v1 import executor_pb2 as xpb
from switchyard.gen.switchyard.v1 import executor_pb2_grpc as xgrpc
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as mgrpc
from switchyard.grpcio import ServerOptions
from workflows.activities.connections import Connections, WorkerConfig
from workflows.spec.trial_io import TrialInput
from workflows.trial import SEARCH_ATTRIBUTES, TrialWorkflow
from workflows.worker import build_worker

ROOT = Path(__file__).resolve().parent.parent
INPUTS = {
    "mlp": {"name": "x", "datatype": "FP32", "shape": [1, 64]},
    "tiny-lm": {"name": "input_ids", "datatype": "INT64", "shape": [1, 32], "high": 512},
}
INTERVAL = re.compile(r"p95 ratio ([0-9.]+) \[([0-9.]+), ([0-9.]+)\]")


def spec(model: str, seed: int, interleave: bool = True) -> dict[str, Any]:
    """Spec defaults except the inputs and the two identical paths (and the method)."""
    out: dict[str, Any] = {
        "model": {"name": model},
        "inputs": {"seed": seed, "tensors": [INPUTS[model]]},
        "paths": [
            {"name": "ref", "executor": "cpu", "mode": "eager"},
            {"name": "same", "executor": "cpu", "mode": "eager"},
        ],
        "reference": "ref",
    }
    if not interleave:
        out["performance"] = {"interleave": False}
    return out


def _row(model: str, i: int, wall: float, report: dict[str, Any], method: str) -> dict[str, Any]:
    verdict = report["verdicts"]["same"]
    latency = verdict["criteria"]["latency"]
    found = INTERVAL.search(latency["reason"])
    ratio, low, high = (float(g) for g in found.groups()) if found else (None, None, None)
    return {
        "model": model,
        "method": method,
        "run": i,
        "wall_s": round(wall, 2),
        "verdict": verdict["verdict"],
        "criteria": {name: c["result"] for name, c in verdict["criteria"].items()},
        "latency": latency["result"],
        "ratio": ratio,
        "low": low,
        "high": high,
        "covers_1": low is not None and high is not None and low <= 1.0 <= high,
        "reason": latency["reason"],
        "memory": verdict["criteria"].get("memory", {}).get("figure", ""),
    }


class ExecutorProcess:
    """The CPU executor as `switchyard up` runs it: a process of its own (`executor serve`), so
    what it reports of its memory (Describe, the memory criterion) is the executor's alone, not
    this process's trial worker and its kept answers (an in-process executor shares them)."""

    def __init__(self, proc: asyncio.subprocess.Process, address: str) -> None:
        self.proc, self.address = proc, address

    @classmethod
    async def start(cls, timeout_s: float = 120.0) -> ExecutorProcess:
        address = f"127.0.0.1:{net.free_port()}"
        argv = [sys.executable, "-m", "clients.cli", "executor", "serve", "--backend", "cpu"]
        argv += ["--host", "127.0.0.1", "--port", address.rsplit(":", 1)[1], "--models", "mlp,tiny-lm"]
        env = {**os.environ, "PYTHONPATH": str(ROOT), tls.INSECURE_ENV: "true"}
        proc = await asyncio.create_subprocess_exec(*argv, env=env, cwd=ROOT)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                async with grpc.aio.insecure_channel(address) as ch:
                    stub = xgrpc.ExecutorControlStub(ch)
                    status = await stub.ModelStatus(xpb.ModelStatusRequest(), timeout=2)
                if status.models and all(m.state == "READY" for m in status.models):
                    return cls(proc, address)
            except grpc.aio.AioRpcError:
                pass
            if proc.returncode is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the executor at {address} did not get ready")
            await asyncio.sleep(0.5)

    async def stop(self, grace_s: float = 0) -> None:
        self.proc.terminate()
        try:
            await asyncio.wait_for(self.proc.wait(), 30)
        except TimeoutError:
            self.proc.kill()


async def _servers(tmp: str) -> tuple[Any, Any, Any]:
    tls.set_default(tls.Security.plaintext())  # by name: this measures verdicts, not TLS
    evaluator = await start_evaluator(ServerOptions(port=0))
    metering = await start_metering(f"sqlite:///{tmp}/ledger.db", ServerOptions(port=0))
    executor = await ExecutorProcess.start()
    async with grpc.aio.insecure_channel(executor.address) as ch:
        d = await xgrpc.ExecutorControlStub(ch).Describe(xpb.DescribeRequest())
    async with grpc.aio.insecure_channel(metering.address) as ch:
        price = mpb.Price(
            price_key=d.price_key, micros_per_hour=3_600_000, currency="USD", effective_from_unix_us=1
        )
        await mgrpc.MeteringStub(ch).SetPrice(mpb.SetPriceRequest(price=price))
    return evaluator, metering, executor


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method and model: runs, REJECTs (any criterion), latency rejects, intervals covering
    1.0, and the median trial wall time."""
    out: dict[str, Any] = {}
    for method, model in sorted({(r["method"], r["model"]) for r in rows}):
        mine = [r for r in rows if r["method"] == method and r["model"] == model]
        out[f"{method}/{model}"] = {
            "runs": len(mine),
            "rejects": sum(r["verdict"] == "REJECT" for r in mine),
            "latency_rejects": sum(r["latency"] == "fail" for r in mine),
            "covers_1": sum(r["covers_1"] for r in mine),
            "latency": {k: sum(r["latency"] == k for r in mine) for k in ("pass", "inconclusive", "fail")},
            "wall_s_median": statistics.median(r["wall_s"] for r in mine),
        }
    return out


async def _trial(env: Any, model: str, i: int, method: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    report = await env.client.execute_workflow(
        TrialWorkflow.run,
        TrialInput.from_json(spec(model, i + 1, interleave=method == "interleaved")),
        id=f"aa-{model}-{method}-{i}-{uuid.uuid4().hex[:6]}",
        task_queue="aa",
    )
    row = _row(model, i, time.perf_counter() - t0, json.loads(json.dumps(report.to_json())), method)
    print(
        f"{method} {model} run {i}: {row['verdict']} {row['criteria']} "
        f"({row['ratio']} [{row['low']}, {row['high']}]), {row['wall_s']} s",
        flush=True,
    )
    return row


@contextlib.asynccontextmanager
async def trial_stack(name: str) -> AsyncIterator[Any]:
    """What a benchmark of whole trials runs on: a Temporal dev server, the services
    (`_servers`) and an in-process worker on task queue `name`; yields the environment, and
    stops everything however the block ends."""
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(ROOT / ".venv" / "bin" / "temporal"),
        search_attributes=SEARCH_ATTRIBUTES,
        dev_server_log_level="error",
    )
    evaluator, metering, executor = await _servers(tempfile.mkdtemp(prefix=f"{name}-bench-"))
    config = WorkerConfig(
        evaluator=evaluator.address, metering=metering.address, executors={"cpu": executor.address}
    )
    connections = Connections(config)
    try:
        async with build_worker(env.client, connections, task_queue=name):
            yield env
    finally:
        await connections.close()
        await executor.stop(0)
        await metering.stop(0)
        await evaluator.drain(0)
        await env.shutdown()


async def main(runs: int, models: list[str], serial: int = 0) -> dict[str, Any]:
    rows = []
    # the methods alternate run by run, so a change of the host's load lands on both alike
    plan = [(m, i, "interleaved") for m in models for i in range(runs)]
    plan += [(m, i, "serial") for m in models for i in range(serial)]
    plan.sort(key=lambda p: (p[0], p[1]))
    async with trial_stack("aa") as env:
        for model, i, method in plan:
            rows.append(await _trial(env, model, i, method))
            partial = {"benchmark": "aa", "partial": True, "summary": _summary(rows), "runs": rows}
            write_report("aa", partial)
    return {
        "benchmark": "aa",
        "configuration": {
            "paths": "cpu-eager vs cpu-eager, one executor (its own process), one loaded instance",
            "methods": "interleaved: alternating blocks (the default); serial: performance.interleave false",
            "spec": "defaults",
        },
        "summary": _summary(rows),
        "runs": rows,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--models", default="mlp,tiny-lm")
    parser.add_argument("--serial", type=int, default=0, help="runs per model measured one after the other")
    args = parser.parse_args()
    result = asyncio.run(main(args.runs, args.models.split(","), args.serial))
    print(json.dumps(result["summary"]))
    write_report("aa", result)
