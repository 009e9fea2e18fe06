"""Framing (services.frames): frames survive any split of the byte stream; oversized ones are
skipped without being buffered; the router finds the executor's host in its gRPC target."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
import uvloop

from services import frames
from services.executor.frame_server import FrameServer
from services.router.executor_pool import frames_host
from switchyard.gen.inference import grpc_service_pb2 as pb


def _frame(number: int, payload: bytes, kind: int = frames.REQUEST) -> bytes:
    return frames.header(len(payload), number, kind) + payload


def _stream() -> tuple[bytes, list[frames.Frame]]:
    rng = random.Random(7)
    sent = [(n, frames.REQUEST, rng.randbytes(rng.choice((0, 1, 9, 300, 70_000)))) for n in range(1, 40)]
    sent.append((40, frames.CANCEL, b""))
    return b"".join(_frame(n, p, k) for n, k, p in sent), list(sent)


def test_every_split_of_the_stream_gives_the_same_frames() -> None:
    data, sent = _stream()
    assert frames.FrameReader(1 << 20).feed(data) == sent  # all at once
    small = _frame(5, b"abc") + _frame(6, b"") + _frame(7, b"0123456789")
    for cut in range(len(small) + 1):  # every cut point of a short stream
        reader = frames.FrameReader(100)
        assert reader.feed(small[:cut]) + reader.feed(small[cut:]) == [
            (5, frames.REQUEST, b"abc"),
            (6, frames.REQUEST, b""),
            (7, frames.REQUEST, b"0123456789"),
        ]
    rng = random.Random(3)
    reader = frames.FrameReader(1 << 20)
    got: list[frames.Frame] = []
    pos = 0
    while pos < len(data):  # random chunk sizes, as a socket delivers them
        step = rng.randint(1, 65_536)
        got += reader.feed(data[pos : pos + step])
        pos += step
    assert got == sent


def test_an_oversized_frame_is_reported_and_skipped_not_buffered() -> None:
    big = _frame(2, b"x" * 5000)
    data = _frame(1, b"ok") + big + _frame(3, b"after")
    for chunk in (len(data), 7, 1000):
        reader = frames.FrameReader(4096)
        got: list[frames.Frame] = []
        for i in range(0, len(data), chunk):
            got += reader.feed(data[i : i + chunk])
            assert sum(map(len, reader._pieces)) <= 4096  # never holds the big payload
        assert got == [(1, frames.REQUEST, b"ok"), (2, frames.REQUEST, None), (3, frames.REQUEST, b"after")]


@pytest.mark.parametrize(
    ("address", "host"),
    [
        ("127.0.0.1:8101", "127.0.0.1"),
        ("executor-cpu:8101", "executor-cpu"),
        ("dns:///executor-cpu:8101", "executor-cpu"),
        ("[::1]:8101", "::1"),
        ("unix:/run/executor.sock", None),
        ("ipv4:10.0.0.1:8101,10.0.0.2:8101", None),
        ("executor-cpu", None),
    ],
)
def test_the_frame_host_comes_from_the_grpc_target(address: str, host: str | None) -> None:
    assert frames_host(address) == host


class _Echo:
    """Answers each request with an empty response carrying its id: the frame server's
    protocol work is under test here, not a model."""

    async def answer(
        self, request: pb.ModelInferRequest, time_remaining: float | None
    ) -> pb.ModelStreamInferResponse:
        await asyncio.sleep(0.001 * (len(request.id) % 3))  # replies come back out of order
        return pb.ModelStreamInferResponse(infer_response=pb.ModelInferResponse(id=request.id))


class _Written:
    """What a frame write hands the transport (the choice under test is `frames.send`'s)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[bytes]]] = []

    def write(self, data: bytes) -> None:
        self.calls.append(("write", [data]))

    def writelines(self, pieces: Any) -> None:
        self.calls.append(("writelines", list(pieces)))


def test_a_small_frame_goes_to_tls_as_one_piece_and_to_plaintext_as_given() -> None:
    small = [frames.header(6, 1, frames.REQUEST), b"abc", b"def"]
    large = [frames.header(frames.JOIN_UNDER, 2, frames.REQUEST), bytes(frames.JOIN_UNDER)]
    for pieces, tls, expected in [
        (small, True, ("write", [b"".join(small)])),  # one TLS record, not three
        (small, False, ("writelines", small)),  # one system call either way, no copy
        (large, True, ("writelines", large)),  # records are 16 KiB anyway: no copy of a large one
    ]:
        written = _Written()
        frames.send(written, pieces, tls)  # type: ignore[arg-type]
        assert written.calls == [expected]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_both_ends_on_either_event_loop(loop: str) -> None:
    """Services run on uvloop (switchyard.grpcio.run_service), tests on asyncio's loop: the
    router's and the executor's ends must work on both."""

    async def scenario() -> list[str]:
        server = FrameServer(_Echo(), limit=1 << 20)
        port = await server.start("127.0.0.1", 0)
        channel = await frames.FrameChannel.connect("127.0.0.1", port, 1 << 20, 5.0)
        try:
            assert channel.is_open
            replies = await asyncio.gather(
                *(
                    channel.request([pb.ModelInferRequest(id="r" * i).SerializeToString()], 5.0)
                    for i in range(1, 30)
                )
            )
        finally:
            channel.close()
            await server.close()
        return [pb.ModelStreamInferResponse.FromString(r).infer_response.id for r in replies]

    runner = uvloop.run if loop == "uvloop" else asyncio.run
    assert runner(scenario()) == ["r" * i for i in range(1, 30)]


def test_a_request_past_its_time_is_cancelled_on_the_executor() -> None:
    cancelled = asyncio.Event()

    class Slow:
        async def answer(self, request: pb.ModelInferRequest, _: float | None) -> Any:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.set()
                raise

    async def scenario() -> None:
        server = FrameServer(Slow(), limit=1 << 20)
        channel = await frames.FrameChannel.connect(
            "127.0.0.1", await server.start("127.0.0.1", 0), 1 << 20, 5.0
        )
        try:
            with pytest.raises(frames.FrameTimeout):
                await channel.request([b""], 0.05)
            await asyncio.wait_for(cancelled.wait(), 5)  # the CANCEL frame reached the executor
            assert channel.is_open
        finally:
            channel.close()
            await server.close()

    asyncio.run(scenario())


def test_a_peer_that_does_not_speak_frames_fails_what_is_pending() -> None:
    async def scenario() -> str:
        async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readexactly(frames.HEADER.size)
            writer.write(frames.header(0, 1, frames.REQUEST))  # a request, where a reply belongs
            await writer.drain()
            await reader.read()

        server = await asyncio.start_server(impostor, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        channel = await frames.FrameChannel.connect("127.0.0.1", port, 1 << 20, 5.0)
        try:
            with pytest.raises(frames.FrameClosed) as closed:
                await channel.request([b""], 5.0)
            assert not channel.is_open
            return str(closed.value)
        finally:
            channel.close()
            server.close()

    assert asyncio.run(scenario()) == "the executor sent a frame of kind 1, not a reply"
