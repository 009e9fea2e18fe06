"""A service told to stop the moment it announces its address drains and exits 0.

The signal handlers are installed before the announcement (`switchyard.grpcio.stop_signal`);
before that fix, a SIGTERM right after "serving on" killed the process undrained (-15).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

COMMANDS = {
    "executor": ["executor", "serve", "--port", "0", "--models", "mlp", "--buckets", "1"],
    "evaluator": ["evaluator", "serve", "--port", "0"],
    "metering": ["metering", "serve", "--port", "0", "--db", "sqlite:///{tmp}/ledger.db"],
}


@pytest.mark.parametrize("service", sorted(COMMANDS))
def test_sigterm_right_after_the_announcement_drains_and_exits_0(service: str, tmp_path: Path) -> None:
    args = [a.format(tmp=tmp_path) for a in COMMANDS[service]]
    proc = subprocess.Popen(
        [sys.executable, "-m", "clients.cli", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "SWITCHYARD_TRACES": "none"},
    )
    assert proc.stdout is not None
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "serving on" in line:
                proc.send_signal(signal.SIGTERM)
                break
        else:
            pytest.fail(f"{service} exited before serving:\n{''.join(seen)}")
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, "".join(seen) + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
