"""Generation on the xla executor (a real process in the XLA environment, PJRT CPU): every
prefill bucket and decode width compiles at warm-up, and a mixed-length streamed workload
then compiles nothing; greedy tokens equal tiny-lm's full-forward decoding on cpu eager."""

from __future__ import annotations

import queue
import time
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as triton

from tests.gen_models import tiny_lm_reference, token_inputs
from tests.xla.conftest import ExecutorProcess

pytestmark = [pytest.mark.xla, pytest.mark.slow]


@pytest.fixture(scope="module")
def xla_generation(executors: dict[str, ExecutorProcess]) -> ExecutorProcess:
    """The package's xla executor (tests/xla/conftest.py), which serves tiny-lm-gen too."""
    return executors["xla"]


def _request(prompt: list[int], max_tokens: int) -> list[Any]:
    return token_inputs(prompt, True, {"temperature": 0, "max_tokens": max_tokens})


def test_xla_serves_a_mixed_length_stream_with_zero_compilations(xla_generation: ExecutorProcess) -> None:
    prompts = {f"r{i}": [(13 * i + 5 * j) % 256 for j in range(2 + (i * 9) % 31)] for i in range(10)}
    lengths = {rid: 3 + (i * 7) % 18 for i, rid in enumerate(prompts)}
    client = triton.InferenceServerClient(xla_generation.address)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    compilations: list[int] = []
    try:
        for rid, prompt in prompts.items():
            client.async_stream_infer("tiny-lm-gen", _request(prompt, lengths[rid]), request_id=rid)
        open_ids = set(prompts)
        until = time.monotonic() + 300
        while open_ids:
            result, error = answers.get(timeout=max(1.0, until - time.monotonic()))
            assert error is None, str(error)
            response = result.get_response()
            tokens[response.id] += [int(t) for t in result.as_numpy("output_ids")]
            compilations.append(response.parameters["compilations_after_warmup"].int64_param)
            if response.parameters["triton_final_response"].bool_param:
                open_ids.discard(response.id)
    finally:
        client.stop_stream()
        client.close()
    assert set(compilations) == {0}
    for rid, prompt in prompts.items():
        assert tokens[rid] == tiny_lm_reference(prompt, lengths[rid]), rid


async def test_the_openai_client_through_a_router_to_the_xla_executor(
    xla_generation: ExecutorProcess, tmp_path: Path
) -> None:
    """Streaming and not, the completion equals tiny-lm's greedy decoding on cpu eager."""
    import openai

    from services.router import router_config
    from services.router.router_server import start_router
    from switchyard.grpcio import ServerOptions

    cfg = router_config.parse(
        {
            "router": {"require_auth": False, "openai_port": 0},
            "deployments": {"xla": {"address": xla_generation.address, "path": "xla-pjrt-cpu"}},
            "routes": {"tiny-lm-gen": {"policy": "pinned", "targets": [{"deployment": "xla"}]}},
        }
    )
    router = await start_router(cfg, "", ServerOptions(), tmp_path / "spool")
    assert router.openai is not None
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{router.openai.port}/v1", api_key="-", max_retries=0
    )
    prompt = list(b"switchyard on xla")
    expected = bytes(t for t in tiny_lm_reference(prompt, 12) if t < 256).decode(errors="replace")
    try:
        whole = await client.completions.create(
            model="tiny-lm-gen", prompt=prompt, max_tokens=12, temperature=0
        )
        assert whole.choices[0].text == expected
        assert whole.usage is not None and whole.usage.completion_tokens == 12
        stream = await client.completions.create(
            model="tiny-lm-gen", prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
        assert "".join([c.choices[0].text async for c in stream if c.choices]) == expected
    finally:
        await client.close()
        await router.stop(0)
