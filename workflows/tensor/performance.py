"""The performance phase: warm-up, then single-stream and offline scenarios until both the
minimum iteration count and the minimum duration are met, with proof that nothing compiled.

Each request is one job in the ledger (kind "trial"), recorded at the end of its scenario
with an idempotency key from the workflow run, so a retried activity never double counts.
Finished scenarios are kept in the heartbeat details: if the worker dies mid-measurement,
the retry resumes at the first unfinished scenario instead of measuring everything again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from typing import Any

import numpy as np
from temporalio import activity
from temporalio.exceptions import ApplicationError

from switchyard.gen.inference import grpc_service_pb2 as oip
from switchyard.gen.switchyard.v1 import executor_pb2 as xpb
from workflows.activities import payloads
from workflows.activities.connections import Connections, grpc_errors
from workflows.activities.path import Clock
from workflows.activities.trial_ledger import send_usage, usage_event
from workflows.pipeline.types import (
    CompareRequest,
    PerformanceRequest,
    PerformanceResult,
    ScenarioResult,
    TensorData,
    UnderLoad,
)
from workflows.tensor import under_load
from workflows.tensor.comparison import ComparisonActivities
from workflows.tensor.intervals import split_blocks, thin

BLOCK_SAMPLES = 200  # values kept per block: 10 blocks of single-stream are about 16 KB of JSON


@dataclasses.dataclass
class _Sample:
    started_us: int
    ended_us: int
    latency_s: float
    compute_us: int
    ok: bool
    prompt_tokens: int = 0  # a generation request's tokens, metered with it (0 otherwise)
    output_tokens: int = 0


def _summary(
    name: str,
    batch: int,
    concurrency: int,
    samples: list[_Sample],
    elapsed: float,
    sizes: dict[str, list[int]],
    blocks: int,
) -> ScenarioResult:
    """One scenario's figures from its samples (latency of the completed requests only)."""
    good = [s for s in samples if s.ok]
    lat = np.array([s.latency_s * 1e3 for s in good])
    edges = np.geomspace(max(lat.min(), 1e-3), max(lat.max(), lat.min() * 1.01, 1e-3), 21)
    counts, _ = np.histogram(lat, bins=edges)
    pct = {q: float(np.percentile(lat, q)) for q in (50, 90, 95, 99)}
    return ScenarioResult(
        scenario=name,
        batch_size=batch,
        concurrency=concurrency,
        iterations=len(good),
        seconds=elapsed,
        p50_ms=pct[50],
        p90_ms=pct[90],
        p95_ms=pct[95],
        p99_ms=pct[99],
        mean_ms=float(lat.mean()),
        compute_p50_ms=float(np.percentile([s.compute_us / 1e3 for s in good], 50)),
        throughput=len(good) * batch / elapsed,
        throughput_unit="samples/s",
        input_sizes=sizes,
        histogram_ms=[float(e) for e in edges],
        histogram_counts=[int(c) for c in counts],
        failed=len(samples) - len(good),
        blocks_ms=_blocks(name, [round(float(v), 4) for v in lat], blocks),
    )


def _blocks(name: str, latencies: list[float], blocks: int) -> list[list[float]]:
    """Single-stream latencies in blocks for the verdict's intervals, each block thinned to at
    most BLOCK_SAMPLES values: a fast model's thousands of requests would otherwise carry the
    report past Temporal's payload limit. Other scenarios are not judged on them."""
    if name != "single-stream":
        return []
    return [thin(b, BLOCK_SAMPLES) for b in split_blocks(latencies, blocks)]


def _outputs(response: oip.ModelInferResponse) -> list[TensorData]:
    """An answer's tensors to check; none (not checked) when too large to carry."""
    try:
        return payloads.outputs_of(response)
    except ApplicationError:
        return []


class PerformanceActivities:
    def __init__(self, connections: Connections, clock: Clock = time.time) -> None:
        self.connections = connections
        self.clock = clock

    async def _memory(self, request: PerformanceRequest) -> tuple[int, int]:
        """Device memory total and available now (Describe); sampled during measurement."""
        t = request.target
        try:
            d = await self.connections.control(t.executor).Describe(xpb.DescribeRequest(), timeout=10)
        except Exception:  # memory is a side figure: a failed sample is skipped, not fatal
            return 0, 0
        return int(d.device.memory_total_bytes), int(d.device.memory_available_bytes)

    async def _sample_memory(self, request: PerformanceRequest, state: dict[str, Any]) -> None:
        """Keep the lowest available memory seen in the heartbeat state (it survives a retry)."""
        _, available = await self._memory(request)
        if available:
            state["memory_min_available"] = min(
                int(state.get("memory_min_available") or available), available
            )

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
        info = activity.info()
        resumed: dict[str, Any] = dict(info.heartbeat_details[0]) if info.heartbeat_details else {}
        done = [ScenarioResult(**s) for s in resumed.get("completed", [])]
        before = int(resumed["compilations_before"]) if "compilations_before" in resumed else None
        if before is None:
            before = await self._compilations(request)
        plan = request.plan
        scenarios: list[tuple[str, int, int]] = []
        if "single-stream" in plan.scenarios:
            scenarios.append(("single-stream", 1, 1))
        if "offline" in plan.scenarios:
            scenarios += [("offline", b, plan.offline_concurrency) for b in plan.batch_sizes]
        memory = {"memory_min_available": resumed.get("memory_min_available", 0)}
        busy = int(resumed.get("busy_us", 0))
        jobs = int(resumed.get("jobs", 0))
        answers: dict[str, list[TensorData]] = {}
        check = UnderLoad(skipped=request.under_load_skip) if request.criteria is not None else None
        if check is not None and done:
            check.skipped = "; ".join(filter(None, [check.skipped, "resumed scenarios not checked"]))
        for name, batch, concurrency in scenarios:
            if any(s.scenario == name and s.batch_size == batch for s in done):
                continue
            state: dict[str, Any] = {
                "phase": "performance",
                "path": request.target.path,
                "scenario": name,
                "batch": batch,
                "done": 0,
                "target": plan.min_iterations,
                "compilations_before": before,
                "completed": [dataclasses.asdict(s) for s in done],
                "busy_us": busy,
                "jobs": jobs,
                "attempt": info.attempt,
                **memory,
            }
            result, samples, kept = await self._scenario(request, name, batch, concurrency, state)
            await self._answers(request, batch, kept, answers, check)
            if check is not None:
                check.measured += sum(s.ok for s in samples)
            await self._record(request, name, batch, info.attempt, samples)
            busy += sum(s.compute_us for s in samples)
            jobs += len(samples)
            done.append(result)
            memory["memory_min_available"] = state.get("memory_min_available", 0)
            state.update(completed=[dataclasses.asdict(s) for s in done], busy_us=busy, jobs=jobs)
            activity.heartbeat(state)
        after = await self._compilations(request)
        total, low = await self._memory(request)
        lowest = min(low, int(memory.get("memory_min_available") or low))
        problem = ""
        if after != before:
            problem = (
                f"{after - before} compilation(s) or recompile(s) while measuring; "
                "the timings are not steady state"
            )
        return PerformanceResult(
            done, before, after, busy, jobs, not problem, problem, total, lowest, answers, check
        )

    async def _answers(
        self,
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
        comparison = ComparisonActivities(self.connections)
        for index in sorted(kept):
            compare = CompareRequest(request.target, criteria, theirs, kept[index])
            under_load.record(check, index, batch, await comparison.compare_outputs(compare))

    async def _scenario(
        self, request: PerformanceRequest, name: str, batch: int, concurrency: int, state: dict[str, Any]
    ) -> tuple[ScenarioResult, list[_Sample], dict[int, list[TensorData]]]:
        t, plan = request.target, request.plan
        stub = self.connections.oip(t.executor)
        if request.inputs.workload:  # the captured requests in order, cycling, with their shapes
            replay = payloads.workload_requests(request.inputs)
            messages = [payloads.retarget(r, t.model, t.version) for r in replay]
            inputs = payloads.make_inputs(request.inputs)
            batch = max(1, round(sum(int(r.inputs[0].shape[0]) for r in replay) / len(replay)))
        else:
            inputs = payloads.make_inputs(request.inputs, batch)
            messages = [payloads.infer_request(t.model, t.version, inputs)]
        turn, measured = itertools.count(), itertools.count()
        kept: dict[int, list[TensorData]] = {}  # answers under load to check, by request index
        wanted = 1 if request.criteria is None else under_load.MAX_CHECKED

        async def call(index: int = -1) -> _Sample:
            start_us = int(self.clock() * 1e6)
            t0 = time.perf_counter()
            message = messages[next(turn) % len(messages)]
            try:
                response: oip.ModelInferResponse = await stub.ModelInfer(message, timeout=60)
            except Exception:  # a failed request is a failed job, counted, not a crash
                return _Sample(start_us, int(self.clock() * 1e6), time.perf_counter() - t0, 0, False)
            latency = time.perf_counter() - t0
            if index >= 0 and len(kept) < wanted and under_load.chosen(index, request.inputs.seed, len(kept)):
                kept[index] = _outputs(response)
            compute = response.parameters.get("compute_us")
            end_us = max(int(self.clock() * 1e6), start_us)
            busy = min(compute.int64_param if compute is not None else int(latency * 1e6), end_us - start_us)
            return _Sample(start_us, end_us, latency, busy, True)

        for _ in range(plan.warmup):
            await call()
        samples: list[_Sample] = []
        begin = time.perf_counter()
        last_beat = begin

        def satisfied() -> bool:
            enough = len(samples) >= plan.min_iterations
            return enough and time.perf_counter() - begin >= plan.min_seconds

        async def worker() -> None:
            nonlocal last_beat
            while not satisfied():
                samples.append(await call(next(measured)))
                if time.perf_counter() - last_beat >= 0.5:
                    last_beat = time.perf_counter()
                    state.update(done=len(samples), elapsed_s=round(last_beat - begin, 2))
                    await self._sample_memory(request, state)
                    activity.heartbeat(state)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - begin
        if not any(s.ok for s in samples):
            raise ApplicationError(
                f"every request of {name} batch {batch} on {t.path} failed", type="AllFailed"
            )
        sizes = payloads.sizes(inputs)
        kept = {i: a for i, a in kept.items() if a}
        return _summary(name, batch, concurrency, samples, elapsed, sizes, plan.blocks), samples, kept

    async def _record(
        self, request: PerformanceRequest, name: str, batch: int, attempt: int, samples: list[_Sample]
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
        await send_usage(self.connections, t, events)
