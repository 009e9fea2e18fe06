"""The generation engine on a real executor domain (cpu): exact greedy tokens against the
references, continuous batching, sampling, stops, cancellation, the queue bound, bad input,
and no compilation while serving on cpu-compile."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from services.executor.device import select_backend
from services.executor.executor_config import ExecutorConfig
from services.executor.executor_runtime import Executor
from services.executor.generation.engine_client import GenerationStream
from services.executor.generation.packed_linear import packing_available
from services.executor.generation.scheduler import EngineFull, TokenEvent
from services.executor.generation.settings import SamplingParams, parse_sampling
from services.executor.load_phases import LoadOptions
from services.executor.loaded_model import LoadedModel
from switchyard.errors import InvalidArgument
from switchyard.models.generation import GenerationSettings
from switchyard.models.registry import ModelRegistry
from tests.gen_models import (
    add_tiny_lm_variant,
    reference_greedy,
    repository_with_llama,
    tiny_lm_reference,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=20)


async def _executor(engine: str, llama_dir: Path, root: Path) -> Executor:
    registry = repository_with_llama(root, llama_dir)
    add_tiny_lm_variant(root, "tiny-lm-gen-one-slot", decode_slots=1, max_queue=1)
    ex = Executor(ExecutorConfig(generation_engine=engine), select_backend("cpu"), registry)
    for name in ("tiny-lm-gen", "llama-tiny", "tiny-lm-gen-one-slot"):
        await ex.load_model(name, "", ex.default_options())
    return ex


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def executor(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Executor]:
    """An executor with its generation engines in processes of their own (the cpu default)."""
    ex = await _executor("process", llama_dir, tmp_path_factory.mktemp("gen-repo"))
    yield ex
    await ex.close()


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def inline_executor(
    llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Executor]:
    """One with its engines on its device thread (`--generation-engine inline`)."""
    ex = await _executor("inline", llama_dir, tmp_path_factory.mktemp("gen-repo-inline"))
    yield ex
    await ex.close()


@pytest.fixture(params=["process", "inline"])
def either(request: pytest.FixtureRequest, executor: Executor, inline_executor: Executor) -> Executor:
    """Each engine in turn: the tests of batching, exact tokens and cancellation run on both."""
    return executor if request.param == "process" else inline_executor


async def events(stream: GenerationStream) -> list[TokenEvent]:
    return [e async for e in stream]


def ids(evs: list[TokenEvent]) -> list[int]:
    return [t for e in evs for t in e.token_ids]


def model(ex: Executor, name: str) -> LoadedModel:
    return ex.find(name, "")


async def test_tiny_lm_greedy_equals_full_forward_decoding_under_continuous_batching(
    either: Executor,
) -> None:
    executor = either
    m = model(executor, "tiny-lm-gen")
    assert m.engine is not None
    # 12 requests for 8 slots, prompts 3..30 tokens, outputs 5..24: requests join and leave
    prompts = [[(11 * i + 3 * j) % 256 for j in range(3 + (i * 7) % 28)] for i in range(12)]
    lengths = [5 + (i * 5) % 20 for i in range(12)]
    before, rows_before = m.engine.counters.decode_steps, m.engine.counters.decode_rows
    streams = [
        executor.generate(m, p, SamplingParams(temperature=0.0, max_tokens=n), False, None)
        for p, n in zip(prompts, lengths, strict=True)
    ]
    results = await asyncio.gather(*(events(s) for s in streams))
    for prompt, n, evs in zip(prompts, lengths, results, strict=True):
        assert ids(evs) == tiny_lm_reference(prompt, n)
        assert evs[-1].finish_reason == "length" and evs[-1].output_tokens == n
        assert all(e.finish_reason is None for e in evs[:-1])
    steps = m.engine.counters.decode_steps - before
    rows = m.engine.counters.decode_rows - rows_before
    assert rows == sum(lengths) - len(prompts)  # each first token comes from the prefill
    assert rows / steps > 4  # decode steps were shared by the running requests
    assert m.compilations_after_warmup() == 0
    assert m.engine.running == 0 and m.engine.depth == 0


async def test_llama_greedy_equals_hf_generate(either: Executor, llama_dir: Path) -> None:
    executor = either
    m = model(executor, "llama-tiny")
    assert m.engine is not None
    if packing_available():  # greedy through oneDNN's packed GEMMs (packed_linear)
        assert any("on oneDNN" in a for a in m.findings.adaptations), m.findings.adaptations
    texts = ["the quick brown", "hello", "serving language models one", "a switchyard routes trains from"]
    prompts = [m.engine.tokenizer.encode(t) for t in texts]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    streams = [executor.generate(m, p, params, True, None) for p in prompts]
    results = await asyncio.gather(*(events(s) for s in streams))
    for prompt, evs in zip(prompts, results, strict=True):
        assert ids(evs) == reference_greedy(llama_dir, prompt, 24)


async def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(executor: Executor) -> None:
    m = model(executor, "tiny-lm-gen")
    prompt = list(b"seeded sampling")
    params = parse_sampling(
        '{"temperature": 0.9, "top_k": 50, "top_p": 0.9, "seed": 7, "max_tokens": 16}', 512
    )
    alone = ids(await events(executor.generate(m, prompt, params, False, None)))
    crowd = [
        executor.generate(
            m, list(b"other %d" % i), SamplingParams(temperature=1.0, max_tokens=12), False, None
        )
        for i in range(5)
    ]
    again = executor.generate(m, prompt, params, False, None)
    together = await asyncio.gather(events(again), *(events(s) for s in crowd))
    assert ids(together[0]) == alone
    other_seed = dataclasses.replace(params, seed=8)
    assert ids(await events(executor.generate(m, prompt, other_seed, False, None))) != alone
    top1 = SamplingParams(temperature=1.0, top_k=1, max_tokens=16, seed=3)
    assert ids(await events(executor.generate(m, prompt, top1, False, None))) == tiny_lm_reference(prompt, 16)


async def test_logprobs_of_the_chosen_and_top_tokens(executor: Executor) -> None:
    m = model(executor, "tiny-lm-gen")
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3)
    evs = await events(executor.generate(m, list(b"logprobs"), params, False, None))
    for e in evs:
        (choice,) = e.choices
        assert choice.logprob is not None and choice.logprob <= 0.0
        assert len(choice.top) == 3 and choice.top[0][0] == choice.token  # greedy: the top one
        assert choice.top[0][1] == pytest.approx(choice.logprob)
        assert [lp for _, lp in choice.top] == sorted((lp for _, lp in choice.top), reverse=True)


async def test_stop_ids_and_stop_strings_end_the_generation(executor: Executor) -> None:
    m = model(executor, "llama-tiny")
    assert m.engine is not None
    prompt = m.engine.tokenizer.encode("hello world, hello")
    full = await events(
        executor.generate(m, prompt, SamplingParams(temperature=0.0, max_tokens=30), True, None)
    )
    tokens = ids(full)
    stop_id = tokens[5]
    by_id = await events(
        executor.generate(
            m, prompt, SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=(stop_id,)), True, None
        )
    )
    assert ids(by_id) == tokens[: tokens.index(stop_id) + 1] and by_id[-1].finish_reason == "stop"
    text = "".join(e.text for e in full)
    stop = text[8:11]
    assert stop and stop in text
    by_text = await events(
        executor.generate(m, prompt, SamplingParams(temperature=0.0, max_tokens=30, stop=(stop,)), True, None)
    )
    assert "".join(e.text for e in by_text) == text[: text.index(stop)]
    assert by_text[-1].finish_reason == "stop"


async def test_cancellation_frees_the_slot_at_the_next_step(either: Executor) -> None:
    executor = either
    m = model(executor, "tiny-lm-gen-one-slot")
    assert m.engine is not None
    long = SamplingParams(temperature=0.0, max_tokens=50)
    first = executor.generate(m, list(b"first"), long, False, None)
    it = first.__aiter__()
    await anext(it)  # it holds the only slot
    second = executor.generate(m, list(b"second"), SamplingParams(temperature=0.0, max_tokens=3), False, None)
    # one turn of the loop, not a wall-clock wait: a lone request's short steps run on the event
    # loop, so in 50 ms the first could finish its 50 tokens and free the slot by itself
    await asyncio.sleep(0)
    assert m.engine.running == 1 and m.engine.depth == 1
    with pytest.raises(EngineFull):  # the queue's bound is 1
        executor.generate(m, list(b"third"), long, False, None)
    first.cancel()  # the consumer leaves
    done = await asyncio.wait_for(events(second), 30)
    assert ids(done) == tiny_lm_reference(list(b"second"), 3)
    assert m.engine.counters.cancelled >= 1 and m.engine.running == 0


async def test_a_burst_is_bounded_by_the_slots_and_the_queue(either: Executor) -> None:
    """Requests that come at once, before an iteration takes any into a slot: the slots plus
    `max_queue` are admitted, the next is RESOURCE_EXHAUSTED, in process as in the engine
    process (one admission for both, `scheduler.admit`)."""
    executor = either
    m = model(executor, "tiny-lm-gen-one-slot")  # 1 slot, max_queue 1
    params = SamplingParams(temperature=0.0, max_tokens=3)
    prompts = [list(b"burst %d" % i) for i in range(2)]
    streams = [executor.generate(m, p, params, False, None) for p in prompts]
    with pytest.raises(EngineFull, match="1 decode slots are busy and 1 requests wait"):
        executor.generate(m, list(b"one too many"), params, False, None)
    for prompt, stream in zip(prompts, streams, strict=True):
        assert ids(await asyncio.wait_for(events(stream), 30)) == tiny_lm_reference(prompt, 3)


@pytest.mark.parametrize(
    ("prompt", "params", "needle"),
    [
        ([], "{}", "prompt is empty"),
        ([1] * 40, "{}", "40 tokens, over this model's longest prompt of 32"),
        ([1] * 30, '{"max_tokens": 40}', "30 tokens and max_tokens is 40"),
        ([1] * 4, '{"max_tokens": 57}', "max_tokens is 57, over this model's limit of 56"),
        ([1] * 4, '{"temprature": 0.5}', "unknown sampling parameter 'temprature'"),
        ([1] * 4, '{"top_p": 0}', "'top_p' is 0.0"),
        ([1] * 4, '{"temperature": -1}', "'temperature' is -1.0"),
        ([1] * 4, '{"top_k": 9999}', "'top_k' is 9999"),
        ([1] * 4, '{"logprobs": 50}', "'logprobs' is 50"),
        ([1] * 4, '{"n": 2}', "'n' = 2 is not supported"),
        ([1] * 4, '{"stop_token_ids": [600]}', "outside 0..511"),
        ([1] * 4, "not json", "not JSON"),
        ([600], "{}", "outside the vocabulary"),
    ],
)
async def test_bad_input_is_refused_with_what_to_fix(
    executor: Executor, prompt: list[int], params: str, needle: str
) -> None:
    m = model(executor, "tiny-lm-gen")
    with pytest.raises(InvalidArgument, match=needle.replace("(", r"\(").replace(")", r"\)")):
        executor.generate(m, prompt, parse_sampling(params, 512), False, None)


def test_settings_are_validated() -> None:
    with pytest.raises(InvalidArgument, match="prompt_buckets"):
        GenerationSettings(max_context=16, max_new_tokens=8, prompt_buckets=(32,), decode_slots=2)
    with pytest.raises(InvalidArgument, match="unknown \\[generation\\] key"):
        GenerationSettings.from_table({"max_context": 16, "slots": 2})
    s = GenerationSettings.from_table(
        {"max_context": 64, "max_new_tokens": 8, "prompt_buckets": [16, 8], "decode_slots": 6}
    )
    assert s.prompt_buckets == (8, 16) and s.decode_buckets == (1, 2, 4, 6)


async def test_cpu_compile_serves_mixed_lengths_with_no_compilation_after_warmup(tmp_path: Path) -> None:
    add_tiny_lm_variant(
        tmp_path, "tiny-lm-gen-compiled", prompt_buckets=[32], decode_slots=4, decode_buckets=[4]
    )
    ex = Executor(ExecutorConfig(), select_backend("cpu"), ModelRegistry(tmp_path))
    try:
        options = dataclasses.replace(ex.default_options(), mode="compile")
        assert isinstance(options, LoadOptions)
        m = await ex.load_model("tiny-lm-gen-compiled", "", options)
        assert m.findings.during_load.compilations == 2  # one prefill bucket, one decode width
        prompts = [list(range(1, n + 1)) for n in (3, 17, 9, 30, 1, 12)]
        streams = [
            ex.generate(m, p, SamplingParams(temperature=0.0, max_tokens=4 + i), False, None)
            for i, p in enumerate(prompts)
        ]
        results = await asyncio.gather(*(events(s) for s in streams))
        for i, (p, evs) in enumerate(zip(prompts, results, strict=True)):
            assert ids(evs) == tiny_lm_reference(p, 4 + i)
        assert m.compilations_after_warmup() == 0
    finally:
        await ex.close()


async def test_fp64_generation_keeps_float64_to_the_logprobs(llama_dir: Path, tmp_path: Path) -> None:
    """The trial's golden run: loaded in fp64, attention and logits stay float64, so its
    logprobs equal a float64 forward pass of the same weights far below float32 rounding."""
    import torch
    from transformers import LlamaForCausalLM

    ex = Executor(ExecutorConfig(), select_backend("cpu"), repository_with_llama(tmp_path, llama_dir))
    try:
        options = dataclasses.replace(ex.default_options(), precision="fp64")
        m = await ex.load_model("llama-tiny", "", options)
        assert m.engine is not None
        prompt = m.engine.tokenizer.encode("the quick brown")
        params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)
        evs = await events(ex.generate(m, prompt, params, False, None))
    finally:
        await ex.close()
    tokens = ids(evs)
    hf = LlamaForCausalLM.from_pretrained(llama_dir).double()
    hf.train(False)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0].double()
    expected = torch.log_softmax(logits, dim=-1)
    for i, e in enumerate(evs):
        (choice,) = e.choices
        assert choice.logprob is not None
        want = float(expected[len(prompt) - 1 + i, choice.token])
        assert abs(choice.logprob - want) < 1e-10, (i, choice.logprob, want)
