"""The router's front doors attacked as an outsider would: real metering (SQLite), a real CPU
executor and a real router with its OpenAI HTTP port, all on port 0.

- An unknown model asked for with no key, or a junk key, over gRPC and HTTP: the refusal names
  no route (another team's route name must not appear), and a narrow key's NOT_FOUND lists
  only the routes its roles cover.
- Admin reads by a key that may infer only `mlp`: ListRoutes shows `mlp` alone,
  ListPrincipalLimits shows no other principal's id, ListDeployments (internal addresses) is
  PERMISSION_DENIED; an admin key still sees everything.
- A malformed bearer token (an OpenAI-style `sk-proj-...` key sent by mistake): the audit row
  holds a short hash of it, never any part of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from sqlalchemy import select

from services.executor.executor_config import ExecutorConfig
from services.executor.executor_server import RunningExecutor, start_executor
from services.metering.schema import AUDIT
from services.router.denials import MAX_LOOKUPS
from services.router.router_server import RunningRouter, start_router
from switchyard import tls
from switchyard.gen.inference import grpc_service_pb2 as ipb
from switchyard.gen.switchyard.v1 import router_pb2 as rpb
from switchyard.gen.switchyard.v1 import router_pb2_grpc as rgrpc
from switchyard.grpcio import ServerOptions
from tests.router.conftest import Metering, RouterFactory, make_router, metering, routes_config

__all__ = ["make_router", "metering"]  # fixtures, used by name

pytestmark = pytest.mark.asyncio(loop_scope="session")

OIP = "inference.GRPCInferenceService"
SECRET_ROUTE = "team-b-private-llm"  # another team's route: its name must never leak


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def executor() -> AsyncIterator[RunningExecutor]:
    running = await start_executor(ExecutorConfig(models=("mlp",)))
    yield running
    await running.stop(0)


async def _router(make_router: RouterFactory, metering: Metering, executor: RunningExecutor) -> RunningRouter:
    routes = {
        "mlp": {"policy": "pinned", "targets": ["a"]},
        SECRET_ROUTE: {"policy": "pinned", "targets": [{"deployment": "a", "model": "mlp"}]},
    }
    cfg = routes_config({"a": executor.address}, routes, openai_port=0, usage_flush_s=0.05)
    running: RunningRouter = await make_router(cfg, metering.running.address)
    return running


def _request(model: str) -> ipb.ModelInferRequest:
    request = ipb.ModelInferRequest(model_name=model, id="probe")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 64])
    tensor.contents.fp32_contents.extend([0.0] * 64)
    return request


async def _grpc(router: RunningRouter, model: str, key: str | None) -> tuple[grpc.StatusCode, str]:
    metadata = (("authorization", f"Bearer {key}"),) if key is not None else ()
    async with grpc.aio.insecure_channel(router.address) as channel:
        infer = channel.unary_unary(
            f"/{OIP}/ModelInfer",
            request_serializer=ipb.ModelInferRequest.SerializeToString,
            response_deserializer=ipb.ModelInferResponse.FromString,
        )
        try:
            await infer(_request(model), metadata=metadata, timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


async def _http(router: RunningRouter, path: str, body: dict[str, Any], key: str | None) -> tuple[int, str]:
    """One raw HTTP/1.1 request, as an attacker's script would send it; (status, body)."""
    assert router.openai is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", router.openai.port)
    payload = json.dumps(body).encode()
    auth = f"authorization: Bearer {key}\r\n" if key is not None else ""
    head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{auth}"
    writer.write(f"{head}content-length: {len(payload)}\r\nconnection: close\r\n\r\n".encode() + payload)
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    status_line, _, rest = raw.decode().partition("\r\n")
    return int(status_line.split()[1]), rest.partition("\r\n\r\n")[2]


async def test_no_key_and_junk_keys_learn_no_route_names(
    make_router: RouterFactory, metering: Metering, executor: RunningExecutor
) -> None:
    router = await _router(make_router, metering, executor)
    for key in (None, "sk_0123456789abcdef.junk", "not-a-key"):
        code, details = await _grpc(router, "nope", key)
        # UNAUTHENTICATED, or RESOURCE_EXHAUSTED once the source is over its refused lookups
        assert code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED), (key, code)
        assert SECRET_ROUTE not in details and "mlp" not in details, details
        chat = {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
        for path, body in (
            ("/v1/completions", {"model": "nope", "prompt": "hi"}),
            ("/v1/chat/completions", chat),
        ):
            status, text = await _http(router, path, body, key)
            assert status in (401, 429), (key, path, status, text)
            assert SECRET_ROUTE not in text and "mlp" not in text, text


async def test_a_narrow_key_sees_only_the_routes_its_roles_cover(
    make_router: RouterFactory, metering: Metering, executor: RunningExecutor
) -> None:
    router = await _router(make_router, metering, executor)
    narrow, _ = await metering.key("front-narrow", "a", "infer", "model:mlp")
    wide, _ = await metering.key("front-wide", "b", "infer", "*")
    code, details = await _grpc(router, "nope", narrow)
    assert code == grpc.StatusCode.NOT_FOUND and "'mlp'" in details, details
    assert SECRET_ROUTE not in details, details
    status, text = await _http(router, "/v1/completions", {"model": "nope", "prompt": "hi"}, narrow)
    assert status == 404 and SECRET_ROUTE not in text, (status, text)
    code, details = await _grpc(router, "nope", wide)  # the check is the roles, not a blanket hide
    assert code == grpc.StatusCode.NOT_FOUND and SECRET_ROUTE in details, details
    code, _ = await _grpc(router, "mlp", narrow)  # the narrow key still works where it may
    assert code == grpc.StatusCode.OK


async def test_a_malformed_token_is_audited_as_a_short_hash(
    make_router: RouterFactory, metering: Metering, executor: RunningExecutor
) -> None:
    router = await _router(make_router, metering, executor)
    secret = "sk-proj-" + "Zq7" * 30  # an OpenAI project key sent to the wrong service
    wellformed = "sk_00112233445566ff.not-the-secret"
    with metering.running.ledger.engines.write.connect() as conn:
        before = int(conn.execute(select(AUDIT.c.seq).order_by(AUDIT.c.seq.desc()).limit(1)).scalar() or 0)
    assert (await _grpc(router, "mlp", secret))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert (await _http(router, "/v1/completions", {"model": "mlp", "prompt": "x"}, secret))[0] == 401
    assert (await _grpc(router, "mlp", wellformed))[0] == grpc.StatusCode.UNAUTHENTICATED
    with metering.running.ledger.engines.write.connect() as conn:
        rows = conn.execute(select(AUDIT).where(AUDIT.c.seq > before)).all()
    denied = [r for r in rows if r.action == "auth.denied"]
    assert len(denied) >= 2, rows
    for row in rows:
        text = " ".join(str(v) for v in row)
        assert secret[8:20] not in text and "sk-proj" not in text, row
        assert "not-the-secret" not in text, row
    resources = {r.resource for r in denied}
    assert any(r.startswith("key/malformed:") and len(r) == len("key/malformed:") + 12 for r in resources)
    assert "key/sk_00112233445566ff" in resources  # a well-formed id is not secret, and is kept


async def test_admin_reads_by_a_narrow_key_show_only_what_it_covers(
    make_router: RouterFactory, metering: Metering, executor: RunningExecutor
) -> None:
    router = await _router(make_router, metering, executor)
    narrow, _ = await metering.key("reads-narrow", "a", "infer", "model:mlp")
    admin_key, _ = await metering.key("reads-admin", "ops", "admin", "*")
    as_narrow = [("authorization", f"Bearer {narrow}")]
    as_admin = [("authorization", f"Bearer {admin_key}")]
    async with grpc.aio.insecure_channel(router.address) as channel:
        admin = rgrpc.RouterAdminStub(channel)
        limit = rpb.PrincipalLimit(principal_id="p_someone_else", rate_per_s=1.0, burst=1)
        await admin.SetPrincipalLimit(rpb.SetPrincipalLimitRequest(limit=limit), metadata=as_admin)
        routes = await admin.ListRoutes(rpb.ListRoutesRequest(), metadata=as_narrow)
        assert [r.model for r in routes.routes] == ["mlp"]
        everything = await admin.ListRoutes(rpb.ListRoutesRequest(), metadata=as_admin)
        assert sorted(r.model for r in everything.routes) == sorted(["mlp", SECRET_ROUTE])
        limits = await admin.ListPrincipalLimits(rpb.ListPrincipalLimitsRequest(), metadata=as_narrow)
        assert "p_someone_else" not in str(limits)
        limits = await admin.ListPrincipalLimits(rpb.ListPrincipalLimitsRequest(), metadata=as_admin)
        assert "p_someone_else" in {o.principal_id for o in limits.overrides}
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await admin.ListDeployments(rpb.ListDeploymentsRequest(), metadata=as_narrow)
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert executor.address not in (denied.value.details() or "")
        listed = await admin.ListDeployments(rpb.ListDeploymentsRequest(), metadata=as_admin)
        assert [d.address for d in listed.deployments] == [executor.address]


def _audit_count(metering: Metering) -> int:
    with metering.running.ledger.engines.write.connect() as conn:
        return len(conn.execute(select(AUDIT.c.seq)).all())


async def test_a_junk_key_flood_is_rate_limited_and_aggregated(
    make_router: RouterFactory, metering: Metering, executor: RunningExecutor
) -> None:
    """40 junk keys from one source: before, 80 audit rows (metering's auth.denied and the
    router's request.denied per request); now at most MAX_LOOKUPS metering rows, the router's
    first row and one row with the window's count. A good key in use keeps working."""
    router = await _router(make_router, metering, executor)
    good, _ = await metering.key("flood-good", "a", "infer", "*")
    assert (await _grpc(router, "mlp", good))[0] == grpc.StatusCode.OK
    before = _audit_count(metering)
    t0 = time.monotonic()
    codes = [(await _grpc(router, "mlp", f"sk_{i:016x}.junk"))[0] for i in range(40)]
    flood_s = time.monotonic() - t0
    assert codes[:MAX_LOOKUPS] == [grpc.StatusCode.UNAUTHENTICATED] * MAX_LOOKUPS, codes
    assert set(codes[MAX_LOOKUPS:]) == {grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert (await _grpc(router, "mlp", good))[0] == grpc.StatusCode.OK  # not held up by the flood
    await router.stop(1)  # closes the window: its count is written
    assert router.router.spool is None or await router.router.spool.drain(5.0)
    deadline = time.monotonic() + 5
    while _audit_count(metering) < before + MAX_LOOKUPS + 2 and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    with metering.running.ledger.engines.write.connect() as conn:
        rows = conn.execute(select(AUDIT).order_by(AUDIT.c.seq)).all()[before:]
    print(f"junk-key flood: 40 requests in {flood_s:.2f} s -> {len(rows)} audit rows (before the fix: 80)")
    assert len(rows) <= MAX_LOOKUPS + 2, [(r.action, r.resource) for r in rows]
    counted = [json.loads(r.detail_json) for r in rows if r.resource.startswith("source/")]
    assert [c["count"] for c in counted] == [40], counted


async def test_slow_http_clients_are_cut_off_and_others_still_served(
    make_router: RouterFactory, metering: Metering, executor: RunningExecutor
) -> None:
    """Slowloris: a head sent a byte at a time, and a body that never ends, are closed after
    their timeouts; connections over the cap are closed at once; a normal client is served."""
    router = await _router(make_router, metering, executor)
    assert router.openai is not None
    router.openai.header_timeout_s = 0.5
    router.openai.body_timeout_s = 0.5
    router.openai.max_connections = 4
    port = router.openai.port
    good, _ = await metering.key("slow-good", "a", "infer", "*")

    async def models() -> int:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET /v1/models HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {good}\r\n\r\n".encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.close()
        return int(head.split()[1])

    async def dribble(first: bytes) -> float:
        """Seconds until the server closes a connection that sends `first`, then a byte per 0.1 s."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        t0 = time.monotonic()
        writer.write(first)
        with contextlib.suppress(ConnectionError):
            while time.monotonic() - t0 < 10:
                writer.write(b"x")
                await writer.drain()
                with contextlib.suppress(TimeoutError):
                    if await asyncio.wait_for(reader.read(65536), 0.1) == b"":
                        break
        writer.close()
        return time.monotonic() - t0

    slow = [
        asyncio.create_task(dribble(b"GET /v1/models HTTP/1.1\r\nx-slow: ")),
        asyncio.create_task(
            dribble(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n")
        ),
    ]
    await asyncio.sleep(0.1)
    assert await models() == 200  # served while two slow clients hold connections
    cut = await asyncio.gather(*slow)
    assert all(0.4 < s < 3.0 for s in cut), cut
    router.openai.header_timeout_s = 5.0  # the cap alone closes connections now
    idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(6)]
    await asyncio.sleep(0.1)
    closed = 0
    for reader, _ in idle:
        with contextlib.suppress(TimeoutError, ConnectionError):
            if await asyncio.wait_for(reader.read(65536), 0.2) is not None:
                closed += 1  # answered 503 or closed at once: over the cap
    assert closed == 2, closed  # the 5th and 6th
    for _, writer in idle:
        writer.close()
    await asyncio.sleep(0.2)  # closed by the clients: their places are free again
    assert await models() == 200


async def test_the_openai_port_serves_tls_when_the_public_grpc_port_does(
    metering: Metering, executor: RunningExecutor, tmp_path: Path
) -> None:
    """A router whose public port has TLS: plaintext HTTP to its OpenAI port gets no HTTP answer,
    HTTPS checked against the CA is served."""
    folder = tls.ensure_local_pki(tmp_path / "pki", ["router"])["router"]
    public = ((folder / "tls.crt").read_bytes(), (folder / "tls.key").read_bytes())
    routes = {"mlp": {"policy": "pinned", "targets": ["a"]}}
    cfg = routes_config({"a": executor.address}, routes, openai_port=0)
    router = await start_router(
        cfg, metering.running.address, ServerOptions(public_tls=public), tmp_path / "s"
    )
    try:
        assert router.openai is not None
        good, _ = await metering.key("tls-good", "a", "infer", "*")
        request = f"GET /v1/models HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {good}\r\n\r\n".encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", router.openai.port)
        writer.write(request)
        with contextlib.suppress(ConnectionError):
            answer = await asyncio.wait_for(reader.read(65536), 5)
            assert not answer.startswith(b"HTTP/1.1 200"), answer  # no plaintext answer
        writer.close()
        context = ssl.create_default_context(cafile=str(folder / "ca.crt"))
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", router.openai.port, ssl=context, server_hostname=tls.service_name(tls.ROUTER)
        )
        writer.write(request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.close()
        assert head.startswith(b"HTTP/1.1 200"), head
    finally:
        await router.stop(0)
