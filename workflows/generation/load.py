"""The generation load generator: which requests, and when they arrive.

Requests: prompt and output lengths fixed, drawn from a seeded distribution (uniform or
normal, clipped), or taken from a workload captured at the router (its prompts as captured,
its `max_tokens` as the output length). Prompt tokens are seeded ids, so every path and every
retry sends the same requests. Every request is greedy with `ignore_eos`, so each path
generates exactly the output length asked for and token counts compare across paths.

Arrivals: a fixed number of requests in flight (closed loop: a stream starts when one ends),
or Poisson at a request rate (open loop: exponential gaps from a seeded generator, as vLLM's
`--request-rate` with burstiness 1), optionally capped by a maximum concurrency.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from switchyard import codec
from switchyard.gen.inference import grpc_service_pb2 as oip
from workflows.generation.metrics import RequestRecord


@dataclass(frozen=True)
class GenRequest:
    prompt: tuple[int, ...] = ()  # token ids; empty when the prompt is text
    text: str = ""
    max_tokens: int = 16


def draw_lengths(dist: dict[str, Any], n: int, rng: np.random.Generator, low: int, high: int) -> list[int]:
    """n lengths from {"distribution": "fixed", "value": v} | "uniform" (min, max, inclusive)
    | "normal" (mean, std), clipped to [low, high]."""
    kind = dist.get("distribution", "fixed")
    if kind == "fixed":
        values = np.full(n, int(dist["value"]))
    elif kind == "uniform":
        values = rng.integers(int(dist["min"]), int(dist["max"]) + 1, size=n)
    else:
        values = np.rint(rng.normal(float(dist["mean"]), float(dist["std"]), size=n))
    return [int(v) for v in np.clip(values, low, high)]


def seeded_requests(
    count: int,
    prompt_len: dict[str, Any],
    output_len: dict[str, Any],
    token_range: tuple[int, int],
    seed: int,
    max_prompt: int,
    max_output: int,
) -> list[GenRequest]:
    """`count` requests with seeded prompt ids in [low, high) and seeded lengths."""
    rng = np.random.default_rng([seed, count])
    prompts = draw_lengths(prompt_len, count, rng, 1, max_prompt)
    outputs = draw_lengths(output_len, count, rng, 1, max_output)
    low, high = token_range
    return [
        GenRequest(tuple(int(t) for t in rng.integers(low, high, size=p)), "", o)
        for p, o in zip(prompts, outputs, strict=True)
    ]


def _first_bytes(raw: bytes) -> bytes:
    """The first element of an OIP BYTES tensor (4-byte little-endian length, then the bytes)."""
    if len(raw) < 4:
        return b""
    n = int.from_bytes(raw[:4], "little")
    return raw[4 : 4 + n]


OUTPUT_TOKENS_SEEN = "output_tokens_seen"  # services/router/capture.py SEEN: kept on a captured generation


def captured_requests(captured: list[oip.ModelInferRequest], default_max_tokens: int) -> list[GenRequest]:
    """The prompts of a captured workload as captured, each with the output length the router
    saw (`output_tokens_seen`: replayed with ignore_eos, a request that stopped early is as long
    as it was), else its own max_tokens."""
    out: list[GenRequest] = []
    for r in captured:
        tensors = {t.name: (t, r.raw_input_contents[i]) for i, t in enumerate(r.inputs)}
        max_tokens = default_max_tokens
        seen = r.parameters[OUTPUT_TOKENS_SEEN].int64_param if OUTPUT_TOKENS_SEEN in r.parameters else 0
        if seen > 0:
            max_tokens = int(seen)
        elif "sampling_parameters" in tensors:
            blob = _first_bytes(tensors["sampling_parameters"][1])
            with contextlib.suppress(ValueError, IndexError, AttributeError):
                max_tokens = int(json.loads(blob).get("max_tokens") or default_max_tokens)
        if "input_ids" in tensors:
            ids = np.frombuffer(tensors["input_ids"][1], dtype=np.int64)
            out.append(GenRequest(tuple(int(t) for t in ids), "", max_tokens))
        elif "text_input" in tensors:
            text = _first_bytes(tensors["text_input"][1]).decode()
            out.append(GenRequest((), text, max_tokens))
    return out


def infer_request(
    model: str,
    version: str,
    request: GenRequest,
    stream: bool,
    logprobs: int | None = None,
    request_id: str = "",
) -> oip.ModelInferRequest:
    """Triton's vLLM-backend inputs: greedy, ignore_eos, the new tokens only."""
    r = oip.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    if request.prompt:
        r.inputs.add(name="input_ids", datatype="INT64", shape=[len(request.prompt)])
        r.raw_input_contents.append(np.asarray(request.prompt, dtype=np.int64).tobytes())
    else:
        r.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        r.raw_input_contents.append(codec.encode_bytes([request.text.encode()]))
    params: dict[str, Any] = {"temperature": 0, "max_tokens": request.max_tokens, "ignore_eos": True}
    if logprobs is not None:
        params["logprobs"] = logprobs
    for name, value in (("stream", stream), ("exclude_input_in_output", True)):
        r.inputs.add(name=name, datatype="BOOL", shape=[1])
        r.raw_input_contents.append(np.asarray([value], dtype=np.bool_).tobytes())
    r.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
    r.raw_input_contents.append(codec.encode_bytes([json.dumps(params).encode()]))
    r.outputs.add(name="output_ids")
    return r


@dataclass(frozen=True)
class Chunk:
    """What one streamed response says: tokens so far, prompt tokens, device time so far."""

    output_tokens: int
    prompt_tokens: int
    compute_us: int


Streamer = Callable[[GenRequest], AsyncIterator[Chunk]]


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times (s from the start) of n requests at `rate` per second, seeded."""
    gaps = np.random.default_rng([seed, n]).exponential(1.0 / rate, size=n)
    return [float(t) for t in np.cumsum(gaps) - gaps[0]]  # the first request at once


async def _send(
    stream: Streamer, request: GenRequest, record: RequestRecord, since: Callable[[], float]
) -> None:
    """One streamed request into `record`: the time of each chunk that carries new tokens."""
    try:
        async for chunk in stream(request):
            if chunk.output_tokens > record.output_tokens:  # a response that carries new tokens
                record.chunk_s.append(since())
                record.output_tokens = chunk.output_tokens
            record.prompt_tokens = chunk.prompt_tokens or record.prompt_tokens
            record.compute_us = chunk.compute_us
    except Exception as exc:  # a failed request is counted as failed, not a crash
        record.ok, record.error = False, f"{type(exc).__name__}: {exc}"[:300]
    if record.ok and not record.chunk_s:
        record.ok, record.error = False, "no tokens"


async def _poisson(
    send: Callable[[GenRequest], Awaitable[None]],
    requests: list[GenRequest],
    load: dict[str, Any],
    seed: int,
    since: Callable[[], float],
) -> None:
    """Open loop: each request at its Poisson arrival time, at most max_concurrency in flight."""
    limit = int(load.get("max_concurrency") or 0)
    gate = asyncio.Semaphore(limit) if limit else None
    offsets = poisson_offsets(len(requests), float(load["request_rate"]), seed)

    async def at(offset: float, request: GenRequest) -> None:
        delay = offset - since()
        if delay > 0:
            await asyncio.sleep(delay)
        if gate is None:
            await send(request)
            return
        async with gate:
            await send(request)

    await asyncio.gather(*(at(o, r) for o, r in zip(offsets, requests, strict=True)))


async def run_load(
    stream: Streamer,
    requests: list[GenRequest],
    load: dict[str, Any],
    seed: int,
    clock: Callable[[], float] = time.perf_counter,
    progress: Callable[[int], Awaitable[None]] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send every request under `load` ({"arrival": "concurrency", "concurrency": c} or
    {"arrival": "poisson", "request_rate": r, "max_concurrency": m}); the records and the
    duration from the first send to the last response."""
    begin = clock()
    records: list[RequestRecord] = []

    def since() -> float:
        return clock() - begin

    async def one(request: GenRequest) -> None:
        record = RequestRecord(prompt_tokens=len(request.prompt), sent_s=since())
        records.append(record)
        await _send(stream, request, record, since)
        if progress is not None:
            await progress(len(records))

    if load["arrival"] == "poisson":
        await _poisson(one, requests, load, seed, since)
    else:  # closed loop: `concurrency` workers, each sends the next request when one is done
        queue = list(reversed(requests))

        async def worker() -> None:
            while queue:
                await one(queue.pop())

        await asyncio.gather(*(worker() for _ in range(int(load["concurrency"]))))
    ends = [r.chunk_s[-1] for r in records if r.chunk_s]
    return records, max(ends, default=since())
