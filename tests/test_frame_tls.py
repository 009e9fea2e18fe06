"""Frames over the event loop's TLS, on either loop: large frames, write backpressure and the
executor's in-flight bound hold; mutual TLS is required, so a peer without the cluster's
certificate, with one from another CA or in plaintext is refused, and the router refuses an
executor whose certificate another CA issued."""

from __future__ import annotations

import asyncio
import os
import ssl
from pathlib import Path
from typing import Any

import pytest
import uvloop

from services import frames
from services.executor.frame_server import FrameServer
from switchyard import tls
from switchyard.gen.inference import grpc_service_pb2 as pb

EXECUTOR = tls.service_name(tls.EXECUTOR)  # the name a client checks in an executor's certificate


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tls.Security]:
    root: Path = tmp_path_factory.mktemp("pki")
    folders = tls.ensure_local_pki(root, ["executor-cpu", "router"])
    other = tls.ensure_local_pki(root / "other", ["executor-cpu", "router"])  # another CA
    ids = {name.split("-")[0]: tls.Security.from_dir(folder) for name, folder in folders.items()}
    ids.update({f"foreign-{name.split('-')[0]}": tls.Security.from_dir(f) for name, f in other.items()})
    return ids


class _Echo:
    """Each request's tensor bytes back, in its reply; replies come back out of order."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.most_in_flight = 0
        self.gate: asyncio.Event | None = None

    async def answer(self, request: pb.ModelInferRequest, _: float | None) -> pb.ModelStreamInferResponse:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.gate is not None:
                await self.gate.wait()
            await asyncio.sleep(0.001 * (len(request.id) % 3))
            response = pb.ModelInferResponse(id=request.id, raw_output_contents=request.raw_input_contents)
            return pb.ModelStreamInferResponse(infer_response=response)
        finally:
            self.in_flight -= 1


def _request(i: int, size: int) -> bytes:
    request = pb.ModelInferRequest(id=f"r{i}" + "x" * (i % 3))
    request.raw_input_contents.append(os.urandom(size))
    return request.SerializeToString()


def _reply(raw: bytes) -> pb.ModelInferResponse:
    return pb.ModelStreamInferResponse.FromString(raw).infer_response


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_frames_over_tls_carry_small_and_large_frames_on_either_loop(
    pki: dict[str, tls.Security], loop: str
) -> None:
    async def scenario() -> None:
        server = FrameServer(_Echo(), 64 << 20, pki["executor"])
        port = await server.start("127.0.0.1", 0)
        context = tls.client_ssl_context(pki["router"])
        channel = await frames.FrameChannel.connect("127.0.0.1", port, 64 << 20, 5.0, context, EXECUTOR)
        try:
            sizes = [0, 1, 1024, 70_000, 1 << 20, 3 << 20] * 3
            bodies = [_request(i, size) for i, size in enumerate(sizes)]
            # in three pieces, as the router sends them: joined under frames.JOIN_UNDER, not above
            pieces = [[b[: len(b) // 3], b[len(b) // 3 : len(b) // 2], b[len(b) // 2 :]] for b in bodies]
            replies = await asyncio.gather(*(channel.request(parts, 20.0) for parts in pieces))
            for body, raw in zip(bodies, replies, strict=True):
                sent = pb.ModelInferRequest.FromString(body)
                got = _reply(raw)
                assert got.id == sent.id
                assert got.raw_output_contents == sent.raw_input_contents
            assert channel.is_open
        finally:
            channel.close()
            await server.close()

    runner = uvloop.run if loop == "uvloop" else asyncio.run
    runner(scenario())


def test_the_executor_bound_on_in_flight_holds_over_tls(pki: dict[str, tls.Security]) -> None:
    """At max_in_flight the executor stops reading the TLS socket; it resumes when answers go."""

    async def scenario() -> int:
        echo = _Echo()
        echo.gate = asyncio.Event()
        server = FrameServer(echo, 1 << 20, pki["executor"], max_in_flight=3)
        port = await server.start("127.0.0.1", 0)
        channel = await frames.FrameChannel.connect(
            "127.0.0.1", port, 1 << 20, 5.0, tls.client_ssl_context(pki["router"]), EXECUTOR
        )
        try:
            calls = [asyncio.ensure_future(channel.request([_request(i, 512)], 20.0)) for i in range(40)]
            await asyncio.sleep(0.3)
            assert echo.in_flight == 3  # the rest wait in the socket, not in the executor
            echo.gate.set()
            replies = await asyncio.gather(*calls)
            assert [_reply(r).id for r in replies] == [f"r{i}" + "x" * (i % 3) for i in range(40)]
            return echo.most_in_flight
        finally:
            channel.close()
            await server.close()

    assert asyncio.run(scenario()) == 3


def test_a_slow_reader_holds_the_writer_back_and_loses_nothing(pki: dict[str, tls.Security]) -> None:
    """Replies far larger than the socket buffers: the TLS transport pauses its protocol at
    its high-water mark and resumes it once the reader drains it (what FrameServer relies on
    to stop reading while its replies are not taken)."""

    async def scenario() -> None:
        received = bytearray()
        paused: list[bool] = []

        class Sink(asyncio.Protocol):
            def data_received(self, data: bytes) -> None:
                received.extend(data)

        class Source(asyncio.Protocol):
            def connection_made(self, transport: Any) -> None:
                self.transport = transport

            def pause_writing(self) -> None:
                paused.append(True)

            def resume_writing(self) -> None:
                paused.append(False)

        sources: list[Source] = []
        connected = asyncio.Event()

        def source() -> Source:
            sources.append(Source())
            connected.set()
            return sources[-1]

        loop = asyncio.get_running_loop()
        server = await loop.create_server(source, "127.0.0.1", 0, ssl=tls.server_ssl_context(pki["executor"]))
        port = server.sockets[0].getsockname()[1]
        transport, _ = await loop.create_connection(
            Sink, "127.0.0.1", port, ssl=tls.client_ssl_context(pki["router"]), server_hostname=EXECUTOR
        )
        try:
            await asyncio.wait_for(connected.wait(), 5)
            transport.pause_reading()
            blob = os.urandom(6 << 20)
            writer = sources[0].transport
            for start in range(0, len(blob), 1 << 20):
                writer.write(blob[start : start + (1 << 20)])
            assert paused == [True]  # over the high-water mark while nobody reads
            await asyncio.sleep(0.2)
            transport.resume_reading()
            for _ in range(500):
                if len(received) == len(blob):
                    break
                await asyncio.sleep(0.01)
            assert bytes(received) == blob
            assert paused == [True, False]
            assert writer.get_write_buffer_size() == 0
        finally:
            transport.close()
            server.close()
            await server.wait_closed()

    asyncio.run(scenario())


def test_a_peer_without_a_certificate_fails_the_handshake(pki: dict[str, tls.Security]) -> None:
    async def scenario() -> None:
        server = FrameServer(_Echo(), 1 << 20, pki["executor"])
        port = await server.start("127.0.0.1", 0)
        no_cert = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # trusts the cluster's CA, shows nothing
        no_cert.load_verify_locations(cadata=pki["router"].ca.decode())
        try:
            with pytest.raises((ssl.SSLError, OSError, frames.FrameClosed)):
                channel = await frames.FrameChannel.connect(
                    "127.0.0.1", port, 1 << 20, 5.0, no_cert, EXECUTOR
                )
                await channel.request([_request(1, 10)], 5.0)  # TLS 1.3: refused after the handshake
            assert not server.connections
        finally:
            await server.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("who", ["foreign", "plaintext"])
def test_a_peer_from_another_ca_or_in_plaintext_is_refused(pki: dict[str, tls.Security], who: str) -> None:
    """No request from either reaches the executor: the handshake fails, the connection closes."""

    async def scenario() -> None:
        echo = _Echo()
        server = FrameServer(echo, 1 << 20, pki["executor"])
        port = await server.start("127.0.0.1", 0)
        context = None if who == "plaintext" else tls.client_ssl_context(pki["foreign-router"])
        try:
            with pytest.raises((ssl.SSLError, OSError, frames.FrameClosed)):
                channel = await frames.FrameChannel.connect(
                    "127.0.0.1", port, 1 << 20, 5.0, context, EXECUTOR
                )
                await channel.request([_request(1, 10)], 5.0)
            assert echo.most_in_flight == 0
            await asyncio.sleep(0.1)
            assert not server.connections
        finally:
            await server.close()

    asyncio.run(scenario())


def test_the_router_refuses_an_executor_certified_by_another_ca(pki: dict[str, tls.Security]) -> None:
    async def scenario() -> None:
        echo = _Echo()
        server = FrameServer(echo, 1 << 20, pki["foreign-executor"])
        port = await server.start("127.0.0.1", 0)
        try:
            with pytest.raises(ssl.SSLCertVerificationError):
                await frames.FrameChannel.connect(
                    "127.0.0.1", port, 1 << 20, 5.0, tls.client_ssl_context(pki["router"]), EXECUTOR
                )
            assert echo.most_in_flight == 0
        finally:
            await server.close()

    asyncio.run(scenario())
