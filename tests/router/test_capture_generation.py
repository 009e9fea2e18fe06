"""Workload capture of generations: a completed streamed OIP generation and OpenAI
completions (unary and `stream=true`) of a capturing route are kept as their input tensors
(the prompt and the sampling parameters, Triton's vLLM-backend names), nothing of the caller;
a failed one is not kept."""

from __future__ import annotations

import asyncio
import json
import queue
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio
import tritonclient.grpc as triton

from services.executor.executor_config import ExecutorConfig
from services.executor.executor_server import RunningExecutor, start_executor
from switchyard.gen.inference import grpc_service_pb2 as pb
from switchyard.judge.capture_format import SEEN, find_workload, list_workloads, read_records
from tests.gen_models import text_inputs
from tests.router.conftest import Metering, RouterFactory, routes_config
from workflows.generation import load as genload

pytestmark = pytest.mark.asyncio(loop_scope="session")
MODEL = "tiny-lm-gen"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def gen_executor() -> AsyncIterator[RunningExecutor]:
    running = await start_executor(ExecutorConfig(models=(MODEL,)))
    yield running
    await running.stop(0)


def _stream(address: str, key: str, prompt: str, sampling: dict[str, Any]) -> list[Any]:
    got: queue.Queue[Any] = queue.Queue()
    client = triton.InferenceServerClient(address)
    try:
        client.start_stream(
            lambda result, error: got.put(error or result), headers={"authorization": f"Bearer {key}"}
        )
        client.async_stream_infer(MODEL, text_inputs(prompt, True, sampling), request_id="secret-request")
        out = []
        while True:
            item = got.get(timeout=60)
            out.append(item)
            if (
                isinstance(item, Exception)
                or item.get_response().parameters["triton_final_response"].bool_param
            ):
                return out
    finally:
        client.stop_stream()
        client.close()


def _inputs(request: pb.ModelInferRequest) -> dict[str, bytes]:
    return {t.name: raw for t, raw in zip(request.inputs, request.raw_input_contents, strict=True)}


async def test_streamed_and_openai_generations_are_captured_as_their_prompts(
    gen_executor: RunningExecutor, metering: Metering, make_router: RouterFactory, tmp_path: Path
) -> None:
    workloads = tmp_path / "workloads"
    routes = {MODEL: {"policy": "pinned", "targets": ["gen"], "capture": {"share": 1.0, "max_mb": 4}}}
    cfg = routes_config({"gen": gen_executor.address}, routes, openai_port=0, workloads_dir=str(workloads))
    router = await make_router(cfg, metering.running.address)
    key, _ = await metering.key("svc-capture-gen", "team-gen", "infer", "*")
    sampling = {"temperature": 0, "max_tokens": 5, "ignore_eos": True}
    streamed = await asyncio.to_thread(_stream, router.address, key, "hello world", sampling)
    assert not any(isinstance(r, Exception) for r in streamed)
    assert router.openai is not None
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{router.openai.port}/v1", api_key=key, max_retries=0
    )
    try:
        done = await client.completions.create(
            model=MODEL, prompt="the quick", max_tokens=3, temperature=0.5, seed=9
        )
        assert done.usage is not None and done.usage.completion_tokens >= 1
        chunks = await client.completions.create(
            model=MODEL, prompt="a stream", max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        got = [c async for c in chunks]
        assert len([c for c in got if c.choices]) >= 2 and got[-1].usage is not None
        assert got[-1].usage.completion_tokens == 4
        with pytest.raises(openai.BadRequestError):  # refused before it runs: not captured
            await client.completions.create(model=MODEL, prompt="x", max_tokens=500)
    finally:
        await client.close()
    capture = router.router.captures[MODEL]
    assert capture.stats.sampled == 3
    await capture.close()

    (entry,) = list_workloads(workloads)
    path, _ = find_workload(workloads, entry["id"])
    records = read_records(path, entry["sha256"], pb.ModelInferRequest.FromString)
    assert entry["requests"] == 3 and len(records) == 3
    first, second, third = (_inputs(r) for r in records)
    assert _text(first["text_input"]) == "hello world"
    assert json.loads(_text(first["sampling_parameters"])) == sampling
    assert _text(second["text_input"]) == "the quick"
    params = json.loads(_text(second["sampling_parameters"]))
    assert (params["max_tokens"], params["temperature"], params["seed"]) == (3, 0.5, 9)
    assert _text(third["text_input"]) == "a stream"  # OpenAI stream=true, kept as the others
    assert json.loads(_text(third["sampling_parameters"]))["max_tokens"] == 4
    assert all(not r.id for r in records)  # nothing of the caller; the router's own count only
    seen = [r.parameters[SEEN].int64_param for r in records]
    assert seen == [sampling["max_tokens"], done.usage.completion_tokens, 4]
    assert all(set(r.parameters) == {SEEN} for r in records)
    # what a generation trial replays (inputs.workload of a generation scenario): each prompt
    # with the length its answer had
    replay = genload.captured_requests(records, 16)
    assert [(r.text, r.max_tokens) for r in replay] == [
        ("hello world", seen[0]),
        ("the quick", seen[1]),
        ("a stream", 4),
    ]
    stopped = pb.ModelInferRequest()
    stopped.CopyFrom(records[0])
    stopped.parameters[SEEN].int64_param = 2  # an answer that ended at EOS after 2 of its 5
    assert genload.captured_requests([stopped], 16)[0].max_tokens == 2
    del stopped.parameters[SEEN]  # a record without the count: the request's own max_tokens
    assert genload.captured_requests([stopped], 16)[0].max_tokens == sampling["max_tokens"]
    assert key.encode() not in path.read_bytes() and b"secret-request" not in path.read_bytes()


def _text(raw: bytes) -> str:
    """The one element of a BYTES tensor (4-byte little-endian length, then the bytes)."""
    (length,) = struct.unpack_from("<I", raw)
    assert len(raw) == 4 + length
    return raw[4:].decode()
