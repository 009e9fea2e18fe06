"""Generation through the router: tritonclient streams (Triton's decoupled semantics) and the
official `openai` client (streaming and not) against real metering (SQLite), a real CPU
executor serving a Llama-style HF model and tiny-lm-gen, and a real router, all on port 0."""

from __future__ import annotations

import asyncio
import json
import queue
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio
import tritonclient.grpc as triton

from services.executor.executor_server import RunningExecutor
from services.router.router_server import RunningRouter
from switchyard.net import free_port
from tests.gen_models import reference_greedy, start_llama_executor, text_inputs
from tests.router.conftest import Metering, RouterFactory, routes_config

pytestmark = pytest.mark.asyncio(loop_scope="session")
MODEL = "llama-tiny"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def gen_executor(
    llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RunningExecutor]:
    running = await start_llama_executor(tmp_path_factory.mktemp("router-gen-repo"), llama_dir, (MODEL,))
    yield running
    await running.stop(0)


@pytest_asyncio.fixture(loop_scope="session")
async def routed(
    gen_executor: RunningExecutor, metering: Metering, make_router: RouterFactory
) -> tuple[RunningRouter, str]:
    """A router with the OpenAI API on a free port; the route fails over from a dead executor."""
    dead = f"127.0.0.1:{free_port()}"
    routes = {MODEL: {"policy": "failover", "targets": [{"deployment": "dead"}, {"deployment": "gen"}]}}
    cfg = routes_config(
        {"dead": dead, "gen": gen_executor.address}, routes, openai_port=0, usage_flush_s=0.05
    )
    router = await make_router(cfg, metering.running.address)
    key, _ = await metering.key(f"gen-{time.monotonic_ns()}", "team-gen")
    return router, key


def _stream(
    address: str, key: str, prompts: dict[str, str], sampling: dict[str, Any]
) -> dict[str, list[Any]]:
    client = triton.InferenceServerClient(address)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(
        callback=lambda result, error: answers.put((result, error)),
        headers={"authorization": f"Bearer {key}"},
    )
    out: dict[str, list[Any]] = {rid: [] for rid in prompts}
    try:
        for rid, prompt in prompts.items():
            client.async_stream_infer(MODEL, text_inputs(prompt, True, sampling), request_id=rid)
        open_ids = set(prompts)
        while open_ids:
            result, error = answers.get(timeout=60)
            assert error is None, str(error)
            response = result.get_response()
            out[response.id].append(result)
            if response.parameters["triton_final_response"].bool_param:
                open_ids.discard(response.id)
    finally:
        client.stop_stream()
        client.close()
    return out


async def test_tritonclient_streams_through_the_router_token_by_token(
    routed: tuple[RunningRouter, str], gen_executor: RunningExecutor, llama_dir: Path
) -> None:
    router, key = routed
    prompts = {"a": "the quick brown", "b": "hello world", "c": "a switchyard routes"}
    out = await asyncio.to_thread(_stream, router.address, key, prompts, {"temperature": 0, "max_tokens": 12})
    model = gen_executor.executor.find(MODEL, "")
    assert model.engine is not None
    for rid, prompt in prompts.items():
        results = out[rid]
        assert len(results) > 1
        flags = [r.get_response().parameters["triton_final_response"].bool_param for r in results]
        assert flags == [False] * (len(results) - 1) + [True]
        ids = [int(t) for r in results for t in r.as_numpy("output_ids")]
        assert ids == reference_greedy(llama_dir, model.engine.tokenizer.encode(prompt), 12)
        params = results[-1].get_response().parameters
        assert params["path"].string_param == "cpu-b"  # the dead first target was skipped
        assert params["request_id"].string_param


def _record_usage(router: RunningRouter) -> list[Any]:
    """The usage events the router hands its spool from now on (still delivered to metering)."""
    spool = router.router.spool
    assert spool is not None
    seen: list[Any] = []
    deliver = spool.usage

    def usage(event: Any) -> None:
        seen.append(event)
        deliver(event)

    spool.usage = usage  # type: ignore[method-assign]
    return seen


def _client(router: RunningRouter, key: str) -> openai.AsyncOpenAI:
    assert router.openai is not None
    return openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{router.openai.port}/v1", api_key=key, max_retries=0
    )


async def _greedy(client: openai.AsyncOpenAI, prompt: str, max_tokens: int, **options: Any) -> Any:
    """A completion of MODEL at temperature 0 (greedy: the same answer every time)."""
    return await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, **options
    )


async def test_openai_completions_streaming_and_not_agree_with_usage(
    routed: tuple[RunningRouter, str],
) -> None:
    router, key = routed
    client = _client(router, key)
    try:
        whole = await _greedy(client, "hello world", 10)
        assert whole.object == "text_completion" and whole.choices[0].finish_reason in ("stop", "length")
        assert (whole.usage is not None and whole.usage.completion_tokens == 10) or whole.choices[
            0
        ].finish_reason == "stop"
        pieces, usage = [], None
        stream = await _greedy(client, "hello world", 10, stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].text)
            if chunk.usage is not None:
                usage = chunk.usage
        assert "".join(pieces) == whole.choices[0].text
        assert usage is not None and whole.usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens) == (
            whole.usage.prompt_tokens,
            whole.usage.completion_tokens,
        )
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
    finally:
        await client.close()


async def test_openai_chat_streaming_equals_the_whole_answer(routed: tuple[RunningRouter, str]) -> None:
    router, key = routed
    client = _client(router, key)
    messages: Any = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    try:
        whole = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0
        )
        content = whole.choices[0].message.content
        assert whole.choices[0].message.role == "assistant" and content
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True
        )
        deltas = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert "".join(deltas) == content
    finally:
        await client.close()


async def test_openai_errors_carry_the_status_and_what_to_fix(routed: tuple[RunningRouter, str]) -> None:
    router, key = routed
    bad = _client(router, "sk-not-a-key")
    good = _client(router, key)
    try:
        with pytest.raises(openai.AuthenticationError):
            await bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        with pytest.raises(openai.NotFoundError, match="unknown model 'nope'"):
            await good.completions.create(model="nope", prompt="hi", max_tokens=2)
        with pytest.raises(openai.BadRequestError, match=r"'top_p' is 5\.0"):
            await good.completions.create(model=MODEL, prompt="hi", max_tokens=2, top_p=5)
        with pytest.raises(openai.BadRequestError, match="max_tokens is 500, over this model's limit of 40"):
            await good.completions.create(model=MODEL, prompt="hi", max_tokens=500)
        with pytest.raises(openai.BadRequestError, match="prompt is empty"):
            await good.completions.create(model=MODEL, prompt="", max_tokens=2)
    finally:
        await bad.close()
        await good.close()


async def test_a_caller_that_leaves_mid_stream_frees_the_slot(
    routed: tuple[RunningRouter, str], gen_executor: RunningExecutor
) -> None:
    router, key = routed
    model = gen_executor.executor.find(MODEL, "")
    assert model.engine is not None
    cancelled = model.engine.counters.cancelled
    events = _record_usage(router)
    client = _client(router, key)
    try:
        stream = await _greedy(client, "the quick", 40, stream=True, extra_body={"ignore_eos": True})
        async for _ in stream:
            break  # the first token came: leave
        await stream.close()
    finally:
        await client.close()
    for _ in range(200):
        if model.engine.running == 0 and model.engine.counters.cancelled > cancelled:
            break
        await asyncio.sleep(0.05)
    assert model.engine.running == 0 and model.engine.counters.cancelled == cancelled + 1
    for _ in range(100):
        if events:
            break
        await asyncio.sleep(0.05)
    (event,) = events  # metered once, with the tokens made until the caller left
    assert event.status == "cancelled" and 1 <= event.output_tokens < 40 and event.prompt_tokens > 0


async def _ledger_tokens(metering: Metering, key: str) -> tuple[int, int]:
    """(prompt, output) tokens of the ledger line stored for a usage key (waits for the spool)."""
    from sqlalchemy import select

    from services.metering.schema import LINES

    for _ in range(200):
        with metering.running.ledger.engines.write.connect() as conn:
            row = conn.execute(
                select(LINES.c.prompt_tokens, LINES.c.output_tokens).where(LINES.c.idempotency_key == key)
            ).first()
        if row is not None:
            return int(row[0]), int(row[1])
        await asyncio.sleep(0.05)
    raise AssertionError(f"no ledger line for {key}")


async def test_unary_and_openai_generations_reach_the_ledger_with_their_tokens(
    routed: tuple[RunningRouter, str], metering: Metering
) -> None:
    router, key = routed
    events = _record_usage(router)
    client = triton.InferenceServerClient(router.address)
    try:
        result = await asyncio.to_thread(
            client.infer,
            MODEL,
            text_inputs("hello world", False, {"temperature": 0, "max_tokens": 6, "ignore_eos": True}),
            headers={"authorization": f"Bearer {key}"},
        )
    finally:
        client.close()
    params = result.get_response().parameters
    answered = (params["num_input_tokens"].int64_param, params["num_output_tokens"].int64_param)
    assert answered[0] > 0 and answered[1] == 6
    api = _client(router, key)
    try:
        whole = await _greedy(api, "the quick brown", 5, extra_body={"ignore_eos": True})
    finally:
        await api.close()
    assert whole.usage is not None
    for _ in range(100):
        if len(events) >= 2:
            break
        await asyncio.sleep(0.05)
    unary, http = events
    assert (unary.prompt_tokens, unary.output_tokens) == answered and unary.status == "completed"
    assert (http.prompt_tokens, http.output_tokens) == (whole.usage.prompt_tokens, 5)
    assert await _ledger_tokens(metering, unary.idempotency_key) == answered
    assert await _ledger_tokens(metering, http.idempotency_key) == (whole.usage.prompt_tokens, 5)


async def test_openai_n_choices_are_separate_seeded_generations(routed: tuple[RunningRouter, str]) -> None:
    router, key = routed
    events = _record_usage(router)
    client = _client(router, key)
    sampled: dict[str, Any] = dict(model=MODEL, prompt="the quick brown", max_tokens=6, temperature=0.9)
    sampled["extra_body"] = {"ignore_eos": True}
    try:
        three = await client.completions.create(n=3, seed=7, **sampled)
        again = await client.completions.create(n=3, seed=7, **sampled)
        second = await client.completions.create(seed=8, **sampled)  # what choice 1 sampled alone
        stream = await client.completions.create(
            n=3, seed=7, stream=True, stream_options={"include_usage": True}, **sampled
        )
        pieces: dict[int, str] = {0: "", 1: "", 2: ""}
        usage = None
        async for chunk in stream:
            for c in chunk.choices:
                pieces[c.index] += c.text
            usage = chunk.usage or usage
        greedy = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0, n=2
        )
    finally:
        await client.close()
    texts = [c.text for c in sorted(three.choices, key=lambda c: c.index)]
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]  # reproducible
    assert texts[1] == second.choices[0].text  # choice i samples with seed + i
    assert [pieces[i] for i in range(3)] == texts  # streamed choices interleave, each intact
    assert three.usage is not None and usage is not None
    assert three.usage.completion_tokens == 18 and three.usage.prompt_tokens == second.usage.prompt_tokens
    assert (usage.prompt_tokens, usage.completion_tokens) == (three.usage.prompt_tokens, 18)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content  # greedy: the same
    for _ in range(100):
        if len(events) >= 12:
            break
        await asyncio.sleep(0.05)
    # a usage event per choice, each with its own prefill and its own tokens
    first = events[:3]
    assert len({e.idempotency_key for e in first}) == 3
    assert [(e.prompt_tokens, e.output_tokens) for e in first] == [(three.usage.prompt_tokens, 6)] * 3


async def test_openai_logprobs_are_the_engines(routed: tuple[RunningRouter, str]) -> None:
    router, key = routed
    sampling = {"temperature": 0, "max_tokens": 5, "ignore_eos": True, "logprobs": 3}
    client = triton.InferenceServerClient(router.address)
    try:
        oip = await asyncio.to_thread(
            client.infer, MODEL, text_inputs("hello world", False, sampling),
            headers={"authorization": f"Bearer {key}"},
        )  # fmt: skip
    finally:
        client.close()
    engine = json.loads(oip.get_response().parameters["logprobs"].string_param)
    assert len(engine) == 5 and all(len(e["top"]) == 3 for e in engine)
    api = _client(router, key)
    try:
        whole = await api.completions.create(
            model=MODEL, prompt="hello world", max_tokens=5, temperature=0, logprobs=3,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chat = await api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4, temperature=0,
            logprobs=True, top_logprobs=2, stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        content = []
        async for chunk in chat:
            if chunk.choices and chunk.choices[0].logprobs is not None:
                content += chunk.choices[0].logprobs.content or []
        with pytest.raises(openai.BadRequestError, match="`n` is 0"):
            await api.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=0)
        with pytest.raises(openai.BadRequestError, match="no logprobs of the prompt"):
            await api.completions.create(model=MODEL, prompt="hi", max_tokens=2, logprobs=1, echo=True)
        with pytest.raises(openai.BadRequestError, match="needs `logprobs: true`"):
            await api.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, top_logprobs=2
            )
    finally:
        await api.close()
    lp = whole.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs
    assert lp.tokens == [e["token"] for e in engine]
    assert lp.token_logprobs == pytest.approx([e["logprob"] for e in engine])
    for chosen, value, top, e in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, engine, strict=True):
        assert top[chosen] == value and value <= 0.0
        assert max(top.values()) == pytest.approx(e["top"][0][1])  # greedy: the most likely was chosen
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(5)]
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)  # greedy
