"""Executor processes for the XLA tests: real `switchyard executor serve` processes on port 0.

The xla executor runs under the XLA environment's interpreter ($SWITCHYARD_XLA_PYTHON, which
`make test` builds and exports); the cpu executor under this interpreter. Both are started
together (their start-ups overlap) and stopped with SIGTERM (the graceful drain).
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from switchyard.models.repository import seed_builtins
from tests.conftest import IN_CI, ROOT
from tests.processes import stop_child

XLA_PYTHON = os.environ.get("SWITCHYARD_XLA_PYTHON", "")
BUCKETS = "1,4,8"
START_TIMEOUT_S = 240.0


def require_xla_env() -> str:
    """The XLA interpreter; under CI its absence fails, elsewhere it skips with the fix."""
    if XLA_PYTHON and Path(XLA_PYTHON).is_file():
        return XLA_PYTHON
    message = (
        f"XLA environment not found (SWITCHYARD_XLA_PYTHON={XLA_PYTHON!r}); "
        "run `make setup-xla` or `make test`, which builds and exports it"
    )
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


@dataclass
class ExecutorProcess:
    process: subprocess.Popen[str]
    address: str
    lines: list[str]

    def stop(self) -> int:
        return stop_child(self.process)


def spawn(python: str, backend: str, models: str, *extra: str) -> subprocess.Popen[str]:
    cmd = [python, "-m", "clients.cli", "executor", "serve", "--backend", backend, "--port", "0"]
    cmd += ["--models", models, "--buckets", BUCKETS, *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU")}
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )


def wait_serving(process: subprocess.Popen[str], timeout_s: float = START_TIMEOUT_S) -> ExecutorProcess:
    """Reads the process's output until it prints 'serving on HOST:PORT' (or dies)."""
    lines: list[str] = []
    found: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line.rstrip())
            if " serving on " in line:
                found.put(line.rsplit(" serving on ", 1)[1].strip())

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return ExecutorProcess(process, found.get(timeout=0.5), lines)
        except queue.Empty:
            if process.poll() is not None:
                time.sleep(0.2)
                tail = "\n".join(lines[-40:])
                raise RuntimeError(f"executor exited {process.returncode}:\n{tail}") from None
    process.kill()
    raise RuntimeError(f"executor did not serve within {timeout_s}s:\n" + "\n".join(lines[-40:]))


@pytest.fixture(scope="package")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The executors' model repository: the built-ins, plus what a test adds."""
    root = tmp_path_factory.mktemp("models")
    seed_builtins(root)
    return root


@pytest.fixture(scope="package")
def executors(repository: Path) -> Iterator[dict[str, ExecutorProcess]]:
    """An xla and a cpu executor, both serving mlp and tiny-lm warmed for BUCKETS, from one
    repository; factories of the `tests` package are allowed. The xla one also serves
    tiny-lm-gen for test_xla_generation: one xla process for the package, not one a module
    (each start imports torch_xla and brings up PJRT, ~10 s on this host; every counter the
    tests read is the model's own, so the models do not see each other's compilations)."""
    xla_python = require_xla_env()
    extra = ("--model-repository", str(repository), "--allow-factory", "tests")
    started = {
        "xla": spawn(xla_python, "xla", "mlp,tiny-lm,tiny-lm-gen", *extra),
        "cpu": spawn(sys.executable, "cpu", "mlp,tiny-lm", *extra),
    }
    running: dict[str, ExecutorProcess] = {}
    try:
        for name, process in started.items():
            running[name] = wait_serving(process)
        yield running
    finally:
        for process in started.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in started.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
