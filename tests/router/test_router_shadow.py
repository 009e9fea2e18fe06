"""Shadow mode: the caller gets the primary answer; the perturbed variant's divergence is recorded.

A control route mirrors to the *unperturbed* model on another executor, so the test also
shows that the comparison does not call everything divergent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import grpc
import numpy as np
import pytest
from sqlalchemy import select

from services.evaluator.evaluator_server import start_evaluator
from services.executor.executor_server import RunningExecutor
from services.metering.schema import LINES
from services.router.shadow_divergence import divergence
from switchyard.gen.inference import grpc_service_pb2 as pb
from switchyard.gen.inference import grpc_service_pb2_grpc as pbgrpc
from switchyard.gen.switchyard.v1 import router_pb2 as rpb
from switchyard.gen.switchyard.v1 import router_pb2_grpc as rgrpc
from switchyard.grpcio import ServerOptions
from tests.router.conftest import Metering, RouterFactory, routes_config, shadow_routes

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_shadow_on_the_perturbed_variant_records_divergence(
    metering: Metering, executors: list[RunningExecutor], make_router: RouterFactory
) -> None:
    primary, candidate = executors[0].address, executors[1].address
    cfg = routes_config({"a": primary, "b": candidate}, shadow_routes("mlp", "mlp-control"))
    evaluator = await start_evaluator(ServerOptions())
    cfg = dataclasses.replace(cfg, settings=dataclasses.replace(cfg.settings, evaluator=evaluator.address))
    router = await make_router(cfg, metering.running.address)
    key, _ = await metering.key("svc-shadow", "research")
    metadata = [("authorization", f"Bearer {key}")]
    rng = np.random.default_rng(11)
    async with (
        grpc.aio.insecure_channel(router.address) as channel,
        grpc.aio.insecure_channel(primary) as own_ch,
    ):
        stub = pbgrpc.GRPCInferenceServiceStub(channel)
        direct = pbgrpc.GRPCInferenceServiceStub(own_ch)
        for i in range(8):
            x = rng.standard_normal((1, 64)).astype(np.float32)
            for model in ("mlp", "mlp-control"):
                req = pb.ModelInferRequest(model_name=model)
                req.inputs.add(name="x", datatype="FP32", shape=[1, 64])
                req.raw_input_contents.append(x.tobytes())
                reply = await stub.ModelInfer(req, metadata=metadata, timeout=10)
                assert reply.model_name == model
                if i == 0 and model == "mlp":  # the caller got the primary's answer, not the shadow's
                    req.model_name = "mlp"
                    own = await direct.ModelInfer(req, timeout=10)
                    assert reply.raw_output_contents[0] == own.raw_output_contents[0]
        for _ in range(100):
            stats = {s.model: s for s in router.router.mirror.stats.values()}
            if sum(s.pairs + s.failures for s in stats.values()) == 16:
                break
            await asyncio.sleep(0.05)
        report = await rgrpc.RouterAdminStub(channel).ShadowReport(
            rpb.ShadowReportRequest(), metadata=metadata
        )
    await evaluator.drain(0)
    by_model = {s.model: s for s in report.stats}
    perturbed, control = by_model["mlp"], by_model["mlp-control"]
    assert perturbed.candidate == "b/mlp:perturbed" and perturbed.pairs == 8 and perturbed.failures == 0
    assert perturbed.diverged == 8 and perturbed.max_abs_error > 1e-3 and perturbed.min_cosine < 1.0
    assert control.pairs == 8 and control.diverged == 0 and control.max_abs_error < 1e-5
    assert perturbed.comparer == control.comparer == "evaluator"  # the pairs went to the evaluator

    # Each pair is also in the ledger: the shadow arm's usage line carries its divergence.
    assert router.router.spool is not None and await router.router.spool.drain(5.0)
    with metering.running.ledger.engines.write.connect() as conn:
        rows = conn.execute(
            select(LINES.c.tags_json).where(LINES.c.arm == "shadow", LINES.c.model == "mlp")
        ).all()
    tags = [json.loads(r[0]) for r in rows]
    assert len(tags) == 8 and all(t["diverged"] == "true" and float(t["max_abs_error"]) > 1e-3 for t in tags)
    assert {t["comparer"] for t in tags} == {"evaluator"}


def _response(values: list[float]) -> pb.ModelInferResponse:
    reply = pb.ModelInferResponse(model_name="m")
    reply.outputs.add(name="y", datatype="FP32", shape=[1, len(values)])
    reply.raw_output_contents.append(np.asarray(values, np.float32).tobytes())
    return reply


async def test_local_divergence_when_no_evaluator() -> None:
    same = divergence(_response([1.0, 2.0]), _response([1.0, 2.0]), atol=1e-5, rtol=1e-4)
    assert not same.diverged and same.max_abs_error == 0.0 and same.cosine == pytest.approx(1.0)
    off = divergence(_response([1.0, 2.0]), _response([1.0, 2.5]), atol=1e-5, rtol=1e-4)
    assert off.diverged and off.max_abs_error == pytest.approx(0.5) and off.mismatch_share == 0.5
    shape = divergence(_response([1.0, 2.0]), _response([1.0]), atol=1e-5, rtol=1e-4)
    assert shape.diverged and "shape" in shape.reason
