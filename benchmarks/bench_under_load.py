"""What the correctness-under-load check costs: MAX_CHECKED answers (the most one scenario
checks, workflows/tensor/under_load.py) through the evaluator's Compare, as the performance activity
sends them after a scenario's timing, for a small and a larger answer.

The evaluator runs in this process on port 0, plaintext. Usage:
SWITCHYARD_SECURITY_INSECURE=true python benchmarks/bench_under_load.py
"""

from __future__ import annotations

import asyncio
import base64
import time

import numpy as np
import numpy.typing as npt

from services.evaluator.evaluator_server import start_evaluator
from switchyard.grpcio import ServerOptions
from workflows.activities.connections import Connections, WorkerConfig
from workflows.pipeline.types import CompareRequest, Target, TensorData
from workflows.spec.trial_spec import Criteria
from workflows.tensor.comparison import ComparisonActivities
from workflows.tensor.under_load import MAX_CHECKED


def _tensor(a: npt.NDArray[np.float64]) -> list[TensorData]:
    raw = base64.b64encode(a.astype(np.float32).tobytes()).decode()
    return [TensorData("y", "FP32", list(a.shape), raw)]


async def main() -> None:
    server = await start_evaluator(ServerOptions(port=0))
    comparison = ComparisonActivities(Connections(WorkerConfig(evaluator=server.address)))
    target = Target("bench", "p", "cpu", "m", "", "", "eager", "fp32", [])
    try:
        for shape in ((4, 8), (8, 1000)):
            ref = np.random.default_rng(0).normal(size=shape)
            request = CompareRequest(target, Criteria(), _tensor(ref), _tensor(ref + 1e-9))
            await comparison.compare_outputs(request)  # the channel's first call
            t0 = time.perf_counter()
            for _ in range(MAX_CHECKED):
                await comparison.compare_outputs(request)
            s = time.perf_counter() - t0
            print(f"{MAX_CHECKED} compares of {shape}: {s:.3f} s, {s / MAX_CHECKED * 1e3:.2f} ms each")
    finally:
        await server.drain(0)


if __name__ == "__main__":
    asyncio.run(main())
