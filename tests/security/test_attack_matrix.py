"""The attack matrix: real metering, executor and router servers with mTLS on, called without
credentials, with the wrong service identity, with an identity that is no switchyard service,
and with a revoked key; every metering RPC, executor control, OIP straight to the executor,
and frames. Each gets its status, and each refusal that reaches a server is audited exactly
once with bounded strings. A caller without a certificate (or with one from another CA) never
completes the TLS handshake: UNAVAILABLE, and no RPC runs, so nothing is audited (asserted).
Allowed callers are checked too, so a guard that refused everything would fail here.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import pytest_asyncio
from google.protobuf import message_factory
from sqlalchemy import func, select

from services import frames
from services.executor.executor_config import ExecutorConfig
from services.executor.executor_server import RunningExecutor, start_executor
from services.metering.guard import SERVICE_RPCS
from services.metering.metering_server import RunningMetering, start_metering
from services.metering.schema import AUDIT
from services.router import router_config
from services.router.router_server import start_router
from switchyard import net, tls
from switchyard.gen.inference import grpc_service_pb2 as ipb
from switchyard.gen.switchyard.v1 import executor_pb2 as epb
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as mgrpc
from switchyard.grpcio import ServerOptions
from tests.metering.metering_helpers import price_paths

pytestmark = pytest.mark.asyncio(loop_scope="session")

MAX_AUDIT_ROW = 4096  # characters of all strings of one audit row, at most
BIG = "x" * (1 << 20)  # 1 MiB strings in refused requests: none of it may reach the audit trail
METERING = "switchyard.v1.Metering"
CONTROL = "switchyard.v1.ExecutorControl"
OIP = "inference.GRPCInferenceService"
REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


@dataclass
class Pki:
    ids: dict[str, tls.Security]
    foreign: tls.Security  # a certificate from another CA
    no_cert: tls.Security  # trusts the CA, shows no certificate


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    names = ["metering", "router", "worker", "executor-cpu", "evaluator", "operator", "intruder"]
    folders = tls.ensure_local_pki(root / "cluster", names)
    for folder in folders.values():
        for file in folder.iterdir():
            assert file.stat().st_mode & 0o777 == 0o600, file
    other = tls.ensure_local_pki(root / "other", ["router"])
    ids = {name.split("-")[0]: tls.Security.from_dir(folder) for name, folder in folders.items()}
    assert ids["router"].identity == "spiffe://switchyard/router"
    no_cert = tls.Security(False, ids["router"].ca, b"", b"", "")
    return Pki(ids, tls.Security.from_dir(other["router"]), no_cert)


@dataclass
class Cluster:
    metering: RunningMetering
    executor: RunningExecutor
    revoked_key: str
    admin_key: str
    reader_key: str


def _channel(
    address: str, security: tls.Security, key: str = "", expect: str = tls.METERING
) -> grpc.aio.Channel:
    """To the service `expect` at `address`, as `security` (its certificate checked for `expect`)."""
    if not security.cert:  # TLS without a client certificate
        credentials = grpc.ssl_channel_credentials(root_certificates=security.ca)
        name = [("grpc.ssl_target_name_override", tls.service_name(expect))]
        return grpc.aio.secure_channel(address, credentials, options=name)
    return tls.aio_channel(address, security=security, api_key=key, expect=expect)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def cluster(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    url = f"sqlite:///{tmp_path_factory.mktemp('ledger') / 'ledger.db'}"
    metering = await start_metering(url, ServerOptions(port=0, security=pki.ids["metering"]))
    async with _channel(metering.address, pki.ids["operator"]) as channel:
        stub = mgrpc.MeteringStub(channel)
        keys = {}
        for name, role in (
            ("mallory", "admin"),
            ("alice", "admin"),
            ("reader", "ledger:read"),
            ("user", "infer"),
        ):
            await stub.CreatePrincipal(mpb.CreatePrincipalRequest(name=name, kind="user", team="t"))
            await stub.GrantRole(mpb.RoleRequest(principal=name, role=role, scope="*"))
            created = await stub.CreateKey(mpb.CreateKeyRequest(principal=name))
            keys[name] = (created.key, created.key_id)
        await stub.RevokeKey(mpb.RevokeKeyRequest(key_id=keys["mallory"][1]))
        await price_paths(stub, "cpu-test", ["cpu-a"], resource_class="cpu-test", since_us=0)
    executor = await start_executor(
        ExecutorConfig(models=("mlp",), metering=metering.address), security=pki.ids["executor"]
    )
    yield Cluster(metering, executor, keys["mallory"][0], keys["alice"][0], keys["reader"][0])
    await executor.stop(0)
    await metering.stop(0)


def audit_seq(metering: RunningMetering) -> int:
    with metering.ledger.engines.write.connect() as conn:
        return int(conn.execute(select(func.coalesce(func.max(AUDIT.c.seq), 0))).scalar_one())


def rows_after(metering: RunningMetering, seq: int) -> list[Any]:
    """The rows after `seq` that callers caused: not metering's own `audit.anchor` row, which
    its first anchor round appends whenever that round falls (10 s after start)."""
    query = select(AUDIT).where(AUDIT.c.seq > seq, AUDIT.c.action != "audit.anchor").order_by(AUDIT.c.seq)
    with metering.ledger.engines.write.connect() as conn:
        return list(conn.execute(query).all())


def row_size(row: Any) -> int:
    return sum(
        len(getattr(row, c))
        for c in ("principal", "source", "request_id", "action", "resource", "detail_json")
    )


async def wait_rows(metering: RunningMetering, seq: int, count: int, timeout_s: float = 5.0) -> list[Any]:
    """Rows after `seq` once there are `count` (audits sent in the background), then a little
    longer to see that no more arrive."""
    deadline = time.monotonic() + timeout_s
    # polling: the rows come from another task's RPC, with no event to wait on here
    while len(rows_after(metering, seq)) < count and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)
    return rows_after(metering, seq)


# ---- requests for every RPC ---------------------------------------------------------------------


def _methods(file_descriptor: Any, service: str) -> list[Any]:
    return list(file_descriptor.services_by_name[service.rsplit(".", 1)[-1]].methods)


def metering_request(name: str, cls: type[Any]) -> Any:
    request = cls()
    if name == "AppendAudit":
        request.action, request.outcome, request.resource = "usage.forged", "ok", BIG
    if name == "Authenticate":
        request.key = "sk_" + BIG
    if "actor" in cls.DESCRIPTOR.fields_by_name:
        request.actor.principal = BIG
        request.actor.source = BIG
    if name == "RecordUsage":
        request.events.add(idempotency_key="forged", path="cpu-a", kind="request", status="completed")
    return request


async def call(channel: grpc.aio.Channel, service: str, method: Any, request: Any) -> grpc.StatusCode:
    """The status of one call of `method` (any streaming kind), OK when it succeeds."""
    path = f"/{service}/{method.name}"
    out = message_factory.GetMessageClass(method.output_type)
    ser, de = type(request).SerializeToString, out.FromString
    try:
        if method.client_streaming:
            stream = channel.stream_stream(path, request_serializer=ser, response_deserializer=de)(timeout=10)
            await stream.write(request)
            await stream.done_writing()
            async for reply in stream:
                if isinstance(reply, ipb.ModelStreamInferResponse) and reply.error_message:
                    return grpc.StatusCode[reply.error_message.split(":", 1)[0]]
        elif method.server_streaming:
            async for _ in channel.unary_stream(path, request_serializer=ser, response_deserializer=de)(
                request, timeout=10
            ):
                pass
        else:
            await channel.unary_unary(path, request_serializer=ser, response_deserializer=de)(
                request, timeout=10
            )
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def request_for(method: Any) -> Any:
    cls = message_factory.GetMessageClass(method.input_type)
    return metering_request(method.name, cls)


def mlp_request() -> ipb.ModelInferRequest:
    x = np.ones((1, 64), dtype=np.float32)
    req = ipb.ModelInferRequest(model_name="mlp")
    req.inputs.add(name="x", datatype="FP32", shape=[1, 64])
    req.raw_input_contents.append(x.tobytes())
    return req


def executor_request(method: Any) -> Any:
    if method.name in ("ModelInfer", "ModelStreamInfer"):
        return mlp_request()
    cls = message_factory.GetMessageClass(method.input_type)
    request: Any = cls()
    if "name" in cls.DESCRIPTOR.fields_by_name and method.name != "LoadModel":
        request.name = "mlp"
    if method.name == "Unload":
        request.model_name = "not-loaded"
    return request


METERING_METHODS = _methods(mpb.DESCRIPTOR, METERING)
CONTROL_METHODS = _methods(epb.DESCRIPTOR, CONTROL)
OIP_METHODS = _methods(ipb.DESCRIPTOR, OIP)


# ---- metering -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("who", "key", "expected"),
    [
        ("intruder", "", grpc.StatusCode.UNAUTHENTICATED),  # a CA certificate, but no switchyard service
        ("evaluator", "revoked", grpc.StatusCode.UNAUTHENTICATED),  # a revoked admin key
        ("executor", "", grpc.StatusCode.PERMISSION_DENIED),  # the wrong service identity
    ],
)
async def test_every_metering_rpc_refuses_and_audits_once(
    cluster: Cluster, pki: Pki, who: str, key: str, expected: grpc.StatusCode
) -> None:
    metering = cluster.metering
    bearer = cluster.revoked_key if key == "revoked" else ""
    async with _channel(metering.address, pki.ids[who], bearer) as channel:
        for method in METERING_METHODS:
            before = audit_seq(metering)
            status = await call(channel, METERING, method, request_for(method))
            assert status == expected, f"{who} {method.name}: {status}"
            rows = rows_after(metering, before)
            assert len(rows) == 1, f"{who} {method.name}: {len(rows)} audit rows"
            row = rows[0]
            assert row.outcome == "denied" and row.action in ("rpc.denied", "auth.denied")
            assert row_size(row) <= MAX_AUDIT_ROW, f"{method.name}: {row_size(row)} characters audited"
            if row.action == "rpc.denied":
                assert row.principal == pki.ids[who].identity  # the certificate, not what the caller said
                assert row.resource == f"/{METERING}/{method.name}"
    assert metering.ledger.audit.verify().ok


@pytest.mark.parametrize("who", ["no_cert", "foreign", "plaintext"])
async def test_metering_without_credentials_never_gets_a_call_through(
    cluster: Cluster, pki: Pki, who: str
) -> None:
    metering = cluster.metering
    before = audit_seq(metering)
    security = {"no_cert": pki.no_cert, "foreign": pki.foreign, "plaintext": tls.Security.plaintext()}[who]
    async with _channel(metering.address, security) as channel:
        for method in METERING_METHODS:
            status = await call(channel, METERING, method, request_for(method))
            assert status == grpc.StatusCode.UNAVAILABLE, f"{who} {method.name}: {status}"
    assert rows_after(metering, before) == []  # the handshake refused it: no RPC ran


async def test_metering_admits_each_rpc_for_the_identities_allowed(cluster: Cluster, pki: Pki) -> None:
    """Service certificates get what SERVICE_RPCS says, keys what their roles say; the rest of
    each is refused. Allowed calls may still fail on their (empty) arguments, never on identity."""
    metering = cluster.metering
    callers = {
        "router": (pki.ids["router"], ""),
        "worker": (pki.ids["worker"], ""),
        "operator": (pki.ids["operator"], ""),
        "admin key": (pki.ids["evaluator"], cluster.admin_key),
        "reader key": (pki.ids["evaluator"], cluster.reader_key),
    }
    reads = {
        "GetJobCost",
        "CostReport",
        "Export",
        "GetTrialReport",
        "ListRouteChanges",
        "ListLimitChanges",
        "QueryAudit",
        "VerifyAudit",
        "ListPaths",
    }
    admin = {
        "CreatePrincipal",
        "CreateKey",
        "RevokeKey",
        "GrantRole",
        "RevokeRole",
        "SetPrice",
        "ReverseUsage",
    }
    allowed_by_key = {  # Authorize: any valid key may ask which roles it holds
        "admin key": admin
        | reads
        | {"RegisterPath", "SaveRouteChange", "SaveLimitChange", "RecordTrial", "Authorize"},
        "reader key": reads | {"Authorize"},
    }
    for label, (security, key) in callers.items():
        async with _channel(metering.address, security, key) as channel:
            for method in METERING_METHODS:
                name = method.name
                if name in ("RevokeKey", "CreateKey") and label == "operator":
                    continue  # done above, with real arguments
                request = request_for(method)
                if "actor" in type(request).DESCRIPTOR.fields_by_name:
                    request.actor.principal, request.actor.source = "on-behalf", "test"
                if name == "AppendAudit":
                    request.resource = "r"
                if name == "Authenticate":
                    request.key = cluster.reader_key
                status = await call(channel, METERING, method, request)
                service = label if label in SERVICE_RPCS else "evaluator"
                permitted = name in SERVICE_RPCS[service] or name in allowed_by_key.get(label, set())
                if service == "evaluator" and name == "AppendAudit":
                    permitted = False  # only its own refusals, and this is not one
                if permitted:
                    assert status not in REFUSED, f"{label} {name}: {status}"
                else:
                    assert status in REFUSED, f"{label} {name}: {status}"
    # the actor of an admitted write is the authenticated identity; the named one is on behalf
    rows = metering.ledger.audit.query("price.set", "", 0, 0, 10)
    assert any(r.actor.principal == "spiffe://switchyard/operator" for r in rows)
    forged = [r for r in metering.ledger.audit.query("usage.forged", "", 0, 0, 10)]
    assert forged and all(r.actor.principal.startswith("spiffe://switchyard/") for r in forged)
    assert all('"on_behalf_of":"on-behalf"' in r.detail_json for r in forged)


# ---- executor: control, OIP, frames -------------------------------------------------------------


@pytest.mark.parametrize(
    ("who", "key", "expected"),
    [
        ("intruder", "", grpc.StatusCode.UNAUTHENTICATED),
        ("intruder", "revoked", grpc.StatusCode.UNAUTHENTICATED),  # a key is no identity here
        ("evaluator", "", grpc.StatusCode.PERMISSION_DENIED),
        ("metering", "", grpc.StatusCode.PERMISSION_DENIED),
    ],
)
async def test_executor_control_and_oip_refuse_and_audit_once(
    cluster: Cluster, pki: Pki, who: str, key: str, expected: grpc.StatusCode
) -> None:
    metering, executor = cluster.metering, cluster.executor
    bearer = cluster.revoked_key if key == "revoked" else ""
    before = audit_seq(metering)
    calls = [(CONTROL, m) for m in CONTROL_METHODS] + [(OIP, m) for m in OIP_METHODS]
    async with _channel(executor.address, pki.ids[who], bearer, tls.EXECUTOR) as channel:
        for service, method in calls:
            status = await call(channel, service, method, executor_request(method))
            assert status == expected, f"{who} {method.name}: {status}"
    rows = await wait_rows(metering, before, len(calls))
    assert sorted(r.resource for r in rows) == sorted(f"/{s}/{m.name}" for s, m in calls)  # once each
    # written by the executor (the identity metering authenticated), naming the refused caller
    assert all(r.action == "rpc.denied" and r.principal == pki.ids["executor"].identity for r in rows)
    assert all(json.loads(r.detail_json)["caller"] == pki.ids[who].identity for r in rows)
    assert all(row_size(r) <= MAX_AUDIT_ROW for r in rows)
    assert "mlp" in {name for name, _ in executor.executor.models}  # nothing was unloaded


async def test_executor_without_credentials_never_gets_a_call_through(cluster: Cluster, pki: Pki) -> None:
    before = audit_seq(cluster.metering)
    for security in (pki.no_cert, pki.foreign, tls.Security.plaintext()):
        async with _channel(cluster.executor.address, security, expect=tls.EXECUTOR) as channel:
            for method in CONTROL_METHODS[:2] + OIP_METHODS[:2]:
                service = CONTROL if method in CONTROL_METHODS else OIP
                assert (
                    await call(channel, service, method, executor_request(method))
                    == grpc.StatusCode.UNAVAILABLE
                )
    await asyncio.sleep(0.3)
    assert rows_after(cluster.metering, before) == []


async def test_executor_admits_router_worker_and_operator_reads(cluster: Cluster, pki: Pki) -> None:
    executor = cluster.executor
    before = audit_seq(cluster.metering)
    for who in ("router", "worker"):
        async with _channel(executor.address, pki.ids[who], expect=tls.EXECUTOR) as channel:
            for method in OIP_METHODS:
                status = await call(channel, OIP, method, executor_request(method))
                assert status == grpc.StatusCode.OK, f"{who} {method.name}: {status}"
            for name in ("Describe", "ModelStatus", "GetLoad"):
                method = next(m for m in CONTROL_METHODS if m.name == name)
                assert await call(channel, CONTROL, method, executor_request(method)) == grpc.StatusCode.OK
    async with _channel(executor.address, pki.ids["operator"], expect=tls.EXECUTOR) as channel:
        for method in CONTROL_METHODS:
            status = await call(channel, CONTROL, method, executor_request(method))
            if method.name in ("Describe", "ModelStatus", "GetLoad"):
                assert status == grpc.StatusCode.OK
            else:
                assert status == grpc.StatusCode.PERMISSION_DENIED, method.name
    rows = await wait_rows(cluster.metering, before, 3)
    assert sorted(r.resource.rsplit("/", 1)[-1] for r in rows) == ["LoadModel", "Train", "Unload"]


async def _frames(cluster: Cluster, security: tls.Security) -> frames.FrameChannel:
    assert cluster.executor.frames is not None
    context = (
        tls.client_ssl_context(security)
        if security.cert
        else ssl.create_default_context(cadata=security.ca.decode())
    )
    return await frames.FrameChannel.connect(
        "127.0.0.1",
        cluster.executor.frames.port,
        net.MAX_MESSAGE_BYTES,
        5.0,
        context,
        tls.service_name(tls.EXECUTOR),
    )


async def test_frames_refuse_other_identities_audited_once_per_connection(cluster: Cluster, pki: Pki) -> None:
    metering = cluster.metering
    before = audit_seq(metering)
    for who, status in (("evaluator", "PERMISSION_DENIED"), ("intruder", "UNAUTHENTICATED")):
        channel = await _frames(cluster, pki.ids[who])
        reply = ipb.ModelStreamInferResponse.FromString(
            await channel.request([mlp_request().SerializeToString()], 5.0)
        )
        assert reply.error_message.startswith(f"{status}: "), reply.error_message
        with pytest.raises(frames.FrameClosed):  # and the connection is closed
            for _ in range(50):
                await channel.request([mlp_request().SerializeToString()], 5.0)
                await asyncio.sleep(0.02)
        channel.close()
    rows = await wait_rows(metering, before, 2)
    assert [(json.loads(r.detail_json)["caller"], r.resource) for r in rows] == [
        (pki.ids["evaluator"].identity, "frames"),
        (pki.ids["intruder"].identity, "frames"),
    ]
    assert all(row_size(r) <= MAX_AUDIT_ROW for r in rows)
    for security in (pki.no_cert, pki.foreign):  # the handshake fails: no request is ever read
        with pytest.raises((OSError, frames.FrameClosed)):
            channel = await _frames(cluster, security)
            await channel.request([mlp_request().SerializeToString()], 5.0)
    await asyncio.sleep(0.3)
    assert len(rows_after(metering, before)) == 2
    router = await _frames(cluster, pki.ids["router"])
    try:
        reply = ipb.ModelStreamInferResponse.FromString(
            await router.request([mlp_request().SerializeToString()], 5.0)
        )
    finally:
        router.close()
    assert not reply.error_message and reply.infer_response.model_name == "mlp"


# ---- the router's hops, all over mTLS -----------------------------------------------------------


async def test_router_serves_over_mtls_hops_and_meters(cluster: Cluster, pki: Pki, tmp_path: Path) -> None:
    """Client -> router (public port, API key) -> metering (Authenticate, RecordUsage) and
    -> executor (frames over TLS), each hop with the router's certificate."""
    cfg = router_config.parse(
        {
            "router": {"fleet": "mtls", "usage_flush_s": 0.05},
            "deployments": {"cpu": {"address": cluster.executor.address, "path": "cpu-a"}},
            "routes": {"mlp": {"policy": "pinned", "targets": ["cpu"]}},
        }
    )
    async with _channel(cluster.metering.address, pki.ids["operator"]) as channel:
        created = await mgrpc.MeteringStub(channel).CreateKey(mpb.CreateKeyRequest(principal="user"))
    router = await start_router(cfg, cluster.metering.address, ServerOptions(), tmp_path, pki.ids["router"])
    try:
        assert router.router.pool.transport("cpu") == "frames"
        async with grpc.aio.insecure_channel(router.address) as channel:
            infer = channel.unary_unary(
                f"/{OIP}/ModelInfer",
                request_serializer=ipb.ModelInferRequest.SerializeToString,
                response_deserializer=ipb.ModelInferResponse.FromString,
            )
            reply = await infer(
                mlp_request(), metadata=(("authorization", f"Bearer {created.key}"),), timeout=10
            )
        request_id = reply.parameters["request_id"].string_param
    finally:
        await router.stop(1)
    lines = [r for r in cluster.metering.ledger.export("csv", 0, 0)]
    assert request_id and any(request_id.encode() in chunk for chunk in lines)


async def test_local_pki_is_private_and_kept(tmp_path: Path) -> None:
    first = tls.ensure_local_pki(tmp_path / "tls", ["router", "executor-cpu"])
    cert = (first["router"] / tls.CERT_FILE).read_bytes()
    again = tls.ensure_local_pki(tmp_path / "tls", ["router", "executor-cpu", "worker"])
    assert (again["router"] / tls.CERT_FILE).read_bytes() == cert  # issued once, kept
    assert tls.Security.from_dir(again["executor-cpu"]).identity == "spiffe://switchyard/executor"
    for path in (tmp_path / "tls").rglob("*"):
        assert path.stat().st_mode & 0o777 == (0o700 if path.is_dir() else 0o600), path
    with pytest.raises(Exception, match="SWITCHYARD_SECURITY_INSECURE"):
        tls.current({})


async def test_probe_port_answers_health_in_plaintext_and_nothing_else(pki: Pki) -> None:
    """The kubelet's gRPC probes show no certificate: a plaintext port with health only."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.evaluator.evaluator_server import start_evaluator
    from switchyard.gen.switchyard.v1 import evaluator_pb2 as evpb

    server = await start_evaluator(ServerOptions(port=0, security=pki.ids["evaluator"], health_port=0))
    try:
        assert server.health_port > 0
        probe = f"127.0.0.1:{server.health_port}"
        async with grpc.aio.insecure_channel(probe) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            compare = next(
                m for m in _methods(evpb.DESCRIPTOR, "switchyard.v1.Evaluator") if m.name == "Compare"
            )
            request = message_factory.GetMessageClass(compare.input_type)()
            assert (
                await call(channel, "switchyard.v1.Evaluator", compare, request)
                == grpc.StatusCode.UNIMPLEMENTED
            )
        async with grpc.aio.insecure_channel(server.address) as channel:  # the service port: mTLS only
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        async with _channel(
            server.address, pki.ids["executor"], expect=tls.EVALUATOR
        ) as channel:  # wrong identity
            assert (
                await call(channel, "switchyard.v1.Evaluator", compare, request)
                == grpc.StatusCode.PERMISSION_DENIED
            )
    finally:
        await server.drain(0)
    assert server.health_server is None
