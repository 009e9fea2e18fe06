"""Generation over OIP on a real executor (grpc.aio, port 0) with tritonclient: Triton's
decoupled semantics on ModelStreamInfer (start_stream / async_stream_infer), the whole
completion on ModelInfer, and the vLLM backend's tensor names."""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from services.executor.executor_server import RunningExecutor
from switchyard.gen.inference import grpc_service_pb2 as oip
from switchyard.gen.inference import grpc_service_pb2_grpc as oip_grpc
from tests.gen_models import reference_greedy, start_llama_executor, text_inputs

MODEL = "llama-tiny"


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def executor(
    llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RunningExecutor]:
    root = tmp_path_factory.mktemp("gen-oip-repo")
    running = await start_llama_executor(root, llama_dir, (MODEL, "tiny-lm-gen", "mlp"))
    yield running
    await running.stop(1)


def final(result: Any) -> bool:
    return bool(result.get_response().parameters["triton_final_response"].bool_param)


def stream_requests(
    address: str, requests: list[tuple[str, list[Any]]], timeout_s: float = 60
) -> dict[str, list[Any]]:
    """Sends every request on one stream; returns each id's results (or errors) until its final one."""
    client = triton.InferenceServerClient(address)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    out: dict[str, list[Any]] = {rid: [] for rid, _ in requests}
    try:
        for rid, inputs in requests:
            client.async_stream_infer(
                MODEL if not rid.startswith("tiny") else "tiny-lm-gen", inputs, request_id=rid
            )
        open_ids = set(out)
        until = time.monotonic() + timeout_s
        while open_ids and time.monotonic() < until:
            result, error = answers.get(timeout=until - time.monotonic())
            if error is not None:
                rid = next(iter(open_ids)) if len(open_ids) == 1 else "error"
                out.setdefault(rid, []).append(error)
                open_ids.discard(rid)
                continue
            rid = result.get_response().id
            out[rid].append(result)
            if final(result):
                open_ids.discard(rid)
        assert not open_ids, f"no final response for {open_ids}"
    finally:
        client.stop_stream()
        client.close()
    return out


def texts(results: list[Any]) -> str:
    return "".join(r.as_numpy("text_output")[0].decode() for r in results)


async def test_streamed_tokens_equal_the_whole_completion_and_hf_generate(
    executor: RunningExecutor, llama_dir: Path
) -> None:
    greedy = {"temperature": 0, "max_tokens": 20}
    prompts = {"a": "the quick brown", "b": "hello world", "c": "serving language models one token"}
    requests = [(rid, text_inputs(p, True, greedy)) for rid, p in prompts.items()]
    streamed = await asyncio.to_thread(stream_requests, executor.address, requests)
    model = executor.executor.find(MODEL, "")
    assert model.engine is not None
    tokenizer = model.engine.tokenizer

    def whole(prompt: str) -> Any:
        with triton.InferenceServerClient(executor.address) as client:
            return client.infer(MODEL, text_inputs(prompt, False, greedy, exclude=True))

    for rid, prompt in prompts.items():
        results = streamed[rid]
        assert len(results) > 1 and [final(r) for r in results] == [False] * (len(results) - 1) + [True]
        ids = [int(t) for r in results for t in r.as_numpy("output_ids")]
        assert ids == reference_greedy(llama_dir, tokenizer.encode(prompt), 20)
        last = results[-1].get_response().parameters
        assert last["finish_reason"].string_param in ("stop", "length")
        assert last["num_output_tokens"].int64_param == len(ids)
        assert last["num_input_tokens"].int64_param == len(tokenizer.encode(prompt))
        assert last["compilations_after_warmup"].int64_param == 0
        unary = await asyncio.to_thread(whole, prompt)
        assert unary.as_numpy("text_output")[0].decode() == texts(results)
        assert [int(t) for t in unary.as_numpy("output_ids")] == ids


# a client window of 1 KiB (no BDP probing): a consumer that stops reading stalls the writer
LAGGING = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]


def lagging_stream(address: str, inputs: list[Any], pause_s: float) -> list[Any]:
    """One request on a stream whose consumer stops for `pause_s` after the first response."""
    client = triton.InferenceServerClient(address, channel_args=LAGGING)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    paused = threading.Event()

    def take(result: Any, error: Any) -> None:
        answers.put((result, error))
        # once, after the first response: a check of the queue's size (it was) paused again
        # after every response, as the test's thread had taken the last one, 1 s each
        if not paused.is_set():
            paused.set()
            time.sleep(pause_s)  # the stream's reader thread: nothing is read meanwhile

    client.start_stream(callback=take)
    out: list[Any] = []
    try:
        client.async_stream_infer(MODEL, inputs, request_id="lag")
        while not out or not final(out[-1]):
            result, error = answers.get(timeout=60)
            assert error is None, error
            out.append(result)
    finally:
        client.stop_stream()
        client.close()
    return out


async def test_a_consumer_that_lags_gets_the_tokens_that_came_meanwhile_in_one_response(
    executor: RunningExecutor, llama_dir: Path
) -> None:
    sampling = {"temperature": 0, "max_tokens": 40, "logprobs": 2}
    prompt = "the quick brown"
    results = await asyncio.to_thread(
        lagging_stream, executor.address, text_inputs(prompt, True, sampling), 1.0
    )
    model = executor.executor.find(MODEL, "")
    assert model.engine is not None
    tokenizer = model.engine.tokenizer
    want = reference_greedy(llama_dir, tokenizer.encode(prompt), 40)
    assert len(want) > 10  # enough tokens to come while the consumer is away
    assert 1 < len(results) < len(want)  # several tokens in one response while it was away
    assert [final(r) for r in results] == [False] * (len(results) - 1) + [True]
    counts = [int(r.get_response().parameters["num_output_tokens"].int64_param) for r in results]
    ids_of = [[int(t) for t in r.as_numpy("output_ids")] for r in results]
    logprobs_of = [json.loads(r.get_response().parameters["logprobs"].string_param) for r in results]
    previous = [0, *counts[:-1]]
    assert [len(ids) for ids in ids_of] == [b - a for a, b in zip(previous, counts, strict=True)]
    assert [[e["id"] for e in lp] for lp in logprobs_of] == ids_of  # one entry per token, in order
    assert counts[-1] == len(want) and max(len(ids) for ids in ids_of) > 1
    ids = [t for chunk in ids_of for t in chunk]
    assert ids == want

    def whole() -> Any:
        with triton.InferenceServerClient(executor.address) as client:
            return client.infer(MODEL, text_inputs(prompt, False, sampling, exclude=True))

    unary = await asyncio.to_thread(whole)
    assert unary.as_numpy("text_output")[0].decode() == texts(results)
    assert [int(t) for t in unary.as_numpy("output_ids")] == ids


async def test_the_prompt_is_prepended_unless_excluded_and_stream_false_answers_once(
    executor: RunningExecutor,
) -> None:
    greedy = {"temperature": 0, "max_tokens": 8}
    requests = [("once", text_inputs("hello", False, greedy))]
    (result,) = (await asyncio.to_thread(stream_requests, executor.address, requests))["once"]
    assert final(result)
    text = result.as_numpy("text_output")[0].decode()
    assert text.startswith("hello") and len(text) > len("hello")


async def test_modelinfer_with_stream_true_is_unimplemented_as_triton_answers(
    executor: RunningExecutor,
) -> None:
    def call() -> None:
        with triton.InferenceServerClient(executor.address) as client:
            client.infer(MODEL, text_inputs("hello", True, {"max_tokens": 4}))

    with pytest.raises(InferenceServerException, match="stream=true needs ModelStreamInfer") as info:
        await asyncio.to_thread(call)
    assert "UNIMPLEMENTED" in str(info.value.status())


@pytest.mark.parametrize(
    ("prompt", "sampling", "needle"),
    [
        ("", {}, "prompt is empty"),
        ("x" * 200, {}, "over this model's longest prompt of 32 tokens"),
        ("hello", {"max_tokens": 500}, "max_tokens is 500, over this model's limit of 40"),
        ("hello", {"temprature": 1}, "unknown sampling parameter 'temprature'"),
        ("hello", {"top_p": 2}, "'top_p' is 2.0"),
    ],
)
async def test_bad_input_on_the_stream_is_answered_in_band(
    executor: RunningExecutor, prompt: str, sampling: dict[str, Any], needle: str
) -> None:
    answers = await asyncio.to_thread(
        stream_requests, executor.address, [("bad", text_inputs(prompt, True, sampling))]
    )
    (error,) = answers["bad"]
    assert isinstance(error, InferenceServerException)
    assert "INVALID_ARGUMENT" in str(error) and needle in str(error)


async def test_a_prompt_over_the_bytes_bound_is_refused_before_it_is_decoded(
    executor: RunningExecutor,
) -> None:
    """A generation's BYTES inputs are bounded as a tensor request's are (`max_bytes_elements`),
    on ModelInfer and on a stream (in-band), before a byte of them is decoded."""
    over = executor.executor.config.max_bytes_elements + 1
    request = oip.ModelInferRequest(model_name="tiny-lm-gen", id="huge")
    request.inputs.add(name="text_input", datatype="BYTES", shape=[over])
    request.raw_input_contents.append(b"")  # declared, never sent: the shape alone is refused
    async with grpc.aio.insecure_channel(executor.address) as channel:
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ModelInfer(request, timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"{over} BYTES elements" in (info.value.details() or "")
        answers = [a async for a in stub.ModelStreamInfer(iter([request]), timeout=10)]
    (answer,) = answers
    assert answer.error_message.startswith("RESOURCE_EXHAUSTED: ") and answer.infer_response.id == "huge"


async def test_a_client_that_leaves_mid_stream_frees_its_slot(executor: RunningExecutor) -> None:
    model = executor.executor.find("tiny-lm-gen", "")
    assert model.engine is not None
    cancelled = model.engine.counters.cancelled

    def leave() -> int:
        client = triton.InferenceServerClient(executor.address)
        got: queue.Queue[Any] = queue.Queue()
        client.start_stream(callback=lambda result, error: got.put(result))
        client.async_stream_infer(
            "tiny-lm-gen", text_inputs("leaving", True, {"max_tokens": 56, "ignore_eos": True})
        )
        got.get(timeout=60)  # the first token came
        client.stop_stream(cancel_requests=True)
        client.close()
        return got.qsize()

    await asyncio.to_thread(leave)
    for _ in range(200):
        if model.engine.running == 0:
            break
        await asyncio.sleep(0.05)
    assert model.engine.running == 0
    assert model.engine.counters.cancelled == cancelled + 1


async def test_model_config_says_decoupled_and_other_models_still_answer_on_the_stream(
    executor: RunningExecutor,
) -> None:
    def check() -> tuple[Any, Any, Any]:
        with triton.InferenceServerClient(executor.address) as client:
            config = client.get_model_config(MODEL, as_json=True)
            plain = client.get_model_config("mlp", as_json=True)
            meta = client.get_model_metadata(MODEL, as_json=True)
            return config, plain, meta

    config, plain, meta = await asyncio.to_thread(check)
    assert config["config"]["model_transaction_policy"]["decoupled"] is True
    assert "model_transaction_policy" not in plain["config"]
    assert {i["name"] for i in meta["inputs"]} >= {"text_input", "stream", "sampling_parameters", "input_ids"}
