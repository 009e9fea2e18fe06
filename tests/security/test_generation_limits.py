"""Generation against the per-principal limits, as an attacker would try to dodge them: real
metering (SQLite), a real llama-tiny executor and a real router's OpenAI HTTP port.

At 0.2 requests/s with burst 1, a principal gets one /v1/completions answer and then 429 (the
issue's run answered 6 of 6 in 0.1 s), and one request with `n = 4` is not 4 generations for
one token: its choices take a token each, so it is refused and leaves the bucket empty.
Stop lists at and over their bounds (count, total bytes, the issue's 400k strings) and tensors
deeper than MAX_RANK (65 dimensions reached numpy's reshape, INTERNAL) get INVALID_ARGUMENT
naming the limit.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from services.executor.executor_server import RunningExecutor
from services.executor.generation.settings import MAX_STOP_BYTES, MAX_STOPS
from services.router.router_server import RunningRouter
from switchyard.codec import MAX_RANK
from switchyard.gen.inference import grpc_service_pb2 as ipb
from tests.gen_models import start_llama_executor
from tests.router.conftest import Metering, RouterFactory, make_router, metering, routes_config

__all__ = ["make_router", "metering"]  # fixtures, used by name

pytestmark = pytest.mark.asyncio(loop_scope="session")
MODEL = "llama-tiny"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def gen_executor(
    llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RunningExecutor]:
    running = await start_llama_executor(tmp_path_factory.mktemp("limits-gen-repo"), llama_dir, (MODEL,))
    yield running
    await running.stop(0)


async def _post(router: RunningRouter, key: str, body: dict[str, object]) -> tuple[int, str]:
    assert router.openai is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", router.openai.port)
    payload = json.dumps(body).encode()
    writer.write(
        (
            f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(payload)}\r\nconnection: close\r\n\r\n"
        ).encode()
        + payload
    )
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 60)
    writer.close()
    head, _, rest = raw.decode().partition("\r\n\r\n")
    return int(head.split()[1]), rest


async def test_completions_and_n_choices_take_the_principals_tokens(
    gen_executor: RunningExecutor, metering: Metering, make_router: RouterFactory
) -> None:
    routes = {MODEL: {"policy": "pinned", "targets": ["gen"]}}
    cfg = routes_config(
        {"gen": gen_executor.address},
        routes,
        openai_port=0,
        usage_flush_s=0.05,
        principal_rate_per_s=0.2,
        principal_burst=1,
    )
    router = await make_router(cfg, metering.running.address)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0}
    key, _ = await metering.key(f"gen-rate-{time.monotonic_ns()}", "team-gen")
    statuses = [(await _post(router, key, body))[0] for _ in range(4)]
    assert statuses[0] == 200 and statuses[1:] == [429, 429, 429], statuses
    many, _ = await metering.key(f"gen-n-{time.monotonic_ns()}", "team-gen")
    status, text = await _post(router, many, {**body, "n": 4})
    assert status == 429 and "rate" in text, (status, text)
    status, _ = await _post(router, many, body)  # the n request spent the one token it had
    assert status == 429


async def test_stop_lists_at_the_bound_and_deep_tensors_get_invalid_argument(
    gen_executor: RunningExecutor, metering: Metering, make_router: RouterFactory
) -> None:
    routes = {MODEL: {"policy": "pinned", "targets": ["gen"]}}
    cfg = routes_config({"gen": gen_executor.address}, routes, openai_port=0, usage_flush_s=0.05)
    router = await make_router(cfg, metering.running.address)
    key, _ = await metering.key(f"gen-bounds-{time.monotonic_ns()}", "team-gen")
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0}
    assert (await _post(router, key, {**body, "stop": ["zz"] * MAX_STOPS}))[0] == 200  # at the bound
    status, text = await _post(router, key, {**body, "stop": ["zz"] * (MAX_STOPS + 1)})
    assert status == 400 and f"the limit is {MAX_STOPS}" in text, (status, text)
    status, text = await _post(router, key, {**body, "stop": ["z" * 1024] * 5})  # 5 KiB, 5 strings
    assert status == 400 and f"the limit is {MAX_STOP_BYTES}" in text, (status, text)
    status, text = await _post(router, key, {**body, "stop": ["x"] * 400_000})  # the 3.5 MiB
    assert status == 400 and "strings; the limit" in text, (status, text)
    for rank in (MAX_RANK + 1, 65):  # 65 dimensions reached numpy's reshape: INTERNAL
        request = ipb.ModelInferRequest(model_name=MODEL)
        request.inputs.add(name="text_input", datatype="FP32", shape=[1] * rank)
        request.raw_input_contents.append(b"\0\0\0\0")
        async with grpc.aio.insecure_channel(router.address) as channel:
            infer = channel.unary_unary(
                "/inference.GRPCInferenceService/ModelInfer",
                request_serializer=ipb.ModelInferRequest.SerializeToString,
                response_deserializer=ipb.ModelInferResponse.FromString,
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await infer(request, metadata=(("authorization", f"Bearer {key}"),), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
        assert f"{rank} dimensions; the limit is {MAX_RANK}" in (refused.value.details() or "")
