"""The supervisor on real processes: the evaluator service, and a child that ignores SIGTERM
and leaves a grandchild behind. After stop, no process of theirs may remain."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from clients.local_cluster import health
from clients.local_cluster.plan import ServiceSpec
from clients.local_cluster.readiness import StartupFailed
from clients.local_cluster.supervisor import RestartPolicy, Supervisor
from switchyard.net import free_port
from tests.conftest import ROOT
from tests.processes import alive

ENV = {"PYTHONPATH": str(ROOT), "SWITCHYARD_SECURITY_INSECURE": "true"}


def _evaluator(port: int) -> ServiceSpec:
    argv = (sys.executable, "-m", "clients.cli", "evaluator", "serve", "--port", str(port))
    return ServiceSpec("evaluator", argv, f"127.0.0.1:{port}", "grpc", env=ENV, startup_timeout_s=60)


async def test_starts_a_real_service_waits_for_health_and_stops_it(tmp_path: Path) -> None:
    port = free_port("127.0.0.1")
    lines: list[str] = []
    sup = Supervisor([_evaluator(port)], tmp_path / "logs", "default", "q", say=lines.append)
    await sup.start(asyncio.Event())
    try:
        assert await health.grpc_health(f"127.0.0.1:{port}") == health.SERVING
        assert any("evaluator" in line and "ready" in line for line in lines)
        pid = sup.pids()["evaluator"]
        assert alive(pid)
    finally:
        await sup.stop(grace_s=10)
    assert not alive(pid)
    # It drained on SIGTERM (exit 0), it was not killed.
    assert sup.children["evaluator"].proc.returncode == 0
    assert await health.grpc_health(f"127.0.0.1:{port}", timeout_s=0.5) == health.UNREACHABLE


async def test_stop_kills_the_whole_group_of_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    port = free_port("127.0.0.1")
    pid_file = tmp_path / "pids"
    argv = (sys.executable, str(ROOT / "tests" / "cluster" / "fake_service.py"), str(port), str(pid_file))
    spec = ServiceSpec("stubborn", argv, f"127.0.0.1:{port}", "grpc", env=ENV, startup_timeout_s=30)
    sup = Supervisor([spec], tmp_path / "logs", "default", "q", say=lambda _: None)
    await sup.start(asyncio.Event())
    child, grandchild = (int(p) for p in pid_file.read_text().split())
    assert alive(child) and alive(grandchild)
    await sup.stop(grace_s=1)
    assert not alive(child)
    # the group's SIGKILL is delivered at once, but a loaded host may show the `sleep 300` for
    # a moment before it is gone: seconds are enough; without the group kill it lives 300 s
    gone_by = time.monotonic() + 5
    while alive(grandchild) and time.monotonic() < gone_by:  # noqa: ASYNC110  (another process)
        await asyncio.sleep(0.05)
    assert not alive(grandchild), "the grandchild outlived the supervisor"


async def test_a_service_that_dies_at_start_fails_with_its_log(tmp_path: Path) -> None:
    argv = (sys.executable, "-c", "print('bad flag --frobnicate'); raise SystemExit(3)")
    spec = ServiceSpec("broken", argv, f"127.0.0.1:{free_port('127.0.0.1')}", "grpc", startup_timeout_s=30)
    sup = Supervisor([spec], tmp_path / "logs", "default", "q", say=lambda _: None)
    with pytest.raises(StartupFailed, match=r"(?s)broken exited with code 3.*bad flag --frobnicate"):
        await sup.start(asyncio.Event())
    await sup.stop(grace_s=1)


async def test_watch_reports_a_child_that_dies_after_start(tmp_path: Path) -> None:
    port = free_port("127.0.0.1")
    sup = Supervisor([_evaluator(port)], tmp_path / "logs", "default", "q", say=lambda _: None)
    await sup.start(asyncio.Event())
    try:
        os.kill(sup.pids()["evaluator"], 9)
        died = await asyncio.wait_for(sup.watch(asyncio.Event()), 10)
        assert died == "evaluator"
    finally:
        await sup.stop(grace_s=1)


CRASHER = """
import asyncio, os, sys
from switchyard.grpcio import ServerOptions, start_server

async def main() -> None:
    server = await start_server([], ServerOptions(port=int(sys.argv[1])))  # kept: serving
    while not os.path.exists(sys.argv[2]):  # armed by the test once the supervisor started it
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)
    os._exit(3 if server else 4)  # a crash: no clean-up

asyncio.run(main())
"""


async def test_a_crashing_service_is_restarted_with_backoff_until_the_crash_loop_limit(
    tmp_path: Path,
) -> None:
    port = free_port("127.0.0.1")
    armed = tmp_path / "armed"
    argv = (sys.executable, "-c", CRASHER, str(port), str(armed))
    spec = ServiceSpec("crasher", argv, f"127.0.0.1:{port}", "grpc", env=ENV, startup_timeout_s=30)
    lines: list[str] = []
    changes: list[str] = []
    policy = RestartPolicy(base_s=0.2, max_s=1.0, limit=3, stable_s=60)
    sup = Supervisor([spec], tmp_path / "logs", "default", "q", say=lines.append, policy=policy,
                     on_change=lambda: changes.append(sup.children["crasher"].state))  # fmt: skip
    stop = asyncio.Event()
    await sup.start(stop)
    first = sup.pids()["crasher"]
    sup.start_healing(stop)
    armed.touch()
    try:
        for _ in range(300):
            if sup.children["crasher"].state == "crash-loop":
                break
            await asyncio.sleep(0.1)
        child = sup.children["crasher"]
        assert child.state == "crash-loop", lines
        assert child.restarts == 3 and child.last_exit == "exit code 3"
        assert child.pid != first
        waits = [
            float(line.split("restarting in ")[1].split("s")[0]) for line in lines if "restarting in" in line
        ]
        assert waits == [0.2, 0.4, 0.8]  # doubling back-off
        assert any("crash loop" in line for line in lines)
        assert changes[-1] == "crash-loop" and "running" in changes  # each restart was recorded
        assert not stop.is_set()  # giving up on one service does not stop the supervisor
    finally:
        await sup.stop(grace_s=1)


async def test_children_die_with_the_supervisor(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG: a supervisor process killed with SIGKILL takes its children along."""
    port = free_port("127.0.0.1")
    pid_file = tmp_path / "pid"
    script = f"""
import asyncio, sys
from pathlib import Path
from clients.local_cluster.plan import ServiceSpec
from clients.local_cluster.supervisor import Supervisor

async def main() -> None:
    spec = ServiceSpec("evaluator", {_evaluator(port).argv!r}, "127.0.0.1:{port}", "grpc",
                       env={ENV!r}, startup_timeout_s=60)
    sup = Supervisor([spec], Path({str(tmp_path / "logs")!r}), "default", "q", say=lambda _: None)
    await sup.start(asyncio.Event())
    Path({str(pid_file)!r}).write_text(str(sup.pids()["evaluator"]))
    await asyncio.sleep(600)

asyncio.run(main())
"""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", script, env={**os.environ, **ENV})
    try:
        for _ in range(600):
            if pid_file.exists() and pid_file.read_text():
                break
            assert proc.returncode is None
            await asyncio.sleep(0.1)
        child = int(pid_file.read_text())
        assert alive(child)
        proc.kill()
        await proc.wait()
        for _ in range(50):
            if not alive(child):
                break
            await asyncio.sleep(0.1)
        assert not alive(child), "the service outlived its SIGKILLed supervisor"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if pid_file.exists() and pid_file.read_text() and alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), 9)  # left behind only when the test fails
