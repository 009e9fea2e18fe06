"""The supervisor on real processes: the evaluator service, and a child that ignores SIGTERM
and leaves a grandchild behind. After stop, no process of theirs may remain."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from switchyard.cluster import health
from switchyard.cluster.plan import ServiceSpec, free_port
from switchyard.cluster.supervisor import StartupFailed, Supervisor
from tests.conftest import ROOT

ENV = {"PYTHONPATH": str(ROOT), "SWITCHYARD_SECURITY_INSECURE": "true"}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes: read its state.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _evaluator(port: int) -> ServiceSpec:
    argv = (sys.executable, "-m", "switchyard", "evaluator", "serve", "--port", str(port))
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
