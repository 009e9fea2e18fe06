"""The generation load generator and its metrics (workflows/generation/load.py and metrics.py):
vLLM's definitions of TTFT, TPOT, ITL, E2E and goodput on hand-made timings, seeded lengths,
and both arrival processes against a streamer that keeps its own clock."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest

from switchyard import codec
from switchyard.gen.inference import grpc_service_pb2 as oip
from workflows.generation.load import (
    Chunk,
    GenRequest,
    captured_requests,
    infer_request,
    poisson_offsets,
    run_load,
    seeded_requests,
)
from workflows.generation.metrics import RequestRecord, Slo, summarize


def test_metrics_follow_vllm_definitions() -> None:
    # sent at 0; chunks at 0.1, 0.3, 0.6, 1.0: ttft 100 ms, e2e 1000 ms, tpot (1000-100)/3 ms
    a = RequestRecord(prompt_tokens=10, sent_s=0.0, chunk_s=[0.1, 0.3, 0.6, 1.0], output_tokens=4)
    # one output token: no TPOT, no ITL
    b = RequestRecord(prompt_tokens=6, sent_s=0.5, chunk_s=[0.7], output_tokens=1)
    failed = RequestRecord(prompt_tokens=3, sent_s=0.2, ok=False, error="UNAVAILABLE")
    s = summarize([a, b, failed], 2.0, {"arrival": "concurrency", "concurrency": 2}, Slo(ttft_ms=150))
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert s["tpot_ms"]["p50"] == pytest.approx(300.0)
    assert s["itl_ms"]["mean"] == pytest.approx(300.0)  # gaps 200, 300, 400
    assert s["itl_ms"]["p99"] == pytest.approx(np.percentile([200, 300, 400], 99))
    assert s["e2el_ms"]["p90"] == pytest.approx(np.percentile([1000, 200], 90))
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(2.5)
    assert s["total_token_throughput"] == pytest.approx((16 + 5) / 2.0)
    assert s["goodput"]["good"] == 1 and s["goodput"]["request_goodput"] == pytest.approx(0.5)
    assert s["input_tokens"] == {"mean": 8.0, "min": 6, "max": 10, "total": 16}
    assert s["load"] == {"arrival": "concurrency", "concurrency": 2}
    no_slo = summarize([a], 1.0, {"arrival": "concurrency", "concurrency": 1}, Slo())
    assert no_slo["goodput"]["request_goodput"] is None


def test_seeded_lengths_repeat_and_respect_their_distribution() -> None:
    one = seeded_requests(50, {"distribution": "uniform", "min": 4, "max": 12},
                          {"distribution": "normal", "mean": 8, "std": 3}, (1, 300), 7, 32, 16)  # fmt: skip
    again = seeded_requests(50, {"distribution": "uniform", "min": 4, "max": 12},
                            {"distribution": "normal", "mean": 8, "std": 3}, (1, 300), 7, 32, 16)  # fmt: skip
    assert one == again
    assert all(4 <= len(r.prompt) <= 12 and 1 <= r.max_tokens <= 16 for r in one)
    assert len({len(r.prompt) for r in one}) > 3 and all(1 <= t < 300 for r in one for t in r.prompt)
    fixed = seeded_requests(3, {"distribution": "fixed", "value": 5}, {"distribution": "fixed", "value": 9},
                            (0, 10), 1, 32, 16)  # fmt: skip
    assert [(len(r.prompt), r.max_tokens) for r in fixed] == [(5, 9)] * 3
    other = seeded_requests(50, {"distribution": "uniform", "min": 4, "max": 12},
                            {"distribution": "fixed", "value": 8}, (1, 300), 8, 32, 16)  # fmt: skip
    assert [r.prompt for r in other] != [r.prompt for r in one]


def test_poisson_offsets_have_the_asked_rate() -> None:
    offsets = poisson_offsets(4000, 20.0, 3)
    assert offsets == poisson_offsets(4000, 20.0, 3) and offsets[0] == 0.0
    assert all(b >= a for a, b in itertools.pairwise(offsets))
    assert 4000 / offsets[-1] == pytest.approx(20.0, rel=0.05)


def test_captured_prompts_and_max_tokens_are_replayed() -> None:
    r = oip.ModelInferRequest(model_name="m")
    r.inputs.add(name="input_ids", datatype="INT64", shape=[3])
    r.raw_input_contents.append(np.asarray([4, 5, 6], dtype=np.int64).tobytes())
    r.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
    r.raw_input_contents.append(codec.encode_bytes([json.dumps({"max_tokens": 7}).encode()]))
    t = oip.ModelInferRequest(model_name="m")
    t.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    t.raw_input_contents.append(codec.encode_bytes([b"hello"]))
    assert captured_requests([r, t], 12) == [GenRequest((4, 5, 6), "", 7), GenRequest((), "hello", 12)]


def test_requests_are_greedy_ignore_eos_and_exclude_the_prompt() -> None:
    r = infer_request("llama", "1", GenRequest((1, 2), "", 5), stream=True, logprobs=5)
    names = [i.name for i in r.inputs]
    assert names == ["input_ids", "stream", "exclude_input_in_output", "sampling_parameters"]
    params = json.loads(r.raw_input_contents[3][4:])
    assert params == {"temperature": 0, "max_tokens": 5, "ignore_eos": True, "logprobs": 5}


def _streamer(step_s: float, in_flight: list[int], peak: list[int]):  # type: ignore[no-untyped-def]
    async def stream(request: GenRequest) -> AsyncIterator[Chunk]:
        in_flight[0] += 1
        peak[0] = max(peak[0], in_flight[0])
        try:
            for n in range(1, request.max_tokens + 1):
                await asyncio.sleep(step_s)
                yield Chunk(n, len(request.prompt), n * 100)
        finally:
            in_flight[0] -= 1

    return stream


async def test_fixed_concurrency_keeps_that_many_streams_in_flight() -> None:
    in_flight, peak = [0], [0]
    requests = [GenRequest((1, 2, 3), "", 4) for _ in range(12)]
    records, duration = await run_load(
        _streamer(0.01, in_flight, peak), requests, {"arrival": "concurrency", "concurrency": 3}, 0
    )
    assert peak[0] == 3 and len(records) == 12
    assert all(r.ok and r.output_tokens == 4 and len(r.chunk_s) == 4 for r in records)
    assert duration >= 4 * 4 * 0.01  # 12 requests / 3 streams x 4 steps of 10 ms, at least
    s = summarize(records, duration, {"arrival": "concurrency", "concurrency": 3}, Slo())
    assert s["itl_ms"]["p50"] >= 9.0 and s["output_tokens"]["total"] == 48
    assert s["compute_us"] == 12 * 400


async def test_poisson_arrivals_follow_the_offsets_and_a_failure_is_counted() -> None:
    in_flight, peak = [0], [0]
    ok = _streamer(0.001, in_flight, peak)

    async def sometimes(request: GenRequest) -> AsyncIterator[Chunk]:
        if request.max_tokens == 99:
            raise RuntimeError("refused")
        async for c in ok(request):
            yield c

    requests = [GenRequest((1,), "", 2) for _ in range(9)] + [GenRequest((1,), "", 99)]
    begin = time.perf_counter()
    records, _ = await run_load(sometimes, requests, {"arrival": "poisson", "request_rate": 50.0}, 5)
    elapsed = time.perf_counter() - begin
    offsets = poisson_offsets(10, 50.0, 5)
    assert elapsed >= offsets[-1]
    sent = sorted(r.sent_s for r in records)
    assert all(s >= o - 0.002 for s, o in zip(sent, offsets, strict=True))
    assert sum(not r.ok for r in records) == 1 and "refused" in next(r.error for r in records if not r.ok)
