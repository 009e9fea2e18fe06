"""One trace from the router through the executor and metering, carried in gRPC metadata,
and the control RPCs' spans, made with no server interceptor.

Runs in a child process: a tracer provider is process-global and must not leak into the
other tests. The child starts real metering, a real executor and the router, sends one
request and a few control calls, and prints the finished spans as JSON, with the
interceptors each gRPC server was made with.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import pytest
import pytest_asyncio

from tests.router.conftest import ROOT

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHILD = """
import asyncio, json, pathlib, sys, tempfile
import grpc, numpy as np
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from switchyard import telemetry
exporter = InMemorySpanExporter()
provider = telemetry.setup(telemetry.TelemetryConfig("test", "none"), exporter=exporter)
made = []  # the interceptors of every gRPC server made from here on (the real constructor runs)
real_server = grpc.aio.server
def recording_server(*args, **kwargs):
    made.append(len(kwargs.get("interceptors") or ()))
    return real_server(*args, **kwargs)
grpc.aio.server = recording_server

from services.executor.executor_config import ExecutorConfig
from services.executor.executor_server import start_executor
from services.metering.metering_server import start_metering
from services.router.router_server import start_router
from switchyard.gen.inference import grpc_service_pb2 as pb, grpc_service_pb2_grpc as pbgrpc
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb, metering_pb2_grpc as mgrpc
from switchyard.gen.switchyard.v1 import executor_pb2 as xpb, executor_pb2_grpc as xgrpc
from switchyard.gen.switchyard.v1 import router_pb2 as rpb, router_pb2_grpc as rgrpc
from switchyard.grpcio import ServerOptions
from tests.router.conftest import prepared_ledger_key, routes_config

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"  # a sampled caller's span
UNSAMPLED = "00-0af7651916cd43dd8448eb211c80319d-b7ad6b7169203332-00"

def dump(tag):
    spans = [
        {"name": s.name, "trace": s.context.trace_id, "id": s.context.span_id,
         "parent": s.parent.span_id if s.parent else None, "kind": s.kind.name,
         "status": s.status.status_code.name, "attributes": dict(s.attributes)}
        for s in exporter.get_finished_spans()
    ]
    print(f"{tag} " + json.dumps(spans), flush=True)
    exporter.clear()

async def infer_twice(router, key):
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

async def control_calls(executor, router, key):  # control RPCs, each with a caller's context
    sampled = [("traceparent", PARENT)]
    async with grpc.aio.insecure_channel(executor.address) as ch:
        control = xgrpc.ExecutorControlStub(ch)
        await control.Describe(xpb.DescribeRequest(), metadata=sampled)
        await control.Describe(xpb.DescribeRequest(), metadata=[("traceparent", UNSAMPLED)])
        try:
            await control.Unload(xpb.UnloadRequest(model_name="absent"), metadata=sampled)
        except grpc.aio.AioRpcError as e:
            print("UNLOAD " + json.dumps(e.code().name), flush=True)
    async with grpc.aio.insecure_channel(router.address) as ch:
        auth = [*sampled, ("authorization", f"Bearer {key}")]
        await rgrpc.RouterAdminStub(ch).ListRoutes(rpb.ListRoutesRequest(), metadata=auth)
        await pbgrpc.GRPCInferenceServiceStub(ch).ServerLive(pb.ServerLiveRequest(), metadata=sampled)

async def main() -> None:
    tmp = tempfile.mkdtemp()
    servers = {}
    metering = await start_metering(f"sqlite:///{tmp}/l.db", ServerOptions())
    servers["metering"], made[:] = list(made), []
    executor = await start_executor(ExecutorConfig(models=("mlp",)))
    servers["executor"], made[:] = list(made), []
    key = await prepared_ledger_key(metering.address, "t")
    cfg = routes_config({"a": executor.address}, {"mlp": {"policy": "pinned", "targets": ["a"]}})
    spool = pathlib.Path(tmp) / "spool"
    router = await start_router(cfg, metering.address, ServerOptions(), spool)
    servers["router"] = list(made)
    print("SERVERS " + json.dumps(servers), flush=True)
    exporter.clear()
    await infer_twice(router, key)
    dump("SPANS")
    await control_calls(executor, router, key)
    dump("CONTROL")
    await router.stop(0)  # its spool delivers the denial's audit row
    async with grpc.aio.insecure_channel(metering.address) as ch:
        audit = await mgrpc.MeteringStub(ch).QueryAudit(mpb.QueryAuditRequest(action="request.denied"))
    print("AUDIT " + json.dumps([r.actor.trace_id for r in audit.records]), flush=True)
    await executor.stop(0)
    await metering.stop(0)

asyncio.run(main())
"""


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def child_lines() -> list[str]:
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
    return out.decode().splitlines()


def _printed(lines: list[str], tag: str) -> Any:
    return json.loads(next(ln for ln in lines if ln.startswith(f"{tag} ")).removeprefix(f"{tag} "))


async def test_one_trace_router_executor_metering(child_lines: list[str]) -> None:
    lines = child_lines
    spans = _printed(lines, "SPANS")
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
    (denied_trace,) = _printed(lines, "AUDIT")
    refused = next(r for r in roots if r is not answered)
    assert denied_trace == format(refused["trace"], "032x")  # the audit row names the request's trace
    assert (refused["status"], answered["status"]) == ("ERROR", "UNSET")  # the refusal raised in its span
    assert answered["attributes"]["rpc.method"] == "ModelInfer", answered


async def test_control_rpcs_are_spans_without_a_server_interceptor(child_lines: list[str]) -> None:
    """With tracing on, no server of the chain is made with an interceptor (grpc.aio's poller
    does more per call on a server with any), and a control RPC is still a SERVER span under
    the caller's `traceparent`, with its status; an unsampled caller's call is not recorded."""
    servers = _printed(child_lines, "SERVERS")
    assert set(servers) == {"metering", "executor", "router"} and all(servers.values()), servers
    assert servers == {name: [0] * len(made) for name, made in servers.items()}, servers
    assert _printed(child_lines, "UNLOAD") == "NOT_FOUND"
    spans = _printed(child_lines, "CONTROL")
    parent_trace, parent_span = int("0af7651916cd43dd8448eb211c80319c", 16), int("b7ad6b7169203331", 16)
    by_name = {s["name"]: s for s in spans if s["parent"] == parent_span}
    methods = {
        "/switchyard.v1.ExecutorControl/Describe": 0,
        "/switchyard.v1.ExecutorControl/Unload": 5,  # NOT_FOUND: the caller's fault, status unset
        "/switchyard.v1.RouterAdmin/ListRoutes": 0,
        "/inference.GRPCInferenceService/ServerLive": 0,
    }
    assert set(by_name) == set(methods), spans
    for name, code in methods.items():
        span = by_name[name]
        assert (span["kind"], span["trace"], span["status"]) == ("SERVER", parent_trace, "UNSET"), span
        service, method = name.lstrip("/").split("/")
        attributes = span["attributes"]
        assert (attributes["rpc.service"], attributes["rpc.method"]) == (service, method), span
        assert attributes["rpc.grpc.status_code"] == code and attributes["net.peer.ip"] == "127.0.0.1", span
    # one Describe was recorded: the unsampled caller's decision is kept (parent-based sampling)
    assert [s["name"] for s in spans].count("/switchyard.v1.ExecutorControl/Describe") == 1, spans
