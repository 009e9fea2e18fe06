"""Identity both ways (issue 31, point 3): an impostor holding another service's certificate.

The certificate is genuine, from the cluster's CA: one service's key has leaked (an executor
running a factory's code, say) and the attacker serves with it where another service is
dialed. Each client must refuse the handshake: the router's metering client (which would hand
over a user's bearer key and believe a forged `admin`), the router's executor transport over
gRPC and over frames, and the trial worker's clients. The impostor records every call that
reaches it; with the right certificate (the control) the same impostor is reached, so each
refusal is the identity check's, not the harness's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from services.executor.frame_server import FrameServer
from services.router import router_config
from services.router.executor_pool import ExecutorPool
from services.router.metering_client import MeteringClient
from switchyard import errors, tls
from switchyard.gen.inference import grpc_service_pb2 as pb
from switchyard.gen.switchyard.v1 import evaluator_pb2, executor_pb2
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
from workflows.activities.connections import Connections, WorkerConfig

USER_KEY = "sk_0123456789abcdef.a-users-secret"
HEALTH = "/grpc.health.v1.Health/Check"
DESCRIBE = "/switchyard.v1.ExecutorControl/Describe"
AUTHENTICATE = "/switchyard.v1.Metering/Authenticate"


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tls.Security]:
    names = ["metering", "router", "worker", "executor-cpu", "evaluator", "operator"]
    folders = tls.ensure_local_pki(tmp_path_factory.mktemp("pki"), names)
    return {name.split("-")[0]: tls.Security.from_dir(folder) for name, folder in folders.items()}


@dataclass
class Impostor:
    """A gRPC server on a stolen certificate: records each call (method, the caller's
    metadata, the request's bytes) and answers with a forged reply where it has one, else
    UNIMPLEMENTED."""

    answers: dict[str, bytes]
    calls: list[tuple[str, dict[str, str], bytes]] = field(default_factory=list)

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any]:
        method = details.method
        metadata = {k: str(v) for k, v in details.invocation_metadata}

        async def answer(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
            first = [body async for body in requests][:1]  # a unary call sends one
            self.calls.append((method, metadata, first[0] if first else b""))
            if method not in self.answers:
                await context.abort(grpc.StatusCode.UNIMPLEMENTED, "an impostor")
            yield self.answers[method]

        return grpc.stream_stream_rpc_method_handler(answer)

    def methods(self) -> list[str]:
        return [m for m, _, _ in self.calls]


async def _serve(stolen: tls.Security, answers: dict[str, bytes]) -> tuple[Impostor, grpc.aio.Server, str]:
    impostor = Impostor(answers)
    handler = type("Handler", (grpc.GenericRpcHandler,), {"service": lambda _, d: impostor.service(d)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([handler()])
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials(stolen))
    await server.start()
    return impostor, server, f"127.0.0.1:{port}"


def _others(service: str) -> list[str]:
    return [s for s in tls.SERVICES if s != service]


def test_each_certificate_names_one_service_and_no_address(ids: dict[str, tls.Security]) -> None:
    """No name two services share: only the identity's URI and its own DNS name."""
    from cryptography import x509

    for name, security in ids.items():
        cert = x509.load_pem_x509_certificate(security.cert)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert sans.get_values_for_type(x509.DNSName) == [f"{name}.switchyard.internal"]
        assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [f"spiffe://switchyard/{name}"]
        assert sans.get_values_for_type(x509.IPAddress) == []


def test_a_certificate_issued_without_its_name_is_issued_again(tmp_path: Path) -> None:
    """A state directory from before services had names gets named certificates."""
    folder = tls.ensure_local_pki(tmp_path, ["metering"])["metering"]
    unnamed = (tmp_path / "ca" / tls.CA_FILE).read_bytes()  # a certificate with no DNS name
    (folder / tls.CERT_FILE).write_bytes(unnamed)
    tls.ensure_local_pki(tmp_path, ["metering"])
    reissued = (folder / tls.CERT_FILE).read_bytes()
    assert reissued != unnamed
    assert tls.Security.from_dir(folder).identity == "spiffe://switchyard/metering"


def _forged_admin() -> bytes:
    principal = mpb.Principal(principal_id="p-forged", name="mallory", team="t")
    role = mpb.RoleBinding(role="admin", scope="*")
    return mpb.AuthenticateResponse(principal=principal, key_id="k", roles=[role]).SerializeToString()


@pytest.mark.parametrize("stolen", _others("metering"))
async def test_the_routers_metering_client_refuses_an_impostor(
    ids: dict[str, tls.Security], stolen: str
) -> None:
    """The issue's attack: a fake metering on the executor's (or any other) certificate gets
    no bearer key, and its forged admin is not believed."""
    impostor, server, address = await _serve(ids[stolen], {AUTHENTICATE: _forged_admin()})
    client = MeteringClient(address, security=ids["router"])
    try:
        with pytest.raises(errors.SwitchyardError) as refused:
            await client.authenticate(USER_KEY)
        assert refused.value.status == errors.Status.UNAVAILABLE
        assert impostor.calls == []  # the key never left the router
    finally:
        await client.close()
        await server.stop(0)


async def test_the_routers_metering_client_reaches_metering_on_its_own_certificate(
    ids: dict[str, tls.Security],
) -> None:
    """The control: the same forged server on metering's certificate is believed, so the
    refusals above are the name check's (that is why a leaked metering key must be revoked)."""
    impostor, server, address = await _serve(ids["metering"], {AUTHENTICATE: _forged_admin()})
    client = MeteringClient(address, security=ids["router"])
    try:
        identity = await client.authenticate(USER_KEY)
        assert identity.roles == (("admin", "*"),)
        assert mpb.AuthenticateRequest.FromString(impostor.calls[0][2]).key == USER_KEY
    finally:
        await client.close()
        await server.stop(0)


def _pool(address: str, router: tls.Security) -> ExecutorPool:
    cfg = router_config.parse(
        {
            "router": {"executor_transport": "frames", "health_timeout_s": 2.0},
            "deployments": {"cpu": {"address": address}},
            "routes": {"mlp": {"policy": "pinned", "targets": ["cpu"]}},
        }
    )
    return ExecutorPool(cfg.deployments, cfg.settings, router)


def _infer_body() -> bytes:
    request = pb.ModelInferRequest(model_name="mlp", id="r1")
    return request.SerializeToString()


def _executor_answers(frames_port: int = 0) -> dict[str, bytes]:
    serving = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
    described = executor_pb2.DescribeResponse(frames_port=frames_port)
    return {HEALTH: serving.SerializeToString(), DESCRIBE: described.SerializeToString()}


@pytest.mark.parametrize("stolen", ["metering", "evaluator", "worker"])
async def test_the_routers_executor_transport_refuses_an_impostor(
    ids: dict[str, tls.Security], stolen: str
) -> None:
    impostor, server, address = await _serve(ids[stolen], _executor_answers())
    pool = _pool(address, ids["router"])
    try:
        await pool.start()
        assert not pool.states["cpu"].admitted()  # its health check never completed
        with pytest.raises(errors.UpstreamError) as refused:
            await pool.send_tensor("cpu", [_infer_body()], 2.0)
        assert refused.value.status == errors.Status.UNAVAILABLE
        assert impostor.calls == []
    finally:
        await pool.close()
        await server.stop(0)


async def test_the_routers_executor_transport_reaches_an_executor_certificate(
    ids: dict[str, tls.Security],
) -> None:
    """The control: on an executor's certificate the same server is probed and admitted."""
    impostor, server, address = await _serve(ids["executor"], _executor_answers())
    pool = _pool(address, ids["router"])
    try:
        await pool.start()
        assert pool.states["cpu"].admitted()
        assert HEALTH in impostor.methods()
    finally:
        await pool.close()
        await server.stop(0)


class _Answers:
    """A frame server's model: counts the requests that reach it."""

    def __init__(self) -> None:
        self.requests = 0

    async def answer(self, request: pb.ModelInferRequest, _: float | None) -> pb.ModelStreamInferResponse:
        self.requests += 1
        return pb.ModelStreamInferResponse(
            infer_response=pb.ModelInferResponse(model_name="mlp", id=request.id)
        )


@pytest.mark.parametrize("stolen", ["metering", "executor"])
async def test_the_routers_frames_refuse_an_impostor_frame_port(
    ids: dict[str, tls.Security], stolen: str
) -> None:
    """The executor's gRPC port is genuine and its Describe names a frame port; the router
    opens frames only where the port proves it is an executor (the control: `executor`)."""
    model = _Answers()
    frame_server = FrameServer(model, 1 << 20, ids[stolen])
    frame_port = await frame_server.start("127.0.0.1", 0)
    _, server, address = await _serve(ids["executor"], _executor_answers(frame_port))
    pool = _pool(address, ids["router"])
    try:
        await pool.start()
        assert pool.states["cpu"].admitted()
        if stolen == "executor":
            assert pool.transport("cpu") == "frames"
            await pool.send_tensor("cpu", [_infer_body()], 5.0)
            assert model.requests == 1
        else:
            assert pool.transport("cpu") == "grpc"  # streams, on the genuine gRPC port
            await asyncio.sleep(0.1)
            assert model.requests == 0 and not frame_server.connections
    finally:
        await pool.close()
        await frame_server.close()
        await server.stop(0)


def _worker_calls(conns: Connections) -> dict[str, Callable[[], Any]]:
    """One call per client the worker holds, by the service it means to reach."""
    return {
        "executor": lambda: conns.control("cpu").Describe(executor_pb2.DescribeRequest(), timeout=5),
        "executor-oip": lambda: conns.oip("cpu").ServerLive(pb.ServerLiveRequest(), timeout=5),
        "evaluator": lambda: conns.evaluator().Compare(evaluator_pb2.CompareRequest(), timeout=5),
        "metering": lambda: conns.metering().VerifyGrant(mpb.VerifyGrantRequest(), timeout=5),
    }


@pytest.mark.parametrize("client", ["executor", "executor-oip", "evaluator", "metering"])
async def test_the_workers_clients_refuse_an_impostor(ids: dict[str, tls.Security], client: str) -> None:
    """Each of the worker's clients, against a server on every other service's certificate
    (refused, nothing reaches it) and on the one it means (reached: the control)."""
    meant = client.split("-")[0]
    for holder in [*_others(meant), meant]:
        impostor, server, address = await _serve(ids[holder], {})
        config = WorkerConfig(evaluator=address, metering=address, executors={"cpu": address})
        conns = Connections(config, ids["worker"])
        try:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _worker_calls(conns)[client]()
            if holder == meant:
                assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED  # the impostor's answer
                assert len(impostor.calls) == 1
            else:
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, holder
                assert impostor.calls == [], holder
        finally:
            await conns.close()
            await server.stop(0)
