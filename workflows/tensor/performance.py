"""The performance phase: warm-up, then single-stream and offline scenarios until both the
minimum iteration count and the minimum duration are met, with proof that nothing compiled.

One path is measured alone (`measure_performance`), or several paths that share a host are
measured together in alternating blocks (`measure_interleaved`): every scenario is cut into
`blocks` time slots, and in each slot every path measures its share of the plan (its
`min_iterations / blocks` requests and `min_seconds / blocks` seconds) in turn, the order
reversed every other slot (AB, BA, AB, ...), so a change of the host's load lands on all of
them alike and block i of each path is paired with block i of the others by time.

Each request is one job in the ledger (kind "trial"), recorded at the end of its scenario
with an idempotency key from the workflow run, so a retried activity never double counts.
Finished scenarios are kept in the heartbeat details: if the worker dies mid-measurement,
the retry resumes at the first unfinished scenario instead of measuring everything again.

A fault during the measurement (an executor that stops answering for seconds, requests that
fail) is named: a request that failed, or one that took at least STALL_MIN_S and STALL_FACTOR
times the scenario's median, makes the path's timings not steady (`_fault`), and the verdict
leaves its speed inconclusive with the fault's effect as the reason, never a speed measured
through it (issue 33).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import numpy as np
from temporalio import activity
from temporalio.exceptions import ApplicationError

from switchyard.gen.inference import grpc_service_pb2 as oip
from switchyard.gen.switchyard.v1 import executor_pb2 as xpb
from workflows.activities import payloads
from workflows.activities.connections import Connections, grpc_errors
from workflows.activities.path import Clock, heartbeating
from workflows.activities.trial_ledger import send_usage, usage_event
from workflows.pipeline.types import (
    CompareRequest,
    Extension,
    ExtensionRule,
    InterleavedRequest,
    InterleavedResult,
    PerformanceRequest,
    PerformanceResult,
    ScenarioResult,
    TensorData,
    UnderLoad,
)
from workflows.spec.trial_spec import PerformancePlan
from workflows.tensor import extension, under_load
from workflows.tensor.comparison import ComparisonActivities
from workflows.tensor.intervals import split_blocks, thin
from workflows.tensor.memory_meter import Meter, describer

BLOCK_SAMPLES = 200  # values kept per block: 10 blocks of single-stream are about 16 KB of JSON
BEAT_S = 0.5  # heartbeat (and memory sample) interval while measuring
STALL_MIN_S = 1.0  # a stalled request took at least this long ...
STALL_FACTOR = 10.0  # ... and this many times its scenario's median


@dataclasses.dataclass
class _Sample:
    started_us: int
    ended_us: int
    latency_s: float
    compute_us: int
    ok: bool
    prompt_tokens: int = 0  # a generation request's tokens, metered with it (0 otherwise)
    output_tokens: int = 0


@dataclasses.dataclass
class _Stream:
    """One path's requests in one scenario: how to send one, and what it measured, by block."""

    call: Callable[[int], Awaitable[_Sample]]  # index >= 0: a measured request (-1: warm-up)
    inputs: list[tuple[str, str, Any]]
    batch: int  # the rows per request (a workload's mean rows)
    kept: dict[int, list[TensorData]]  # answers under load to check, by request index
    blocks: list[list[_Sample]] = dataclasses.field(default_factory=list)
    seconds: float = 0.0  # time spent measuring this path (its own blocks only)
    measured: itertools.count[int] = dataclasses.field(default_factory=itertools.count)

    def samples(self) -> list[_Sample]:
        return [s for b in self.blocks for s in b]


@dataclasses.dataclass
class _Progress:
    """One path's measurement so far; its `state` is what the heartbeat keeps for a retry."""

    request: PerformanceRequest
    before: int  # compilation counters before measuring
    done: list[ScenarioResult] = dataclasses.field(default_factory=list)
    busy_us: int = 0
    jobs: int = 0
    memory_min_available: int = 0
    answers: dict[str, list[TensorData]] = dataclasses.field(default_factory=dict)
    check: UnderLoad | None = None
    problem: str = ""  # why this path stopped measuring (every request of a scenario failed)
    memory_steps: list[list[int]] = dataclasses.field(default_factory=list)  # memory_meter.py
    device_reported: bool = False

    def finished(self, name: str, batch: int) -> bool:
        return bool(self.problem) or any(s.scenario == name and s.batch_size == batch for s in self.done)

    def state(self) -> dict[str, Any]:
        return {
            "completed": [dataclasses.asdict(s) for s in self.done],
            "compilations_before": self.before,
            "busy_us": self.busy_us,
            "jobs": self.jobs,
            "memory_min_available": self.memory_min_available,
            "problem": self.problem,
            "memory_steps": self.memory_steps,
            "device_reported": self.device_reported,
        }


def _scenarios(plan: PerformancePlan) -> list[tuple[str, int, int]]:
    """(name, batch, concurrency) of each scenario of the plan, in order."""
    scenarios: list[tuple[str, int, int]] = []
    if "single-stream" in plan.scenarios:
        scenarios.append(("single-stream", 1, 1))
    if "offline" in plan.scenarios:
        scenarios += [("offline", b, plan.offline_concurrency) for b in plan.batch_sizes]
    return scenarios


def _summary(
    name: str,
    concurrency: int,
    stream: _Stream,
    sizes: dict[str, list[int]],
    blocks: int,
    interleaved: bool,
) -> ScenarioResult:
    """One scenario's figures from its samples (latency of the completed requests only)."""
    samples = stream.samples()
    good = [s for s in samples if s.ok]
    lat = np.array([s.latency_s * 1e3 for s in good])
    edges = np.geomspace(max(lat.min(), 1e-3), max(lat.max(), lat.min() * 1.01, 1e-3), 21)
    counts, _ = np.histogram(lat, bins=edges)
    pct = {q: float(np.percentile(lat, q)) for q in (50, 90, 95, 99)}
    stalls = lat[lat >= max(STALL_MIN_S * 1e3, STALL_FACTOR * pct[50])]
    if interleaved:  # the time slots as measured: block i of every path shares slot i
        kept = [[round(s.latency_s * 1e3, 4) for s in b if s.ok] for b in stream.blocks]
    else:
        kept = split_blocks([round(float(v), 4) for v in lat], blocks)
    return ScenarioResult(
        scenario=name,
        batch_size=stream.batch,
        concurrency=concurrency,
        iterations=len(good),
        seconds=stream.seconds,
        p50_ms=pct[50],
        p90_ms=pct[90],
        p95_ms=pct[95],
        p99_ms=pct[99],
        mean_ms=float(lat.mean()),
        compute_p50_ms=float(np.percentile([s.compute_us / 1e3 for s in good], 50)),
        throughput=len(good) * stream.batch / stream.seconds,
        throughput_unit="samples/s",
        input_sizes=sizes,
        histogram_ms=[float(e) for e in edges],
        histogram_counts=[int(c) for c in counts],
        failed=len(samples) - len(good),
        stalled=len(stalls),
        longest_stall_ms=float(stalls.max()) if len(stalls) else 0.0,
        blocks_ms=_blocks(name, kept),
    )


def _fault(path: str, scenarios: list[ScenarioResult]) -> str:
    """What a fault during the measurement did to the path ("" when nothing failed or stalled)."""
    failed, stalled = sum(s.failed for s in scenarios), sum(s.stalled for s in scenarios)
    if not failed and not stalled:
        return ""
    longest = max(s.longest_stall_ms for s in scenarios) / 1e3
    effects = ([f"{failed} requests failed"] if failed else []) + (
        [f"{stalled} stalled for up to {longest:.1f} s"] if stalled else []
    )
    where = ", ".join(f"{s.scenario} batch {s.batch_size}" for s in scenarios if s.failed or s.stalled)
    return (
        f"path {path}: {' and '.join(effects)} during measurement ({where}); the timings are not steady state"
    )


def _blocks(name: str, blocks: list[list[float]]) -> list[list[float]]:
    """Single-stream latencies in blocks for the verdict's intervals, each block thinned to at
    most BLOCK_SAMPLES values: a fast model's thousands of requests would otherwise carry the
    report past Temporal's payload limit. Other scenarios are not judged on them."""
    if name != "single-stream":
        return []
    return [thin(b, BLOCK_SAMPLES) for b in blocks]


def _outputs(response: oip.ModelInferResponse) -> list[TensorData]:
    """An answer's tensors to check; none (not checked) when too large to carry."""
    try:
        return payloads.outputs_of(response)
    except ApplicationError:
        return []


class _Beat:
    """The heartbeat while measuring, at most every BEAT_S: every path's progress, so a retry
    resumes at the first unfinished scenario, and what an operator reads in the UI."""

    def __init__(self, progress: list[_Progress], scenario: str, batch: int, attempt: int) -> None:
        self.progress, self.scenario, self.batch, self.attempt = progress, scenario, batch, attempt
        self.last = time.perf_counter()
        self.done: dict[str, int] = {}

    def due(self) -> bool:
        return time.perf_counter() - self.last >= BEAT_S

    def send(self, path: str = "", done: int = 0) -> None:
        self.last = time.perf_counter()
        if path:
            self.done[path] = done
        activity.heartbeat(self.details())

    def details(self) -> dict[str, Any]:
        paths = {p.request.target.path: {**p.state(), "done": self.done.get(p.request.target.path, 0)}
                 for p in self.progress}  # fmt: skip
        plan = self.progress[0].request.plan
        return {
            "phase": "performance",
            "scenario": self.scenario,
            "batch": self.batch,
            "target": plan.min_iterations,
            "attempt": self.attempt,
            "paths": paths,
        }


# One block of a path: at least `size` (requests, seconds) at `concurrency` (PerformanceActivities._block).
Block = Callable[["_Stream", "_Progress", int, tuple[int, float], "_Beat"], Awaitable[None]]


class PerformanceActivities:
    def __init__(self, connections: Connections, clock: Clock = time.time) -> None:
        self.connections = connections
        self.clock = clock

    async def _memory(self, request: PerformanceRequest) -> tuple[int, int]:
        """Device memory total and available now (Describe); sampled during measurement."""
        d = await describer(self.connections, request.target)()
        if d is None:  # memory is a side figure: a failed sample is skipped, not fatal
            return 0, 0
        return int(d.device.memory_total_bytes), int(d.device.memory_available_bytes)

    async def _sample_memory(self, progress: _Progress) -> None:
        """Keep the lowest available memory seen (in the heartbeat state: it survives a retry)."""
        _, available = await self._memory(progress.request)
        if available:
            progress.memory_min_available = min(progress.memory_min_available or available, available)

    async def _compilations(self, request: PerformanceRequest) -> int:
        t = request.target
        with grpc_errors(f"ModelStatus of {t.model} on {t.path}"):
            status = await self.connections.control(t.executor).ModelStatus(
                xpb.ModelStatusRequest(model_name=t.model, version=t.version), timeout=30
            )
        if not status.models:
            raise ApplicationError(
                f"{t.model} is not loaded on {t.path}", type="NotLoaded", non_retryable=True
            )
        c = status.models[0].compatibility
        return int(c.compilations_after_warmup + c.recompiles)

    @activity.defn(name="measure_performance")
    async def measure_performance(self, request: PerformanceRequest) -> PerformanceResult:
        """One path alone: each scenario measured in one go, then cut into blocks."""
        return (await self._measure([request], interleaved=False))[0]

    @activity.defn(name="measure_interleaved")
    async def measure_interleaved(self, request: InterleavedRequest) -> InterleavedResult:
        """Paths that share a host, in alternating blocks of every scenario (module doc)."""
        return InterleavedResult(await self._measure(request.paths, True, request.extension))

    async def _measure(
        self, requests: list[PerformanceRequest], interleaved: bool, rule: ExtensionRule | None = None
    ) -> list[PerformanceResult]:
        info = activity.info()
        resumed: dict[str, Any] = dict(info.heartbeat_details[0]) if info.heartbeat_details else {}
        saved = resumed.get("paths", {})
        progress = [await self._resume(r, saved.get(r.target.path, {})) for r in requests]
        plan = requests[0].plan
        for name, batch, concurrency in _scenarios(plan):
            todo = [p for p in progress if not p.finished(name, batch)]
            if not todo:
                continue
            beat = _Beat(progress, name, batch, info.attempt)
            streams = [_stream(self.connections, self.clock, p.request, batch) for p in todo]
            paths = list(zip(streams, todo, strict=True))
            await self._run(paths, concurrency, plan, interleaved, beat)
            record = await _extend(rule, paths, plan, self._block, beat) if name == "single-stream" else None
            # Recording the jobs and checking the answers under load can take seconds: the
            # worker heartbeats meanwhile, with the details from before (a retry still redoes
            # the scenario whole), or a short heartbeat timeout retries a live worker.
            before = beat.details()
            for stream, p in paths:
                finish = self._finish(p, stream, name, batch, concurrency, interleaved, info.attempt)
                await heartbeating(finish, before.copy)
                extension.attach(p.done, record)
            if all(p.problem for p in progress):  # nothing left to measure: retry the activity
                raise ApplicationError("; ".join(p.problem for p in progress), type="AllFailed")
            beat.send()
        return [await self._result(p) for p in progress]

    async def _resume(self, request: PerformanceRequest, saved: dict[str, Any]) -> _Progress:
        """A path's progress from a retried attempt's heartbeat, or a fresh one."""
        if "compilations_before" in saved:
            before = int(saved["compilations_before"])
        else:
            before = await self._compilations(request)
        progress = _Progress(
            request,
            before,
            [extension.restored(s) for s in saved.get("completed") or []],
            int(saved.get("busy_us") or 0),
            int(saved.get("jobs") or 0),
            int(saved.get("memory_min_available") or 0),
            problem=str(saved.get("problem") or ""),
            memory_steps=[[int(v) for v in row] for row in saved.get("memory_steps") or []],
            device_reported=bool(saved.get("device_reported")),
        )
        if request.criteria is not None:
            progress.check = UnderLoad(skipped=request.under_load_skip)
            if progress.done:
                why = [progress.check.skipped, "resumed scenarios not checked"]
                progress.check.skipped = "; ".join(filter(None, why))
        return progress

    async def _run(
        self,
        paths: list[tuple[_Stream, _Progress]],
        concurrency: int,
        plan: PerformancePlan,
        interleaved: bool,
        beat: _Beat,
    ) -> None:
        """Warm every path up, then measure: alone in one go, or in alternating blocks, each
        block after the first led by one unmeasured request (the switch's cold caches)."""
        for stream, _ in paths:
            for _ in range(plan.warmup):
                await stream.call(-1)
        if not interleaved:
            stream, progress = paths[0]
            await self._block(stream, progress, concurrency, (plan.min_iterations, plan.min_seconds), beat)
            return
        count, seconds = math.ceil(plan.min_iterations / plan.blocks), plan.min_seconds / plan.blocks
        await _alternate(paths, range(plan.blocks), concurrency, (count, seconds), self._block, beat)

    async def _block(
        self, stream: _Stream, progress: _Progress, concurrency: int, size: tuple[int, float], beat: _Beat
    ) -> None:
        """Measure one block of a path: at least `count` requests and `seconds` long, its
        process memory sampled at its edges and every share of the plan within it."""
        count, seconds = size
        plan = progress.request.plan
        share = (math.ceil(plan.min_iterations / plan.blocks), plan.min_seconds / plan.blocks)
        meter = Meter(describer(self.connections, progress.request.target), progress.memory_steps, *share)
        samples: list[_Sample] = []
        stream.blocks.append(samples)
        await meter.sample(0)
        begin = time.perf_counter()

        def satisfied() -> bool:
            return len(samples) >= count and time.perf_counter() - begin >= seconds

        async def worker() -> None:
            while not satisfied():
                samples.append(await stream.call(next(stream.measured)))
                if not satisfied() and meter.due(len(samples)):
                    await meter.sample(len(samples))
                if beat.due():
                    await self._sample_memory(progress)
                    beat.send(progress.request.target.path, sum(len(b) for b in stream.blocks))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        stream.seconds += time.perf_counter() - begin
        await meter.sample(len(samples))
        progress.device_reported = progress.device_reported or meter.device_reported
        if meter.lowest_available:
            low = progress.memory_min_available or meter.lowest_available
            progress.memory_min_available = min(low, meter.lowest_available)

    async def _finish(
        self,
        progress: _Progress,
        stream: _Stream,
        name: str,
        batch: int,
        concurrency: int,
        interleaved: bool,
        attempt: int,
    ) -> None:
        """A path's scenario done: its figures, its answers under load checked, its jobs."""
        request, samples = progress.request, stream.samples()
        await _record(self.connections, request, name, batch, attempt, samples)
        progress.busy_us += sum(s.compute_us for s in samples)
        progress.jobs += len(samples)
        if not any(s.ok for s in samples):
            progress.problem = f"every request of {name} batch {batch} on {request.target.path} failed"
            return
        sizes = payloads.sizes(stream.inputs)
        progress.done.append(_summary(name, concurrency, stream, sizes, request.plan.blocks, interleaved))
        kept = {i: a for i, a in stream.kept.items() if a}
        await _answers(self.connections, request, batch, kept, progress.answers, progress.check)
        if progress.check is not None:
            progress.check.measured += sum(s.ok for s in samples)

    async def _result(self, progress: _Progress) -> PerformanceResult:
        p, request = progress, progress.request
        if p.problem:
            return PerformanceResult(
                p.done, p.before, p.before, p.busy_us, p.jobs, False, p.problem, 0, 0, p.answers, p.check,
                memory_steps=p.memory_steps, memory_device_reported=p.device_reported,
            )  # fmt: skip
        after = await self._compilations(request)
        total, low = await self._memory(request)
        lowest = min(low, p.memory_min_available or low)
        problem = _fault(request.target.path, p.done)
        if after != p.before:
            problem = (
                f"{after - p.before} compilation(s) or recompile(s) while measuring; "
                "the timings are not steady state"
            ) + (f"; {problem}" if problem else "")
        return PerformanceResult(
            p.done,
            p.before,
            after,
            p.busy_us,
            p.jobs,
            not problem,
            problem,
            total,
            lowest,
            p.answers,
            p.check,
            memory_steps=p.memory_steps,
            memory_device_reported=p.device_reported,
        )


async def _alternate(
    paths: list[tuple[_Stream, _Progress]],
    slots: Iterable[int],
    concurrency: int,
    size: tuple[int, float],
    block: Block,
    beat: _Beat,
) -> None:
    """In each slot one block of every path in turn, the order reversed every other slot (AB,
    BA, ...); a block after the first led by one unmeasured request (the switch's cold caches)."""
    for slot in slots:
        for stream, progress in paths if slot % 2 == 0 else paths[::-1]:
            if slot:
                await stream.call(-1)
            await block(stream, progress, concurrency, size, beat)


async def _extend(
    rule: ExtensionRule | None,
    paths: list[tuple[_Stream, _Progress]],
    plan: PerformancePlan,
    block: Block,
    beat: _Beat,
) -> Extension | None:
    """More paired single-stream blocks while a latency interval straddles its bound
    (workflows/tensor/extension.py), the alternation continued where the plan left it."""
    names = [p.request.target.path for _, p in paths]
    if rule is None or not rule.max_extra_requests or rule.reference not in names or len(names) < 2:
        return None
    slots = itertools.count(plan.blocks)

    def blocks() -> dict[str, list[list[float]]]:
        return {n: [[round(s.latency_s * 1e3, 4) for s in b if s.ok] for b in stream.blocks]
                for n, (stream, _) in zip(names, paths, strict=True)}  # fmt: skip

    async def measure(step: extension.Round) -> None:
        await _alternate(paths, itertools.islice(slots, step.slots), 1, (step.size, 0.0), block, beat)

    return await extension.extend(rule, blocks, measure, BLOCK_SAMPLES)


async def _answers(
    connections: Connections,
    request: PerformanceRequest,
    batch: int,
    kept: dict[int, list[TensorData]],
    answers: dict[str, list[TensorData]],
    check: UnderLoad | None,
) -> None:
    """Keep the first answer per batch size (the reference's), or check the kept answers
    against the reference's (a candidate's), by the correctness phase's Compare."""
    if request.inputs.workload:
        return
    if check is None:
        first = kept.get(min(kept)) if kept else None
        if first is not None:
            answers.setdefault(str(batch), first)
        return
    theirs, criteria = request.reference_answers.get(str(batch)), request.criteria
    if theirs is None or criteria is None:
        if not request.under_load_skip:
            check.skipped = f"not checked under load at batch {batch}: no reference answer"
        return
    comparison = ComparisonActivities(connections)
    for index in sorted(kept):
        compare = CompareRequest(request.target, criteria, theirs, kept[index])
        under_load.record(check, index, batch, await comparison.compare_outputs(compare))


def _stream(connections: Connections, clock: Clock, request: PerformanceRequest, batch: int) -> _Stream:
    """How one path sends a scenario's requests, keeping a seeded share of its answers."""
    t = request.target
    stub = connections.oip(t.executor)
    if request.inputs.workload:  # the captured requests in order, cycling, with their shapes
        replay = payloads.workload_requests(request.inputs)
        messages = [payloads.retarget(r, t.model, t.version) for r in replay]
        inputs = payloads.make_inputs(request.inputs)
        batch = max(1, round(sum(int(r.inputs[0].shape[0]) for r in replay) / len(replay)))
    else:
        inputs = payloads.make_inputs(request.inputs, batch)
        messages = [payloads.infer_request(t.model, t.version, inputs)]
    turn = itertools.count()
    kept: dict[int, list[TensorData]] = {}
    wanted = 1 if request.criteria is None else under_load.MAX_CHECKED

    async def call(index: int) -> _Sample:
        start_us = int(clock() * 1e6)
        t0 = time.perf_counter()
        message = messages[next(turn) % len(messages)]
        try:
            response: oip.ModelInferResponse = await stub.ModelInfer(message, timeout=60)
        except Exception:  # a failed request is a failed job, counted, not a crash
            return _Sample(start_us, int(clock() * 1e6), time.perf_counter() - t0, 0, False)
        latency = time.perf_counter() - t0
        if index >= 0 and len(kept) < wanted and under_load.chosen(index, request.inputs.seed, len(kept)):
            kept[index] = _outputs(response)
        compute = response.parameters.get("compute_us")
        end_us = max(int(clock() * 1e6), start_us)
        busy = min(compute.int64_param if compute is not None else int(latency * 1e6), end_us - start_us)
        return _Sample(start_us, end_us, latency, busy, True)

    return _Stream(call, inputs, batch, kept)


async def _record(
    connections: Connections,
    request: PerformanceRequest,
    name: str,
    batch: int,
    attempt: int,
    samples: list[_Sample],
) -> None:
    """Each request is a job of the path; keys from the run id make a retry idempotent."""
    t = request.target
    if not request.ledger:
        return
    run = activity.info().workflow_run_id
    events = [
        usage_event(
            t,
            f"{run}/{t.path}/{name}-b{batch}/a{attempt}/{i}",
            "trial",
            status="completed" if s.ok else "failed",
            met_quality=s.ok and request.met_quality,
            busy_us=s.compute_us,
            started_unix_us=s.started_us,
            ended_unix_us=s.ended_us,
            tags={"scenario": name, "batch_size": str(batch)},
            prompt_tokens=s.prompt_tokens,
            output_tokens=s.output_tokens,
        )
        for i, s in enumerate(samples)
    ]
    await send_usage(connections, t, events)
