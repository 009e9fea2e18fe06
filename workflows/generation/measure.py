"""The generation scenario's measurement: every load level's requests streamed to one path
alone, or to the paths that share a host in alternating blocks, as tensors are measured
(workflows/tensor/performance.py); every request a job with its tokens.

A level's requests are cut into blocks of consecutive requests, as many as `plan.blocks`
allows with enough requests in each to hold the level's load (`per_block`: a block of 3
requests at concurrency 4 would measure concurrency 3); a level with too few requests for
MIN_BLOCKS such blocks is measured in one block, and its verdict has no interval. Alone, a path sends its
blocks one after the other. Interleaved, in each slot every path sends that block (the same
prompts and lengths on every path) under the level's load, the order reversed every other
slot (AB, BA, ...), so a change of the host's load lands on all of them alike and block i of
each path is paired with block i of the others in time. Each block keeps its TTFT and TPOT
samples (`blocks` of the level's summary, thinned like the tensor blocks) for the verdict's
paired-bootstrap intervals (workflows/tensor/intervals.py).

Finished levels are kept in the heartbeat details: a retry resumes at the first unfinished
level. Each request's ledger key carries the run, level and attempt, so a retry never double
counts.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError

from switchyard.gen.switchyard.v1 import executor_pb2 as xpb
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
from workflows.activities.connections import Connections, grpc_errors
from workflows.activities.path import Clock, heartbeating, now_us
from workflows.activities.trial_ledger import send_usage
from workflows.generation import load as genload
from workflows.generation.activities import generation_requests, load_levels, stream_to
from workflows.generation.metrics import RequestRecord, Slo, load_label, summarize
from workflows.generation.types import (
    GenerationInterleavedRequest,
    GenerationInterleavedResult,
    GenerationPerformanceRequest,
    GenerationPerformanceResult,
)
from workflows.pipeline.types import Target
from workflows.tensor.intervals import MIN_BLOCKS, thin

BLOCK_SAMPLES = 200  # values kept per block and metric (as the tensor blocks)
POISSON_BLOCK = 4  # requests a block of Poisson arrivals holds at least


def per_block(load: dict[str, Any]) -> int:
    """The fewest requests a block of the level needs to hold its load: the concurrency of a
    closed loop; for Poisson arrivals, a second of them at the rate (at least POISSON_BLOCK,
    and the cap on requests in flight)."""
    if load.get("arrival") == "poisson":
        rate = float(load["request_rate"])
        return max(math.ceil(rate), int(load.get("max_concurrency") or 0), POISSON_BLOCK)
    return max(int(load.get("concurrency") or 1), 1)


def block_count(requests: int, load: dict[str, Any], wanted: int) -> int:
    """Blocks for a level: at most `wanted`, each holding at least `per_block` requests; 1
    when fewer than MIN_BLOCKS fit (no interval: the verdict compares the two figures)."""
    fits = min(wanted, requests // per_block(load))
    return fits if fits >= MIN_BLOCKS else 1


def slices(count: int, blocks: int) -> list[range]:
    """`count` request indices in `blocks` consecutive runs of near-equal size."""
    size, extra = divmod(count, blocks)
    out, start = [], 0
    for i in range(blocks):
        end = start + size + (1 if i < extra else 0)
        out.append(range(start, end))
        start = end
    return out


def block_samples(records: list[RequestRecord]) -> dict[str, list[float]]:
    """A block's TTFT and TPOT samples in milliseconds (completed requests; TPOT of those with
    more than one output token), thinned to BLOCK_SAMPLES."""
    done = [r for r in records if r.ok and r.chunk_s]
    ttft = [round(r.ttft_s * 1e3, 4) for r in done]
    tpot = [round(t * 1e3, 4) for r in done if (t := r.tpot_s) is not None]
    return {"ttft_ms": thin(ttft, BLOCK_SAMPLES), "tpot_ms": thin(tpot, BLOCK_SAMPLES)}


@dataclass
class _Path:
    """One path's side of a measurement: its request, stream and the levels it finished."""

    request: GenerationPerformanceRequest
    requests: list[genload.GenRequest]
    done: list[dict[str, Any]]
    before: int = -1  # compilations after its warm-up

    @property
    def target(self) -> Target:
        return self.request.target


class GenerationMeasurement:
    def __init__(self, connections: Connections, clock: Clock = time.time) -> None:
        self.connections = connections
        self.clock = clock

    @activity.defn(name="measure_generation")
    async def measure_generation(self, request: GenerationPerformanceRequest) -> GenerationPerformanceResult:
        """One path alone: each level's blocks one after the other."""
        (result,) = await self._measure([request], interleaved=False)
        return result

    @activity.defn(name="measure_generation_interleaved")
    async def measure_generation_interleaved(
        self, request: GenerationInterleavedRequest
    ) -> GenerationInterleavedResult:
        """Paths that share a host, in alternating blocks of every level (module doc)."""
        return GenerationInterleavedResult(await self._measure(request.paths, interleaved=True))

    async def _measure(
        self, requests: list[GenerationPerformanceRequest], interleaved: bool
    ) -> list[GenerationPerformanceResult]:
        info = activity.info()
        details = info.heartbeat_details
        saved: list[dict[str, Any]] = list(dict(details[0]).get("paths", [])) if details else []
        paths = [self._path(r, saved[i] if i < len(saved) else {}) for i, r in enumerate(requests)]
        for p in paths:
            if p.before < 0:
                await self._warm(p)
        g = requests[0].plan.generation
        assert g is not None  # _path refused a plan without one
        for level in load_levels(g):
            if any(d["load"] == level for d in paths[0].done):
                continue
            await self._level(paths, level, interleaved, g.seed)
            self._beat(paths, {"phase": "performance", "completed": load_label(level)})
        return [await self._result(p) for p in paths]

    @staticmethod
    def _beat(paths: list[_Path], progress: dict[str, Any]) -> None:
        activity.heartbeat(GenerationMeasurement._details(paths, progress))

    @staticmethod
    def _details(paths: list[_Path], progress: dict[str, Any]) -> dict[str, Any]:
        """Progress, with what a retry resumes from: each path's finished levels."""
        resume = [{"completed": list(p.done), "compilations_before": p.before} for p in paths]
        return {**progress, "paths": resume}

    def _path(self, request: GenerationPerformanceRequest, saved: dict[str, Any]) -> _Path:
        g = request.plan.generation
        if g is None:
            raise ApplicationError("the performance plan has no generation scenario", non_retryable=True)
        done = list(saved.get("completed", []))
        before = int(saved.get("compilations_before", -1))
        return _Path(request, generation_requests(g, request.token_range), done, before)

    async def _warm(self, p: _Path) -> None:
        """The path's own warm-up: not measured, not a job."""
        t = p.request.target
        stub = self.connections.oip(t.executor)
        for w in range(p.request.plan.warmup):
            message = genload.infer_request(t.model, t.version, p.requests[w % len(p.requests)], False)
            with grpc_errors(f"warm-up generation on {t.path}"):
                await stub.ModelInfer(message, timeout=120)
        p.before = await self._compilations(p)

    async def _level(self, paths: list[_Path], level: dict[str, Any], interleaved: bool, seed: int) -> None:
        """Every path's blocks of one level (module doc), then each path's summary of it."""
        label = load_label(level)
        count = len(paths[0].requests)
        blocks = block_count(count, level, paths[0].request.plan.blocks)
        records: list[list[list[RequestRecord]]] = [[] for _ in paths]  # per path, per block
        seconds = [0.0 for _ in paths]  # each path's own time under load (its blocks only)
        start_us, begin = now_us(self.clock), time.perf_counter()
        streams = [stream_to(self.connections.oip(p.target.executor), p.target, label) for p in paths]
        order = list(range(len(paths)))
        for slot, indices in enumerate(slices(count, blocks)):
            for k in order if not interleaved or slot % 2 == 0 else order[::-1]:
                chosen = [paths[k].requests[i] for i in indices]
                offset = time.perf_counter() - begin
                got, took = await genload.run_load(streams[k], chosen, level, seed + slot)
                for r in got:  # times from the level's start, not the block's
                    r.sent_s, r.chunk_s = r.sent_s + offset, [c + offset for c in r.chunk_s]
                records[k].append(got)
                seconds[k] += took
                self._beat(paths, {"phase": "performance", "load": label, "block": slot + 1, "of": blocks})
        # Recording the jobs can take seconds: heartbeat meanwhile with the details from before
        # (a retry still redoes the level whole), as the tensor measurement does.
        before = self._details(paths, {"phase": "performance", "load": label, "block": blocks, "of": blocks})
        for p, per_block, took in zip(paths, records, seconds, strict=True):
            pooled = [r for b in per_block for r in b]
            summary = summarize(pooled, took, level, Slo(**p.request.slo))
            summary["started_unix_us"] = start_us
            summary["blocks"] = [block_samples(b) for b in per_block] if blocks > 1 else []
            summary["interleaved"] = interleaved and len(paths) > 1
            await heartbeating(self._record(p.request, label, pooled, start_us), before.copy)
            p.done.append(summary)

    async def _compilations(self, p: _Path) -> int:
        t = p.request.target
        with grpc_errors(f"ModelStatus of {t.model} on {t.path}"):
            status = await self.connections.control(t.executor).ModelStatus(
                xpb.ModelStatusRequest(model_name=t.model, version=t.version), timeout=30
            )
        if not status.models:
            raise ApplicationError(f"{t.model} is not loaded on {t.path}", non_retryable=True)
        c = status.models[0].compatibility
        return int(c.compilations_after_warmup + c.recompiles)

    async def _result(self, p: _Path) -> GenerationPerformanceResult:
        after = await self._compilations(p)
        problem = ""
        if after != p.before:
            problem = (
                f"{after - p.before} compilation(s) or recompile(s) while measuring; "
                "the timings are not steady state"
            )
        done = p.done
        if not any(d["completed"] for d in done):
            raise ApplicationError(
                f"every generation request on {p.target.path} failed: {done[0]['errors']}", type="AllFailed"
            )
        return GenerationPerformanceResult(
            levels=done,
            compilations_before=p.before,
            compilations_after=after,
            busy_us=sum(int(d["compute_us"]) for d in done),
            jobs=sum(int(d["requests"]) for d in done),
            prompt_tokens=sum(int(d["input_tokens"]["total"]) for d in done),
            output_tokens=sum(int(d["output_tokens"]["total"]) for d in done),
            ok=not problem,
            problem=problem,
        )

    async def _record(
        self, request: GenerationPerformanceRequest, label: str, records: list[RequestRecord], start_us: int
    ) -> None:
        """Each generation is a job with its tokens; keys from the run id make a retry idempotent."""
        t = request.target
        if not request.ledger:
            return
        run, attempt = activity.info().workflow_run_id, activity.info().attempt
        ended = now_us(self.clock)
        events = [
            mpb.UsageEvent(
                idempotency_key=f"{run}/{t.path}/generation/{label}/a{attempt}/{i}",
                path=t.ledger_path,
                model=t.model,
                model_version=t.version,
                team=t.team,
                kind="trial",
                status="completed" if r.ok else "failed",
                met_quality=r.ok,
                busy_us=r.compute_us,
                started_unix_us=start_us + int(r.sent_s * 1e6),
                ended_unix_us=min(ended, start_us + int((r.chunk_s[-1] if r.chunk_s else r.sent_s) * 1e6)),
                trial_id=t.trial_id,
                arm=t.path,
                tags={"scenario": "generation", "load": label},
                prompt_tokens=r.prompt_tokens,
                output_tokens=r.output_tokens,
            )
            for i, r in enumerate(records)
        ]
        await send_usage(self.connections, t, events)
