"""Time-ordered request ids (UUIDv7), the service event loop (uvloop unless told otherwise) and
the router's gRPC transport setting."""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from services.router import ids
from switchyard import transport
from switchyard.errors import InvalidArgument
from switchyard.grpcio import run_service


def test_uuid7_carries_version_variant_and_the_current_millisecond() -> None:
    before = time.time_ns() // 1_000_000
    u = uuid.UUID(hex=ids.time_ordered_hex())
    after = time.time_ns() // 1_000_000
    assert u.version == 7
    assert u.variant == uuid.RFC_4122
    assert before <= u.int >> 80 <= after


def test_time_ordered_ids_sort_by_creation_across_milliseconds_and_never_repeat() -> None:
    made = []
    for _ in range(5):
        made += [ids.time_ordered_hex() for _ in range(2000)]
        time.sleep(0.002)
    assert len(set(made)) == len(made)
    assert all(len(x) == 32 for x in made) and set("".join(made)) <= set("0123456789abcdef")
    # ids of different milliseconds compare in creation order (within one they are random)
    stamps = [int(x[:12], 16) for x in made]
    assert stamps == sorted(stamps)
    assert stamps[-1] > stamps[0]


def test_a_forked_child_does_not_repeat_its_parents_ids() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, then out without running the test session's exit
        os.write(write, ids.time_ordered_hex().encode())
        os._exit(0)
    os.close(write)
    parent = ids.time_ordered_hex()
    os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    os.close(read)
    assert len(child) == 32 and child[12:] != parent[12:]


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_services_run_on_uvloop_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SWITCHYARD_LOOP", raising=False)
    assert run_service(_loop_module()).startswith("uvloop")


def test_switchyard_loop_asyncio_runs_the_standard_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHYARD_LOOP", "asyncio")
    assert run_service(_loop_module()).startswith("asyncio")


def test_an_unknown_loop_name_is_refused_with_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHYARD_LOOP", "trio")
    coro = _loop_module()
    with pytest.raises(InvalidArgument, match=r"SWITCHYARD_LOOP=.trio.: use uvloop .* or asyncio"):
        run_service(coro)
    assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED  # not left un-awaited


def _transport_in_child(env: dict[str, str], first: str = "") -> tuple[str, str]:
    code = f"{first}\nfrom switchyard import transport; import os\ntransport.prefer_low_latency()\n"
    code += "print(os.environ.get('GRPC_EXPERIMENTS', '<unset>'))"
    env = {**env, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip(), out.stderr


def test_the_router_transport_turns_event_engine_endpoints_off_unless_told_otherwise() -> None:
    base = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    assert _transport_in_child(base)[0] == transport.LOW_LATENCY_EXPERIMENTS
    # the operator's choice wins, even an empty one (gRPC's defaults)
    assert _transport_in_child({**base, "GRPC_EXPERIMENTS": "-event_engine_dns"})[0] == "-event_engine_dns"
    assert _transport_in_child({**base, "GRPC_EXPERIMENTS": ""})[0] == ""
    # too late once grpc is imported: left alone, and the log says so
    value, log = _transport_in_child(base, first="import logging, grpc; logging.basicConfig()")
    assert value == "<unset>"
    assert "grpc was imported before the transport was chosen" in log


def test_executor_serve_chooses_the_low_latency_transport_before_grpc_loads() -> None:
    # the real CLI, stopped by a bad metrics port: it fails after the transport is chosen
    code = "import os\nfrom clients import cli\ntry:\n    cli.main(['executor', 'serve'])\n"
    code += "except ValueError as exc:\n    print(exc)\nprint(os.environ.get('GRPC_EXPERIMENTS', '<unset>'))"
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    env.update(PYTHONPATH=str(Path(__file__).resolve().parent.parent), SWITCHYARD_METRICS_PORT="many")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    refusal, experiments = out.stdout.strip().splitlines()
    assert "SWITCHYARD_METRICS_PORT='many'" in refusal
    assert experiments == transport.LOW_LATENCY_EXPERIMENTS
    assert "grpc was imported before" not in out.stderr


ALLOCATIONS = """
import resource
from switchyard import allocator
applied = allocator.keep_freed_memory()
def burst() -> None:
    held = [bytes(1 << 20) for _ in range(16)]  # sixteen 1 MiB messages in flight
    del held
burst()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    burst()
print(applied, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""


def _allocations_in_child(**env: str) -> tuple[bool, float]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "SWITCHYARD_MALLOC"))}
    base["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    out = subprocess.run(
        [sys.executable, "-c", ALLOCATIONS], env={**base, **env}, capture_output=True, text=True, check=True
    )
    applied, faults = out.stdout.split()
    return applied == "True", float(faults)


def test_services_keep_freed_message_memory_mapped_unless_told_otherwise() -> None:
    """Bursts of 1 MiB buffers, as large messages make: with the services' malloc settings
    the freed memory is reused, so they fault far fewer fresh pages than on glibc's defaults."""
    kept, kept_faults = _allocations_in_child()
    default, default_faults = _allocations_in_child(SWITCHYARD_MALLOC="default")
    assert kept and not default
    assert kept_faults < default_faults / 2, (kept_faults, default_faults)
    operator, _ = _allocations_in_child(MALLOC_TRIM_THRESHOLD_="1048576")  # the operator's setting wins
    assert not operator


def test_an_unknown_malloc_choice_is_refused_with_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHYARD_MALLOC", "jemalloc")
    coro = _loop_module()
    with pytest.raises(InvalidArgument, match=r"SWITCHYARD_MALLOC=.jemalloc.: use keep .* or default"):
        run_service(coro)
    assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED


async def test_methods_left_unregistered_with_the_core_are_still_served() -> None:
    """ServerOptions.registered_methods: only the named methods are registered with gRPC's
    core (grpc.aio waits on one pending call per registered method with every call); every
    other method, health and reflection included, is found by the generic handlers."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from switchyard import tls
    from switchyard.grpcio import ServerOptions, start_server

    check = "/grpc.health.v1.Health/Check"
    for registered in (frozenset({check}), frozenset()):
        options = ServerOptions(registered_methods=registered, security=tls.Security(insecure=True))
        server = await start_server([], options)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                ask = reflection_pb2.ServerReflectionRequest(list_services="")
                answers = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([ask]))
                names = [s.name async for a in answers for s in a.list_services_response.service]
                assert "grpc.health.v1.Health" in names
        finally:
            await server.drain(0)


async def test_a_second_server_cannot_take_a_port_a_service_holds() -> None:
    # gRPC's default SO_REUSEPORT would let both bind and split the callers between them
    import grpc

    from switchyard import tls
    from switchyard.grpcio import ServerOptions, start_server

    server = await start_server([], ServerOptions(security=tls.Security(insecure=True)))
    try:
        with pytest.raises((OSError, RuntimeError)):
            await start_server([], ServerOptions(port=server.port, security=tls.Security(insecure=True)))
        stranger = grpc.aio.server()  # a server on gRPC's defaults (port sharing on) is refused too
        with pytest.raises(RuntimeError):
            stranger.add_insecure_port(f"127.0.0.1:{server.port}")
    finally:
        await server.drain(0)


def test_a_free_port_is_free_distinct_and_outside_the_ephemeral_range() -> None:
    import socket

    from switchyard import net

    low = net._ephemeral_low()
    taken: set[int] = set()
    for _ in range(20):
        port = net.free_port("127.0.0.1", taken)
        assert port not in taken
        if low > net.PORT_FLOOR + 1:  # Linux: never a port bind(0) could hand out
            assert net.PORT_FLOOR <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
        taken.add(port)
