"""The router's hop to an executor, alone: a message on a gRPC stream versus in frames.

A server process (uvloop, as services run) answers the same echo two ways: on a grpc.aio
`ModelStreamInfer` stream, and on a frame connection (services.frames, served by the
executor's own FrameServer). Both parse the ModelInferRequest and answer a
ModelStreamInferResponse carrying its tensor bytes back, so both sides do the same protobuf
work; only the transport differs. A second server process does the same on glibc's default
malloc settings, to show what switchyard/allocator.py saves. The first also serves the stream
over gRPC's TLS (C core) and frames over the event loop's TLS, certificates as `switchyard up`
issues them: what mTLS adds to the hop. One client process (uvloop) sends one request at a
time over each, alternating rounds so the machine's drifting load hits all alike, at 1 KB and
1 MiB. Prints round-trip p50/p99 and the ratios, writes out/bench/frames.json.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_frames.py [--rounds 10] [--requests 300]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import grpc

from benchmarks.common import ROOT, write_report
from services import frames
from services.executor.frame_server import FrameServer
from switchyard import net, tls
from switchyard.gen.inference import grpc_service_pb2 as pb
from switchyard.grpcio import run_service
from switchyard.net import free_port

STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
SIZES = {"1KB": 1024, "1MB": 1 << 20}
LIMIT = net.MAX_MESSAGE_BYTES
OPTIONS = net.CHANNEL_OPTIONS


class Echo:
    """The answer both transports give: the request's tensor bytes, back."""

    async def answer(self, request: pb.ModelInferRequest, _: float | None) -> pb.ModelStreamInferResponse:
        response = pb.ModelInferResponse(id=request.id, raw_output_contents=request.raw_input_contents)
        return pb.ModelStreamInferResponse(infer_response=response)


async def serve(grpc_port: int, frame_port: int, tls_dir: str = "", tls_ports: tuple[int, ...] = ()) -> None:
    echo = Echo()

    async def stream(
        requests: AsyncIterator[pb.ModelInferRequest], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        async for request in requests:
            yield await echo.answer(request, None)

    server = grpc.aio.server(options=OPTIONS)
    handler = grpc.stream_stream_rpc_method_handler(
        stream,
        request_deserializer=pb.ModelInferRequest.FromString,
        response_serializer=pb.ModelStreamInferResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "inference.GRPCInferenceService", {"ModelStreamInfer": handler}
            ),
        )
    )
    server.add_insecure_port(f"127.0.0.1:{grpc_port}")
    if tls_dir:  # the same stream over gRPC's TLS (in C), and frames over the loop's TLS
        security = tls.Security.from_dir(tls_dir)
        server.add_secure_port(f"127.0.0.1:{tls_ports[0]}", tls.server_credentials(security))
    await server.start()
    framed = FrameServer(echo, LIMIT, tls.Security.plaintext())  # plaintext: frames cost, not TLS
    await framed.start("127.0.0.1", frame_port)
    if tls_dir:
        await FrameServer(echo, LIMIT, security).start("127.0.0.1", tls_ports[1])
    print("READY", flush=True)
    await server.wait_for_termination()


def _count(requests: int, nbytes: int) -> int:
    """Requests per round: a tenth (at least 20) for messages of 64 KiB and more."""
    return requests if nbytes < 65536 else max(20, requests // 10)


Send = Callable[[bytes], Awaitable[bytes]]


async def connect(
    grpc_port: int, frame_port: int, channels: list[grpc.aio.Channel], connections: list[frames.FrameChannel]
) -> tuple[Send, Send]:
    """(over a stream, in frames) to one server process; what to close goes into the lists."""
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}", options=OPTIONS)
    call: Any = channel.stream_stream(STREAM)()  # bytes in, bytes out, as the router's streams
    connection = await frames.FrameChannel.connect("127.0.0.1", frame_port, LIMIT, 10.0)
    channels.append(channel)
    connections.append(connection)

    async def over_stream(body: bytes) -> bytes:
        await call.write(body)
        return cast(bytes, await call.read())

    async def over_frames(body: bytes) -> bytes:
        return await connection.request((body,), 10.0)

    return over_stream, over_frames


async def _connect_tls(
    ports: tuple[int, ...],
    client: tls.Security,
    channels: list[grpc.aio.Channel],
    connections: list[frames.FrameChannel],
) -> dict[str, Send]:
    """The TLS variants of the first server: a gRPC stream on gRPC's TLS (C core), frames on the
    event loop's TLS."""
    channel = tls.aio_channel(f"127.0.0.1:{ports[0]}", OPTIONS, client, expect=tls.EXECUTOR)
    call: Any = channel.stream_stream(STREAM)()
    channels.append(channel)
    context = tls.client_ssl_context(client)
    out: dict[str, Send] = {}

    async def over_stream(body: bytes) -> bytes:
        await call.write(body)
        return cast(bytes, await call.read())

    out["grpc_stream_tls"] = over_stream
    connection = await frames.FrameChannel.connect(
        "127.0.0.1", ports[1], LIMIT, 10.0, context, tls.service_name(tls.EXECUTOR)
    )
    connections.append(connection)

    async def over_frames(body: bytes) -> bytes:
        return await connection.request((body,), 10.0)

    out["frames_tls"] = over_frames
    return out


async def _start_servers(
    children: list[asyncio.subprocess.Process],
    channels: list[grpc.aio.Channel],
    connections: list[frames.FrameChannel],
) -> dict[str, Send]:
    """Two servers: malloc settings as services run (switchyard/allocator.py), and glibc's
    defaults; each reached over a gRPC stream and over frames."""
    servers = {"": {}, "_glibc_default": {"SWITCHYARD_MALLOC": "default"}}
    transports: dict[str, Send] = {}
    pki = tls.ensure_local_pki(Path(tempfile.mkdtemp(prefix="bench-frames-")), ["executor", "router"])
    tls_ports = tuple(free_port("127.0.0.1") for _ in range(2))
    for suffix, extra in servers.items():
        grpc_port, frame_port = free_port("127.0.0.1"), free_port("127.0.0.1")
        env = {**os.environ, "PYTHONPATH": str(ROOT), **extra}
        serve_args: tuple[str, ...] = ("--serve", str(grpc_port), str(frame_port))
        if not suffix:  # the TLS variants on the server with the services' settings
            serve_args += ("--tls", str(pki["executor"]), *map(str, tls_ports))
        child = await asyncio.create_subprocess_exec(
            sys.executable, __file__, *serve_args, stdout=asyncio.subprocess.PIPE, env=env
        )
        children.append(child)
        assert child.stdout is not None
        line = await asyncio.wait_for(child.stdout.readline(), 60)
        assert line.startswith(b"READY"), line
        over_stream, over_frames = await connect(grpc_port, frame_port, channels, connections)
        transports[f"grpc_stream{suffix}"] = over_stream
        transports[f"frames{suffix}"] = over_frames
        if not suffix:
            client = tls.Security.from_dir(pki["router"])
            transports.update(await _connect_tls(tls_ports, client, channels, connections))
    return transports


async def _samples(transports: dict[str, Send], body: bytes, rounds: int, count: int) -> dict[str, list[int]]:
    """Round-trip nanoseconds per transport, after a warm-up; rounds alternate the order."""
    samples: dict[str, list[int]] = {name: [] for name in transports}
    for send in transports.values():  # warm-up
        for _ in range(20):
            reply = await send(body)
            assert pb.ModelStreamInferResponse.FromString(reply).infer_response.raw_output_contents
    for r in range(rounds):
        order = list(transports) if r % 2 == 0 else list(reversed(transports))
        for name in order:
            send = transports[name]
            for _ in range(count):
                t = time.perf_counter_ns()
                await send(body)
                samples[name].append(time.perf_counter_ns() - t)
    return samples


def _cell(samples: dict[str, list[int]], body: bytes) -> dict[str, Any]:
    cell: dict[str, Any] = {}
    for name, v in samples.items():
        q = statistics.quantiles(v, n=100, method="inclusive")  # as benchmarks/bench_router.py
        cell[name] = {"p50_us": q[49] / 1000, "p99_us": q[98] / 1000, "requests": len(v)}
    cell["frames_over_stream_p50"] = cell["frames"]["p50_us"] / cell["grpc_stream"]["p50_us"]
    cell["frames_over_stream_p99"] = cell["frames"]["p99_us"] / cell["grpc_stream"]["p99_us"]
    for transport in ("grpc_stream", "frames"):  # what glibc's defaults cost
        default = cell[f"{transport}_glibc_default"]["p50_us"]
        cell[f"{transport}_malloc_kept_over_default_p50"] = cell[transport]["p50_us"] / default
    # what TLS adds to each hop's p50 (microseconds), on the same server process
    cell["tls_added_p50_us"] = {
        "frames_tls": cell["frames_tls"]["p50_us"] - cell["frames"]["p50_us"],
        "grpc_stream_tls": cell["grpc_stream_tls"]["p50_us"] - cell["grpc_stream"]["p50_us"],
    }
    cell["message_bytes"] = len(body)
    return cell


def _print_cell(size: str, cell: dict[str, Any], names: list[str]) -> None:
    for name in names:
        c = cell[name]
        print(
            f"{size} {name:26s} round trip p50 {c['p50_us']:8.1f} us  p99 {c['p99_us']:8.1f} us"
            f"  ({c['requests']} requests)",
            flush=True,
        )
    print(
        f"{size} frames / grpc stream: p50 x{cell['frames_over_stream_p50']:.3f}, "
        f"p99 x{cell['frames_over_stream_p99']:.3f}; malloc kept / glibc default at p50: "
        f"stream x{cell['grpc_stream_malloc_kept_over_default_p50']:.3f}, "
        f"frames x{cell['frames_malloc_kept_over_default_p50']:.3f}",
        flush=True,
    )
    added = ", ".join(f"{k} {v:+.1f} us" for k, v in cell["tls_added_p50_us"].items())
    print(f"{size} TLS adds at p50: {added}", flush=True)


async def measure(rounds: int, requests: int) -> dict[str, Any]:
    children: list[asyncio.subprocess.Process] = []
    channels: list[grpc.aio.Channel] = []
    connections: list[frames.FrameChannel] = []
    try:
        transports = await _start_servers(children, channels, connections)
        results: dict[str, Any] = {}
        for size, nbytes in SIZES.items():
            request = pb.ModelInferRequest(model_name="echo", id="r")
            request.inputs.add(name="x", datatype="UINT8", shape=[nbytes])
            request.raw_input_contents.append(os.urandom(nbytes))
            body = request.SerializeToString()
            samples = await _samples(transports, body, rounds, _count(requests, nbytes))
            results[size] = _cell(samples, body)
            _print_cell(size, results[size], list(transports))
        for connection in connections:
            connection.close()
        for channel in channels:
            await channel.close()  # cancels its stream
    finally:
        for child in children:
            child.terminate()
            await child.wait()
    return {
        "benchmark": "frames",
        "configuration": {
            "server": "two processes on uvloop, each serving grpc.aio ModelStreamInfer (EventEngine "
            "default) and a FrameServer, both answering with Echo.answer: one with the malloc "
            "settings services run with (switchyard/allocator.py), one (`*_glibc_default`) with "
            "glibc's defaults (SWITCHYARD_MALLOC=default)",
            "client": "one process on uvloop with the services' malloc settings, one request at a "
            "time; rounds alternate the order",
            "message": "a ModelInferRequest with one UINT8 input of the size named; the reply carries "
            "the same bytes back",
            "rounds": rounds,
            "requests_per_round": {size: _count(requests, n) for size, n in SIZES.items()},
            "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "grpc": grpc.__version__},
        },
        "results": results,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--requests", type=int, default=300, help="per round at 1 KB (a tenth at 1 MiB)")
    parser.add_argument(
        "--serve", nargs=2, type=int, metavar=("GRPC_PORT", "FRAME_PORT"), help=argparse.SUPPRESS
    )
    parser.add_argument("--tls", nargs=3, metavar=("DIR", "GRPC", "FRAMES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        tls_dir, *ports = args.tls or ("",)
        grpc_port, frame_port = args.serve
        run_service(serve(grpc_port, frame_port, tls_dir, tuple(int(p) for p in ports)))
        return 0
    write_report("frames", run_service(measure(args.rounds, args.requests)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
