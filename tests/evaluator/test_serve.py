"""`switchyard evaluator serve` as its own process: serves, then drains on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from pathlib import Path

import grpc
import numpy as np

from switchyard.gen.switchyard.v1 import evaluator_pb2 as pb
from switchyard.gen.switchyard.v1 import evaluator_pb2_grpc as pb_grpc
from switchyard.judge.tensors import encode

ROOT = Path(__file__).resolve().parents[2]


async def test_evaluator_serve_process() -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "clients.cli", "evaluator", "serve", "--port", "0",
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert process.stderr is not None
    try:
        address = ""
        async with asyncio.timeout(60):
            while not address:
                line = (await process.stderr.readline()).decode()
                assert line, "evaluator exited before serving"
                found = re.search(r"evaluator serving on (\S+)", line)
                address = found.group(1) if found else ""
        values = np.ones((2, 3), dtype=np.float32)
        tensor = pb.Tensor(datatype="FP32", shape=[2, 3], data=encode(values, "FP32"))
        async with grpc.aio.insecure_channel(address) as channel:
            response = await pb_grpc.EvaluatorStub(channel).Compare(
                pb.CompareRequest(reference=tensor, candidate=tensor), timeout=10
            )
        assert response.passed
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 30) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
