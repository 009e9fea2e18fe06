"""`switchyard up` and `switchyard health` as a user runs them (subprocesses)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from switchyard.net import free_port
from tests.conftest import ROOT

ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "SWITCHYARD_SECURITY_INSECURE": "true"}


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clients.cli", *args], capture_output=True, text=True, env=ENV, timeout=timeout
    )


def test_up_refuses_a_taken_port_before_starting_anything(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "c.toml"
        config.write_text(
            f'state_dir = "{tmp_path}/state"\n[router]\nport = {port}\nopenai_port = 0\n'
            "[temporal]\nport = 0\nui_port = 0\n[metering]\nport = 0\n[evaluator]\nport = 0\n"
            "[executors.cpu]\nport = 0\n[executors.xla]\nenabled = false\n"
        )
        proc = run("up", "--config", str(config))
    assert proc.returncode == 2
    assert f"port {port} for router is in use" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "state" / "logs").exists()  # nothing was started


def test_up_reports_a_bad_config_key(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text("[routr]\nport = 1\n")
    proc = run("up", "--config", str(config))
    assert proc.returncode == 2
    assert "unknown configuration key 'routr'" in proc.stderr


def test_health_command_against_a_real_service_and_nothing(tmp_path: Path) -> None:
    port = free_port("127.0.0.1")
    server = subprocess.Popen(
        [sys.executable, "-m", "clients.cli", "evaluator", "serve", "--port", str(port)], env=ENV
    )
    try:
        for _ in range(60):
            proc = run("health", f"127.0.0.1:{port}", "--timeout", "1")
            if proc.returncode == 0:
                break
        assert proc.returncode == 0 and proc.stdout.strip() == "SERVING"
    finally:
        server.terminate()
        server.wait(30)
    proc = run("health", f"127.0.0.1:{free_port('127.0.0.1')}", "--timeout", "0.5")
    assert proc.returncode == 1 and proc.stdout.strip() == "UNREACHABLE"
