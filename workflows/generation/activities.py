"""Activities of a generation trial: greedy generations of the correctness prompts and their
comparison under the divergence rule; and what the measurement (workflows/generation/measure.py)
shares with them: the scenario's requests, its load levels and the stream of one request.

Correctness sends each prompt alone (unary ModelInfer, greedy, EOS ignored, logprobs of the
top-k), so continuous batching cannot change what is compared. Measurement streams every
request over ModelStreamInfer under the plan's load levels (workflows/generation/load.py) and
summarises them as vLLM's `bench serve` does (workflows/generation/metrics.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError

from switchyard import oip_params
from switchyard.gen.inference import grpc_service_pb2 as oip
from switchyard.gen.switchyard.v1 import executor_pb2 as xpb
from switchyard.judge.divergence import Generated, compare_generations, generation_criteria
from switchyard.judge.oip_generations import generated
from workflows.activities import payloads
from workflows.activities.connections import Connections, grpc_errors
from workflows.activities.path import Clock, heartbeating, now_us, serving_compatibility
from workflows.generation import load as genload
from workflows.generation.types import (
    GenerationCompareRequest,
    GenerationCompareResult,
    GenerationRunRequest,
    GenerationRunResult,
)
from workflows.pipeline.types import InputsPlan, Target
from workflows.spec.trial_spec import GenerationPlan, Prompts

MAX_LENGTH = 65536  # lengths beyond the model's context are refused by the executor, per request


def correctness_prompts(prompts: Prompts, seed: int) -> list[genload.GenRequest]:
    """The spec's correctness prompts: its texts, or seeded ids of the given length."""
    if prompts.texts:
        return [genload.GenRequest((), t, prompts.max_tokens) for t in prompts.texts]
    fixed = {"distribution": "fixed", "value": prompts.max_tokens}
    return genload.seeded_requests(
        prompts.count, dataclasses.asdict(prompts.length), fixed, (prompts.low, prompts.high),
        seed, MAX_LENGTH, MAX_LENGTH,
    )  # fmt: skip


def load_levels(generation: GenerationPlan) -> list[dict[str, Any]]:
    """One load level per concurrency, then one per Poisson request rate (in the spec's order)."""
    levels: list[dict[str, Any]] = [
        {"arrival": "concurrency", "concurrency": c} for c in generation.concurrency
    ]
    for rate in generation.request_rates:
        level: dict[str, Any] = {"arrival": "poisson", "request_rate": rate}
        if generation.max_concurrency:
            level["max_concurrency"] = generation.max_concurrency
        levels.append(level)
    return levels


def _int(params: Any, key: str) -> int:
    return int(params[key].int64_param) if key in params else 0


def generation_requests(g: GenerationPlan, token_range: list[int]) -> list[genload.GenRequest]:
    """The scenario's requests: the captured workload's prompts in turn, else seeded ones."""
    if g.workload:
        plan = InputsPlan(0, [], workload=g.workload, workload_sha256=g.workload_sha256)
        out = g.output_len
        default = out.value if out.distribution == "fixed" else out.max or round(out.mean) or 16
        captured = genload.captured_requests(payloads.workload_requests(plan), default)
        if not captured:
            raise ApplicationError(f"workload {g.workload} holds no generation prompts", non_retryable=True)
        return [captured[i % len(captured)] for i in range(g.requests)]
    low, high = (g.low, g.high) if g.high else (token_range[0], token_range[1])
    lengths = dataclasses.asdict(g.prompt_len), dataclasses.asdict(g.output_len)
    return genload.seeded_requests(g.requests, *lengths, (low, high), g.seed, MAX_LENGTH, MAX_LENGTH)


def stream_to(stub: Any, t: Target, label: str) -> genload.Streamer:
    """Opens one generation stream a request, each with its own request id."""
    turn = iter(range(1 << 62))

    def stream(r: genload.GenRequest) -> AsyncIterator[genload.Chunk]:
        rid = f"{t.trial_id}/{t.path}/{label}/{next(turn)}"
        return _stream(stub, genload.infer_request(t.model, t.version, r, True, None, rid))

    return stream


async def _stream(stub: Any, message: oip.ModelInferRequest) -> AsyncIterator[genload.Chunk]:
    call = stub.ModelStreamInfer(iter([message]), timeout=300)
    async for response in call:
        if response.error_message:
            raise RuntimeError(response.error_message)
        p = response.infer_response.parameters
        yield genload.Chunk(
            _int(p, oip_params.NUM_OUTPUT_TOKENS),
            _int(p, oip_params.NUM_INPUT_TOKENS),
            _int(p, oip_params.COMPUTE_US),
        )


class GenerationActivities:
    def __init__(self, connections: Connections, clock: Clock = time.time) -> None:
        self.connections = connections
        self.clock = clock

    async def _counters(self, target: Target) -> xpb.CompatibilityReport | None:
        request = xpb.ModelStatusRequest(model_name=target.model, version=target.version)
        try:
            status = await self.connections.control(target.executor).ModelStatus(request, timeout=30)
        except Exception:  # the counters are a side finding: unknown rather than a failed phase
            return None
        return status.models[0].compatibility if status.models else None

    @activity.defn(name="run_generation")
    async def run_generation(self, request: GenerationRunRequest) -> GenerationRunResult:
        t = request.target
        prompts = correctness_prompts(request.prompts, request.seed)
        started = now_us(self.clock)
        if request.golden:
            load = xpb.LoadModelRequest(
                model_name=t.model, version=t.version, mode="eager", precision="fp64",
                checkpoint_sha256=t.checkpoint_sha256,
            )  # fmt: skip
            with grpc_errors(f"LoadModel {t.model} in fp64 for the golden run on {t.path}"):
                await heartbeating(
                    self.connections.control(t.executor).LoadModel(load),
                    lambda: {"phase": "golden", "path": t.path},
                )
        before = None if request.golden else await self._counters(t)
        stub = self.connections.oip(t.executor)
        runs: list[list[dict[str, Any]]] = []
        prompt_tokens: list[int] = []
        busy = 0
        for i in range(request.repeats):
            run: list[dict[str, Any]] = []
            for k, prompt in enumerate(prompts):
                message = genload.infer_request(
                    t.model, t.version, prompt, False, request.top_k, f"{t.trial_id}/{t.path}/{i}/{k}"
                )
                with grpc_errors(f"ModelInfer {t.model} (prompt {k}) on {t.path}"):
                    response = await stub.ModelInfer(message, timeout=120)
                busy += _int(response.parameters, oip_params.COMPUTE_US)
                if i == 0:
                    prompt_tokens.append(_int(response.parameters, oip_params.NUM_INPUT_TOKENS))
                run.append(generated([response]).to_dict())
            runs.append(run)
            activity.heartbeat({"phase": "golden" if request.golden else "correctness", "run": i + 1})
        compat = None
        if not request.golden:
            compat = serving_compatibility(before, await self._counters(t), request.repeats * len(prompts))
        return GenerationRunResult(runs, prompt_tokens, busy, started, now_us(self.clock), compat)

    @activity.defn(name="compare_generation")
    async def compare_generation(self, request: GenerationCompareRequest) -> GenerationCompareResult:
        def of(runs: list[dict[str, Any]]) -> list[Generated]:
            return [Generated.of(g) for g in runs]

        v = compare_generations(
            of(request.reference),
            of(request.candidate),
            generation_criteria(request.criteria, request.target.precision),
            of(request.golden) or None,
            of(request.reference_repeat) or None,
            of(request.candidate_repeat) or None,
        )
        return GenerationCompareResult(
            v.passed,
            v.finding,
            v.first_divergence,
            v.diverged,
            [s.__dict__ for s in v.sequences],
            v.metrics,
            v.reasons,
            v.justification,
        )
