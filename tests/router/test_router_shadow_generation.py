"""Shadow for generation: a real router streams tiny-lm-gen from one CPU executor and mirrors
each greedy generation to another executor, compared online with the trial's divergence rule.
The perturbed variant's divergences and their first positions are in the shadow statistics
(RouterAdmin.ShadowReport); a control route mirroring to the same weights diverges nowhere;
sampled requests are not mirrored."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
import pytest_asyncio

from services.executor.executor_config import ExecutorConfig
from services.executor.executor_server import RunningExecutor, start_executor
from switchyard import codec
from switchyard.gen.inference import grpc_service_pb2 as pb
from switchyard.gen.inference import grpc_service_pb2_grpc as pbgrpc
from switchyard.gen.switchyard.v1 import router_pb2 as rpb
from switchyard.gen.switchyard.v1 import router_pb2_grpc as rgrpc
from tests.router.conftest import Metering, RouterFactory, routes_config, shadow_routes

pytestmark = pytest.mark.asyncio(loop_scope="session")
MODEL = "tiny-lm-gen"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def gen_executors() -> AsyncIterator[list[RunningExecutor]]:
    """Two CPU executors serving tiny-lm-gen; the second also its perturbed variant."""
    first = await start_executor(ExecutorConfig(models=(MODEL,)))
    second = await start_executor(ExecutorConfig(models=(MODEL,)))
    await second.executor.load_model(MODEL, "perturbed", second.executor.default_options())
    yield [first, second]
    await asyncio.gather(first.stop(0), second.stop(0))


def _request(model: str, prompt: bytes, sampling: dict[str, object], stream: bool) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name=model)
    r.inputs.add(name="input_ids", datatype="INT64", shape=[len(prompt)])
    r.raw_input_contents.append(np.frombuffer(prompt, dtype=np.uint8).astype(np.int64).tobytes())
    r.inputs.add(name="stream", datatype="BOOL", shape=[1])
    r.raw_input_contents.append(np.asarray([stream], dtype=np.bool_).tobytes())
    r.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
    r.raw_input_contents.append(codec.encode_bytes([json.dumps(sampling).encode()]))
    return r


async def test_mirrored_generations_are_compared_with_the_divergence_rule(
    metering: Metering, gen_executors: list[RunningExecutor], make_router: RouterFactory
) -> None:
    primary, candidate = gen_executors[0].address, gen_executors[1].address
    cfg = routes_config({"a": primary, "b": candidate}, shadow_routes(MODEL, "gen-control"))
    router = await make_router(cfg, metering.running.address)
    key, _ = await metering.key("svc-gen-shadow", "research")
    metadata = [("authorization", f"Bearer {key}")]
    greedy: dict[str, object] = {"temperature": 0, "max_tokens": 12, "ignore_eos": True, "logprobs": 5}
    prompts = [b"the quick brown fox", b"shadow traffic", b"hello tokens", b"a switchyard"]
    async with grpc.aio.insecure_channel(router.address) as channel:
        stub = pbgrpc.GRPCInferenceServiceStub(channel)
        for model in (MODEL, "gen-control"):
            for i, prompt in enumerate(prompts):
                stream = i % 2 == 0  # streamed and unary generations are both mirrored
                request = _request(model, prompt, greedy, stream)
                if stream:
                    got = [
                        r async for r in stub.ModelStreamInfer(iter([request]), metadata=metadata, timeout=60)
                    ]
                    assert all(not r.error_message for r in got) and 1 <= len(got) <= 12
                    # a response per token, or several tokens in one when the reader lagged
                    ids = [
                        np.frombuffer(r.infer_response.raw_output_contents[i], "<i8")
                        for r in got
                        for i, o in enumerate(r.infer_response.outputs)
                        if o.name == "output_ids"
                    ]
                    assert len(ids) == len(got) and sum(len(i) for i in ids) == 12
                    last = got[-1].infer_response.parameters
                    assert last["num_output_tokens"].int64_param == 12
                    assert last["triton_final_response"].bool_param
                else:
                    reply = await stub.ModelInfer(request, metadata=metadata, timeout=60)
                    assert reply.model_name == model
            sampled = _request(model, b"sampled", {"temperature": 0.8, "max_tokens": 4}, True)
            [r async for r in stub.ModelStreamInfer(iter([sampled]), metadata=metadata, timeout=60)]
        report = None
        for _ in range(200):
            report = await rgrpc.RouterAdminStub(channel).ShadowReport(
                rpb.ShadowReportRequest(), metadata=metadata
            )
            by_model = {s.model: s for s in report.stats}
            if (
                all(s.generations + s.failures >= 4 and s.sampled >= 1 for s in by_model.values())
                and len(by_model) == 2
            ):
                break
            await asyncio.sleep(0.05)
    assert report is not None
    by_model = {s.model: s for s in report.stats}
    perturbed, control = by_model[MODEL], by_model["gen-control"]
    assert perturbed.candidate == f"b/{MODEL}:perturbed" and perturbed.failures == 0
    assert perturbed.generations == 4 and perturbed.sampled == 1 and perturbed.comparer == "generation"
    # the perturbed weights diverge, and the first diverging positions are in the statistics
    assert perturbed.token_divergences >= 1 and perturbed.first_divergence_min >= 0
    assert perturbed.rule_failures >= 1 and perturbed.diverged == perturbed.rule_failures
    assert 0 <= perturbed.first_divergence_min <= perturbed.first_divergence_mean < 12
    assert (
        list(perturbed.first_divergences)
        and min(perturbed.first_divergences) == perturbed.first_divergence_min
    )
    assert any("position" in r for r in perturbed.last_reasons)
    # the same weights on another executor: identical tokens, nothing diverged
    assert control.generations == 4 and control.token_divergences == 0 and control.diverged == 0
    assert control.first_divergence_min == -1 and control.sampled == 1
