"""Triton-style dynamic batching: a bounded queue per model and one batch loop per model.

Requests with the same non-batch shape are stacked into one batch of at most `max_batch`
rows. With `max_queue_delay_us` = 0 batching is opportunistic: a batch takes what is queued
the moment the device is free, so a lone request never waits, and under load requests pile up
while the previous batch computes and go together. A positive delay holds the first request
up to that long for company. With `dynamic_batching` off every request runs alone.

A full queue refuses at once (`QueueFull` -> RESOURCE_EXHAUSTED). A request whose deadline
passes while queued is dropped before compute (`ExpiredInQueue` -> DEADLINE_EXCEEDED), and
one whose caller went away (cancelled future) is dropped too: no work is done for either.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from switchyard.errors import DeadlineExceeded, ResourceExhausted, Unavailable


class QueueFull(ResourceExhausted):
    """The model's queue is at its bound."""


class ExpiredInQueue(DeadlineExceeded):
    """The request's deadline passed before it reached the device."""


@dataclass(frozen=True)
class BatchPolicy:
    max_batch: int
    max_queue_delay_us: int = 0
    max_queue_size: int = 64
    dynamic_batching: bool = True


@dataclass
class QueuedRequest:
    """One request's inputs (numpy, in declared order) waiting for a batch."""

    arrays: list[np.ndarray]
    rows: int
    deadline: float | None  # time.perf_counter() seconds (the clock `enqueued` uses)
    future: asyncio.Future[BatchResult]
    enqueued: float = field(default_factory=time.perf_counter)

    @property
    def key(self) -> tuple[tuple[tuple[int, ...], str], ...]:
        # requests batch together only with the same non-batch shape and wire dtype
        return tuple((a.shape[1:], a.dtype.str) for a in self.arrays)


@dataclass(frozen=True)
class BatchResult:
    """One request's share of a batch's outputs, with its timings."""

    outputs: list[np.ndarray]
    queue_us: int
    compute_us: int
    batch_size: int
    padded_batch_size: int


@dataclass
class BatchCounters:
    """What ModelStatistics and the Prometheus metrics report, kept as plain integers on the
    event loop (read at scrape or query time: recording costs a few additions a request)."""

    requests: int = 0
    executions: int = 0
    rows: int = 0
    expired_in_queue: int = 0
    cancelled_in_queue: int = 0
    rejected_queue_full: int = 0
    failed_compute: int = 0  # requests of batches whose compute raised
    queue_ns: int = 0
    compute_ns: int = 0
    ran_inline: int = 0  # lone requests that took the fast path (no queue, no thread)
    # Per request, as Triton counts them: each request of a batch is charged its batch's phases.
    success: int = 0
    success_ns: int = 0  # end-to-end time in the executor of successful requests
    request_input_ns: int = 0
    request_infer_ns: int = 0
    request_output_ns: int = 0
    last_inference_ms: int = 0  # unix milliseconds of the last executed batch
    # rows of an executed batch -> [executions, input ns, infer ns, output ns] (batch_stats)
    by_batch_size: dict[int, list[int]] = field(default_factory=dict)

    @property
    def failures(self) -> int:
        return (
            self.expired_in_queue + self.cancelled_in_queue + self.rejected_queue_full + self.failed_compute
        )

    def executed(self, requests: int, rows: int, phases: Phases) -> None:
        self.executions += 1
        self.rows += rows
        self.compute_ns += phases.total_ns
        self.request_input_ns += phases.input_ns * requests
        self.request_infer_ns += phases.infer_ns * requests
        self.request_output_ns += phases.output_ns * requests
        self.last_inference_ms = time.time_ns() // 1_000_000
        entry = self.by_batch_size.get(rows)
        if entry is None:
            entry = self.by_batch_size[rows] = [0, 0, 0, 0]
        entry[0] += 1
        entry[1] += phases.input_ns
        entry[2] += phases.infer_ns
        entry[3] += phases.output_ns


@dataclass(frozen=True)
class Phases:
    """A batch's compute in Triton's three phases (nanoseconds): assembling the inputs,
    running the model (device synchronised), splitting the outputs."""

    input_ns: int
    infer_ns: int
    output_ns: int

    @property
    def total_ns(self) -> int:
        return self.input_ns + self.infer_ns + self.output_ns

    @property
    def total_s(self) -> float:
        return self.total_ns / 1e9


# Computes one batch synchronously: (requests) -> (per-request outputs, phases, padded rows)
ComputeNow = Callable[[list[QueuedRequest]], tuple[list[list[np.ndarray]], Phases, int]]
# Runs one assembled batch on the device: (requests) -> (per-request outputs, phases, padded rows)
RunBatch = Callable[[list[QueuedRequest]], Awaitable[tuple[list[list[np.ndarray]], Phases, int]]]


class Batcher:
    def __init__(self, policy: BatchPolicy, run_batch: RunBatch) -> None:
        self.policy = policy
        self._run_batch = run_batch
        self._queue: deque[QueuedRequest] = deque()
        self._wakeup = asyncio.Event()
        self._closed = False
        self.counters = BatchCounters()
        self._executing = False
        self._task = asyncio.get_running_loop().create_task(self._loop())

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def idle(self) -> bool:
        """Nothing queued, no batch executing, no delay to wait out: a request may run at once."""
        waits = self.policy.dynamic_batching and self.policy.max_queue_delay_us > 0
        return not waits and not self._queue and not self._executing and not self._closed

    def run_now(self, arrays: list[np.ndarray], rows: int, compute: ComputeNow) -> BatchResult:
        """Runs a lone request synchronously, skipping the queue's task hand-offs.

        The caller checked `idle` and runs this on the event loop, so nothing can enqueue
        while it computes; counters are kept as for a queued request.
        """
        future: asyncio.Future[BatchResult] = asyncio.get_running_loop().create_future()
        item = QueuedRequest(arrays, rows, None, future)
        outputs, phases, padded = compute([item])
        self.counters.requests += 1
        self.counters.ran_inline += 1
        self.counters.executed(1, rows, phases)
        compute_s = phases.total_s
        queue_us = int((time.perf_counter() - item.enqueued - compute_s) * 1e6)
        return BatchResult(outputs[0], max(0, queue_us), int(compute_s * 1e6), rows, padded)

    async def submit(self, arrays: list[np.ndarray], rows: int, deadline: float | None) -> BatchResult:
        if self._closed:
            raise Unavailable("the model is being unloaded; retry on another executor")
        if len(self._queue) >= self.policy.max_queue_size:
            self.counters.rejected_queue_full += 1
            raise QueueFull(
                f"queue is full ({self.policy.max_queue_size} requests waiting); retry later or raise "
                "max_queue_size"
            )
        future: asyncio.Future[BatchResult] = asyncio.get_running_loop().create_future()
        self._queue.append(QueuedRequest(arrays, rows, deadline, future))
        self.counters.requests += 1
        self._wakeup.set()
        return await future

    async def close(self, grace_s: float = 0.0) -> None:
        """Refuses new work, lets queued and running batches finish within `grace_s`, then
        fails whatever is left with UNAVAILABLE (never leaves a caller waiting forever)."""
        self._closed = True
        loop = asyncio.get_running_loop()
        until = loop.time() + grace_s
        # polling: a close happens once per model, and the loop must keep running batches
        while (self._queue or self._executing) and loop.time() < until:  # noqa: ASYNC110
            await asyncio.sleep(0.005)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        for item in self._queue:
            if not item.future.done():
                item.future.set_exception(Unavailable("the model was unloaded before this request finished"))
        self._queue.clear()

    def _drop_dead(self) -> None:
        """Removes cancelled and expired requests from the queue without computing them."""
        now = time.perf_counter()
        kept: deque[QueuedRequest] = deque()
        for item in self._queue:
            if item.deadline is not None and now >= item.deadline:
                self.counters.expired_in_queue += 1
                if not item.future.done():
                    item.future.set_exception(
                        ExpiredInQueue(
                            "the deadline expired while the request waited in the queue; it was not run"
                        )
                    )
            elif item.future.done():
                self.counters.cancelled_in_queue += 1
            else:
                kept.append(item)
        self._queue = kept

    def _take_batch(self) -> list[QueuedRequest]:
        first = self._queue.popleft()
        batch, rows = [first], first.rows
        if not self.policy.dynamic_batching:
            return batch
        rest: deque[QueuedRequest] = deque()
        while self._queue:
            item = self._queue.popleft()
            if item.key == first.key and rows + item.rows <= self.policy.max_batch:
                batch.append(item)
                rows += item.rows
            else:
                rest.append(item)
        self._queue = rest
        return batch

    def _ready_rows(self) -> int:
        first = self._queue[0]
        return sum(i.rows for i in self._queue if i.key == first.key)

    async def _loop(self) -> None:
        while True:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            delay = self.policy.max_queue_delay_us / 1e6
            if self.policy.dynamic_batching and delay > 0:
                # Hold the oldest request up to the delay, unless a full batch is already there.
                until = self._queue[0].enqueued + delay
                # wake for the first deadline too, so expired work leaves the queue promptly
                deadlines = [i.deadline for i in self._queue if i.deadline is not None]
                if deadlines:
                    until = min(until, min(deadlines))
                while self._ready_rows() < self.policy.max_batch and time.perf_counter() < until:
                    self._wakeup.clear()
                    try:
                        await asyncio.wait_for(self._wakeup.wait(), until - time.perf_counter())
                    except TimeoutError:
                        break
                    if not self._queue:
                        break
            elif self.policy.dynamic_batching:
                # Let handlers whose requests already arrived enqueue them before a batch forms:
                # yield while the queue still grows (a lone request costs one loop turn).
                for _ in range(8):
                    depth = len(self._queue)
                    await asyncio.sleep(0)
                    if len(self._queue) <= depth or len(self._queue) >= self.policy.max_batch:
                        break
            self._drop_dead()
            if not self._queue:
                continue
            batch = self._take_batch()
            await self._execute(batch)
            await asyncio.sleep(0)  # a batch computed inline: its callers answer before the next

    async def _execute(self, batch: list[QueuedRequest]) -> None:
        started = time.perf_counter()
        self._executing = True
        try:
            outputs, phases, padded = await self._run_batch(batch)
        except asyncio.CancelledError:  # closed mid-batch: answer the callers, then stop
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(Unavailable("the model was unloaded while this request ran"))
            raise
        except Exception as exc:
            self.counters.failed_compute += len(batch)
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(exc)
            return
        finally:
            self._executing = False
        rows = sum(i.rows for i in batch)
        self.counters.executed(len(batch), rows, phases)
        compute_us = phases.total_ns // 1000
        for item, out in zip(batch, outputs, strict=True):
            queue_us = int((started - item.enqueued) * 1e6)
            self.counters.queue_ns += queue_us * 1000
            if not item.future.done():
                item.future.set_result(BatchResult(out, queue_us, compute_us, rows, padded))
