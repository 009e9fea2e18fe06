"""What the tests of a whole local cluster (`switchyard up`, `demo`) share."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


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
