"""What the tests of a whole local cluster (`switchyard up`, `demo`) share."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.conftest import ROOT

STARTUP_S = 300  # `switchyard up` to its cluster.json, on a loaded 2-core host


@dataclass(frozen=True)
class UpCluster:
    root: Path  # up's working directory: its switchyard.toml and up.log; state under root / "state"
    state: dict[str, Any]  # cluster.json

    @property
    def log(self) -> Path:
        return self.root / "up.log"

    @property
    def ledger(self) -> Path:
        return self.root / "state" / "ledger.db"


def xla_cluster_config(tmp: Path, xla_python: str) -> Path:
    """A switchyard.toml in `tmp` (state under `tmp / "state"`): every service on a free
    port, the cpu and the xla executor (under `xla_python`) serving mlp and tiny-lm, and a
    quarter of the traffic shadowed."""
    path = tmp / "switchyard.toml"
    path.write_text(
        f'state_dir = "{tmp / "state"}"\n'
        "[temporal]\nport = 0\nui_port = 0\n[metering]\nport = 0\n[evaluator]\nport = 0\n"
        "[router]\nport = 0\nopenai_port = 0\nshadow_share = 0.25\n"
        '[executors.cpu]\nport = 0\nmodels = ["mlp", "tiny-lm"]\n'
        f'[executors.xla]\nenabled = true\nport = 0\nmodels = ["mlp", "tiny-lm"]\npython = "{xla_python}"\n'
    )
    return path


def start_up(
    config: Path, cwd: Path, log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """`python -m clients.cli up --config CONFIG` in `cwd`, its output into `log`; under `env`,
    else this process's environment with the repository on PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)} if env is None else env
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "clients.cli", "up", "--config", str(config)],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
        )  # fmt: skip


def wait_for_state(proc: subprocess.Popen[bytes], state_file: Path, log: Path) -> dict[str, Any]:
    """The cluster.json `up` writes once every service is ready; fails with the log's tail
    if `up` exits first or takes over STARTUP_S."""
    deadline = time.monotonic() + STARTUP_S
    while not state_file.exists():
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.5)
    return dict(json.loads(state_file.read_text()))


def logged(log: Path, text: str, timeout_s: float = 30.0) -> str:
    """The log once it holds `text`: `up` writes cluster.json, then asks every service its
    status and prints the table and its last line, so a test that saw the state file may be
    ahead of them."""
    deadline = time.monotonic() + timeout_s
    while text not in (found := log.read_text()):
        assert time.monotonic() < deadline, f"{text!r} not logged in {timeout_s} s:\n{found[-4000:]}"
        time.sleep(0.1)
    return found


def stop_up(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT, as Ctrl-C sends; SIGKILL after 90 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()
