"""One trace from the router through the executor and metering, carried in gRPC metadata.

Runs in a child process: a tracer provider is process-global and must not leak into the
other tests. The child starts real metering, a real executor and the router, sends one
request, and prints the finished spans as JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import pytest

from tests.router.conftest import ROOT

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHILD = """
import asyncio, json, pathlib, sys, tempfile
import grpc, numpy as np
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from switchyard import telemetry
exporter = InMemorySpanExporter()
provider = telemetry.setup(telemetry.TelemetryConfig("test", "none"), exporter=exporter)

from services.executor.executor_config import ExecutorConfig
from services.executor.executor_server import start_executor
from services.metering.metering_server import start_metering
from services.router.router_server import start_router
from switchyard.gen.inference import grpc_service_pb2 as pb, grpc_service_pb2_grpc as pbgrpc
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb, metering_pb2_grpc as mgrpc
from switchyard.grpcio import ServerOptions
from tests.router.conftest import prepared_ledger_key, routes_config

async def main() -> None:
    tmp = tempfile.mkdtemp()
    metering = await start_metering(f"sqlite:///{tmp}/l.db", ServerOptions())
    executor = await start_executor(ExecutorConfig(models=("mlp",)))
    key = await prepared_ledger_key(metering.address, "t")
    cfg = routes_config({"a": executor.address}, {"mlp": {"policy": "pinned", "targets": ["a"]}})
    spool = pathlib.Path(tmp) / "spool"
    router = await start_router(cfg, metering.address, ServerOptions(), spool)
    exporter.clear()
    async with grpc.aio.insecure_channel(router.address) as ch:
        req = pb.ModelInferRequest(model_name="mlp")
        req.inputs.add(name="x", datatype="FP32", shape=[1, 64])
        req.raw_input_contents.append(np.zeros((1, 64), np.float32).tobytes())
        auth = [("authorization", f"Bearer {key}")]
        await pbgrpc.GRPCInferenceServiceStub(ch).ModelInfer(req, metadata=auth)
        try:  # refused: the denial's audit row must name this request's trace
            bad = [("authorization", "Bearer nope")]
            await pbgrpc.GRPCInferenceServiceStub(ch).ModelInfer(req, metadata=bad)
        except grpc.aio.AioRpcError:
            pass
    await router.stop(0)
    async with grpc.aio.insecure_channel(metering.address) as ch:
        audit = await mgrpc.MeteringStub(ch).QueryAudit(mpb.QueryAuditRequest(action="request.denied"))
    print("AUDIT " + json.dumps([r.actor.trace_id for r in audit.records]), flush=True)
    await executor.stop(0); await metering.stop(0)
    provider.force_flush()
    spans = [
        {"name": s.name, "trace": s.context.trace_id, "id": s.context.span_id,
         "parent": s.parent.span_id if s.parent else None}
        for s in exporter.get_finished_spans()
    ]
    print("SPANS " + json.dumps(spans), flush=True)

asyncio.run(main())
"""


async def test_one_trace_router_executor_metering() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CHILD,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 180)
    assert proc.returncode == 0, err.decode()[-3000:]
    lines = out.decode().splitlines()
    spans = json.loads(next(ln for ln in lines if ln.startswith("SPANS ")).removeprefix("SPANS "))
    by_id = {s["id"]: s for s in spans}

    def root_of(span: dict[str, Any]) -> dict[str, Any]:
        while span["parent"] is not None:
            span = by_id[span["parent"]]
        return span

    infer = [s for s in spans if s["name"] == "/inference.GRPCInferenceService/ModelInfer"]
    roots = [s for s in infer if s["parent"] is None]
    assert len(roots) == 2, spans  # the router's spans: the caller sent no context
    answered = next(r for r in roots if any(s["parent"] == r["id"] for s in infer))
    executor = [s for s in infer if s["parent"] == answered["id"]]
    assert executor and executor[0]["trace"] == answered["trace"]  # router -> executor
    # router -> metering: the CLIENT span (instrumentation) and metering's SERVER span under it
    auth = [s for s in spans if s["name"] == "/switchyard.v1.Metering/Authenticate"]
    assert len(auth) >= 2 and all(s["trace"] == root_of(s)["trace"] for s in auth)
    assert answered["id"] in {root_of(s)["id"] for s in auth}
    assert not [s for s in spans if "Health" in s["name"]]  # health probes are not traced
    (denied_trace,) = json.loads(next(ln for ln in lines if ln.startswith("AUDIT ")).removeprefix("AUDIT "))
    refused = next(r for r in roots if r is not answered)
    assert denied_trace == format(refused["trace"], "032x")  # the audit row names the request's trace
