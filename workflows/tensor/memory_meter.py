"""A path's process memory sampled through its measurement, for the growth criterion
(workflows/tensor/growth.py).

The measurement (workflows/tensor/performance.py) asks the path's executor for its memory
(Describe's `memory`: rss, and the device allocation where the executor reports it) at the
start and the end of each of the path's own blocks, and within a block whenever it has served
another share of the plan since the last sample (`ceil(min_iterations / blocks)` requests and
`min_seconds / blocks` seconds), so a path measured alone in one long block is sampled about
`blocks` times per scenario too. Each interval between two samples of one block is a step:
[requests served, rss bytes grown, device bytes grown]. Nothing between two blocks is counted:
there another path sharing the executor may be served, or warm-up requests are sent.

A sample that fails (the executor busy, a timeout) is skipped: memory is a side figure, and the
next sample's step spans both intervals.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from switchyard.gen.switchyard.v1 import executor_pb2 as xpb
from workflows.activities.connections import Connections
from workflows.pipeline.types import Target

DESCRIBE_TIMEOUT_S = 10.0

Describe = Callable[[], Awaitable[xpb.DescribeResponse | None]]


def describer(connections: Connections, target: Target) -> Describe:
    """The path's executor's Describe, None when it fails."""

    async def describe() -> xpb.DescribeResponse | None:
        try:
            stub = connections.control(target.executor)
            response: xpb.DescribeResponse = await stub.Describe(
                xpb.DescribeRequest(), timeout=DESCRIBE_TIMEOUT_S
            )
        except Exception:  # a side figure: a failed sample is skipped, not fatal
            return None
        return response

    return describe


class Meter:
    """One block's memory samples of one path, appended as steps to `steps`."""

    def __init__(self, describe: Describe, steps: list[list[int]], count: int, seconds: float) -> None:
        self.describe, self.steps = describe, steps
        self.count, self.seconds = max(1, count), seconds
        self.mark: tuple[int, int, int, float] | None = None  # served, rss, device, when
        self.busy = False  # one sample at a time, whichever of a block's workers asks
        self.device_reported = False
        self.lowest_available = 0  # the device's lowest available memory seen (0: none)

    def due(self, served: int) -> bool:
        """Another share of the plan served since the last sample."""
        if self.busy or self.mark is None:
            return False
        return served - self.mark[0] >= self.count and time.perf_counter() - self.mark[3] >= self.seconds

    async def sample(self, served: int) -> None:
        """Read the executor's memory now; the interval since the last sample is a step."""
        self.busy = True
        try:
            described = await self.describe()
        finally:
            self.busy = False
        if described is None or not described.memory.rss_bytes:
            return
        m, available = described.memory, int(described.device.memory_available_bytes)
        if available:
            self.lowest_available = min(self.lowest_available or available, available)
        rss, device = int(m.rss_bytes), int(m.device_allocated_bytes)
        if self.mark is not None:
            self.steps.append([served - self.mark[0], rss - self.mark[1], device - self.mark[2]])
        self.device_reported = self.device_reported or m.device_reported
        self.mark = (served, rss, device, time.perf_counter())
