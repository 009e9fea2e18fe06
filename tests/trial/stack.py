"""The services a trial needs, started for real: Temporal dev server, evaluator, metering on a
SQLite file, a CPU executor in-process and, where the XLA environment exists, an XLA executor
process. Prices are set for the price keys the executors describe."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
from temporalio.testing import WorkflowEnvironment

from switchyard.gen.switchyard.v1 import executor_pb2 as xpb
from switchyard.gen.switchyard.v1 import executor_pb2_grpc as xgrpc
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as mgrpc

ROOT = Path(__file__).resolve().parents[2]
PRICE_MICROS_PER_HOUR = 3_600_000  # 3.60 USD an hour = 1 micro-unit per millisecond


@dataclass
class Stack:
    env: WorkflowEnvironment
    evaluator: str
    metering: str
    database_url: str
    cpu: str
    xla: str  # "" when the XLA environment is missing
    repository: Path  # both executors' model repository (built-ins + what tests add)

    @property
    def temporal(self) -> str:
        return str(self.env.client.service_client.config.target_host)

    @property
    def codec_key_file(self) -> str:
        """The payload codec's key file the stack's client encrypts with (tests/trial/conftest.py)."""
        from tests.trial.conftest import codec_key_file

        return codec_key_file(self.env)

    def executors(self) -> dict[str, str]:
        found = {"cpu": self.cpu}
        if self.xla:
            found["xla"] = self.xla
        return found


def xla_python() -> str:
    """The XLA env's interpreter: $SWITCHYARD_XLA_PYTHON (make exports it), else the Makefile's path."""
    path = os.environ.get("SWITCHYARD_XLA_PYTHON", "")
    if not path:
        digest = hashlib.sha256((ROOT / "requirements" / "xla.txt").read_bytes()).hexdigest()[:12]
        path = str(Path.home() / ".cache" / "switchyard" / f"xla-{digest}" / "bin" / "python")
    return path if Path(path).exists() else ""


# A channel whose connection failed waits out gRPC's reconnect backoff (1 s, then x1.6 each
# time) before it tries again, so an executor that came up was seen seconds late (the shared
# stack's setup, waiting for the XLA process, took 5.7-6.4 s with it, 3.4 s without).
_QUICK_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 100),
]


async def wait_serving(address: str, timeout_s: float = 180.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with grpc.aio.insecure_channel(address, options=_QUICK_RECONNECT) as channel:
        while True:
            try:
                await xgrpc.ExecutorControlStub(channel).Describe(xpb.DescribeRequest(), timeout=5)
                return
            except grpc.aio.AioRpcError:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.1)


def start_xla_executor(port: int, repository: Path | None = None) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PJRT_DEVICE": "CPU"}
    command = [xla_python(), "-m", "clients.cli", "executor", "serve", "--backend", "xla"]
    command += ["--port", str(port)]
    # no model at start-up: trials load their own, and the CLI's default (mlp, 96 blocks, four
    # buckets) kept the device thread compiling for ~80 s on a busy 2-core host
    command += ["--models", ""]
    if repository is not None:
        command += ["--model-repository", str(repository), "--allow-factory", "tests"]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def set_prices(stack: Stack) -> None:
    async with grpc.aio.insecure_channel(stack.metering) as meter:
        for address in stack.executors().values():
            async with grpc.aio.insecure_channel(address) as channel:
                d = await xgrpc.ExecutorControlStub(channel).Describe(xpb.DescribeRequest(), timeout=10)
            await mgrpc.MeteringStub(meter).SetPrice(
                mpb.SetPriceRequest(
                    price=mpb.Price(
                        price_key=d.price_key,
                        micros_per_hour=PRICE_MICROS_PER_HOUR,
                        currency="USD",
                        effective_from_unix_us=1,
                    ),
                    actor=mpb.Actor(principal="test", source="test"),
                )
            )


def worker_command(stack: Stack, task_queue: str) -> list[str]:
    command = [sys.executable, "-m", "clients.cli", "worker", "--temporal", stack.temporal]
    command += ["--evaluator", stack.evaluator, "--metering", stack.metering, "--task-queue", task_queue]
    command += ["--codec-key-file", stack.codec_key_file]
    for name, address in stack.executors().items():
        command += ["--executor", f"{name}={address}"]
    return command
