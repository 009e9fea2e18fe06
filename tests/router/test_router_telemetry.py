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

import pytest

from tests.router.conftest import ROOT

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHILD = """
import asyncio, json, pathlib, sys, tempfile
import grpc, numpy as np
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from switchyard import telemetry

from opentelemetry.sdk.metrics.export import InMemoryMetricReader
exporter = InMemorySpanExporter()
reader = InMemoryMetricReader()
provider = telemetry.setup(telemetry.TelemetryConfig("test", "none"), exporter=exporter, metric_reader=reader)

from services.executor.config import ExecutorConfig
from services.executor.server import start_executor
from services.metering.server import start_metering
from services.router.server import start_router
from switchyard.gen.inference import grpc_service_pb2 as pb, grpc_service_pb2_grpc as pbgrpc
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb, metering_pb2_grpc as mgrpc
from switchyard.grpcio import ServerOptions
from tests.router.conftest import prepare_ledger, routes_config

async def main() -> None:
    tmp = tempfile.mkdtemp()
    metering = await start_metering(f"sqlite:///{tmp}/l.db", ServerOptions())
    executor = await start_executor(ExecutorConfig(models=("mlp",)))
    async with grpc.aio.insecure_channel(metering.address) as ch:
        stub = mgrpc.MeteringStub(ch)
        await prepare_ledger(stub)
        await stub.CreatePrincipal(mpb.CreatePrincipalRequest(name="t", kind="service", team="t"))
        await stub.GrantRole(mpb.RoleRequest(principal="t", role="infer", scope="*"))
        key = (await stub.CreateKey(mpb.CreateKeyRequest(principal="t"))).key
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
    await router.stop(0); await executor.stop(0); await metering.stop(0)
    provider.force_flush()
    spans = [
        {"name": s.name, "trace": s.context.trace_id, "id": s.context.span_id,
         "parent": s.parent.span_id if s.parent else None}
        for s in exporter.get_finished_spans()
    ]
    print("SPANS " + json.dumps(spans), flush=True)
    names = [m.name for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
             for m in sm.metrics]
    print("METRICS " + json.dumps(names), flush=True)

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
    line = next(ln for ln in out.decode().splitlines() if ln.startswith("SPANS "))
    spans = json.loads(line.removeprefix("SPANS "))
    infer = [s for s in spans if s["name"] == "/inference.GRPCInferenceService/ModelInfer"]
    roots = [s for s in infer if s["parent"] is None]
    assert len(roots) == 1, spans  # the router's span: the caller sent no context
    root = roots[0]
    executor = [s for s in infer if s["parent"] == root["id"]]
    auth = [s for s in spans if s["name"] == "/switchyard.v1.Metering/Authenticate"]
    assert executor and executor[0]["trace"] == root["trace"]  # router -> executor
    assert (
        auth and auth[0]["parent"] == root["id"] and auth[0]["trace"] == root["trace"]
    )  # router -> metering
