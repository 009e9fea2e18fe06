"""The evaluator over gRPC: a real grpc.aio server on port 0, bad input gets INVALID_ARGUMENT."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest

from services.evaluator.evaluator_server import start_evaluator
from switchyard.gen.switchyard.v1 import evaluator_pb2 as pb
from switchyard.gen.switchyard.v1 import evaluator_pb2_grpc as pb_grpc
from switchyard.grpcio import ServerOptions
from switchyard.judge.tensors import encode


@pytest.fixture(scope="module")
async def stub() -> AsyncIterator[pb_grpc.EvaluatorAsyncStub]:
    server = await start_evaluator(ServerOptions(port=0))
    async with grpc.aio.insecure_channel(server.address) as channel:
        yield pb_grpc.EvaluatorStub(channel)
    await server.drain(0)


def _tensor(values: np.ndarray, datatype: str = "FP32") -> pb.Tensor:
    return pb.Tensor(datatype=datatype, shape=list(values.shape), data=encode(values, datatype))


async def test_compare_logits_passes_with_justification(stub: pb_grpc.EvaluatorAsyncStub) -> None:
    golden = np.random.default_rng(0).standard_normal((2, 4, 16))
    ref = golden.astype(np.float32)
    response = await stub.Compare(
        pb.CompareRequest(
            output_name="logits",
            reference=_tensor(ref),
            candidate=_tensor(ref + np.float32(1e-7)),
            golden=_tensor(golden, "FP64"),
            reference_repeat=_tensor(ref),
            criteria=pb.Criteria(precision="fp32", logits=True),
        )
    )
    assert response.passed and response.verdict == "PASS"
    assert response.metrics.top1_agreement == 1.0 and response.metrics.reference_deterministic
    assert response.metrics.elements == 128
    assert "float64" in response.justification
    assert len(response.reasons) == 5  # rmse, cosine, top-1, top-k, KL


async def test_bad_input_is_invalid_argument_and_server_keeps_serving(
    stub: pb_grpc.EvaluatorAsyncStub,
) -> None:
    ref = np.ones((2, 2), dtype=np.float32)
    bad = pb.Tensor(datatype="FP32", shape=[2, 2], data=b"\0" * 15)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Compare(pb.CompareRequest(reference=_tensor(ref), candidate=bad))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "candidate: 15 bytes" in (err.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Compare(pb.CompareRequest(reference=_tensor(ref)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "candidate: missing" in (err.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.CompareLoss(pb.CompareLossRequest(reference=[1.0], candidate=[1.0], precision="int4"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ok = await stub.Compare(pb.CompareRequest(reference=_tensor(ref), candidate=_tensor(ref)))
    assert ok.passed and "No float64 run" in ok.justification


async def test_compare_loss(stub: pb_grpc.EvaluatorAsyncStub) -> None:
    response = await stub.CompareLoss(
        pb.CompareLossRequest(reference=[3.0, 2.0, 1.0], candidate=[3.0, 2.5, 1.9], target_loss=1.5)
    )
    assert not response.passed
    assert response.reference_steps_to_target == 3 and response.candidate_steps_to_target == -1
    assert response.deviation[0] == 0.0


async def test_candidate_repeat_travels_and_names_non_determinism(stub: pb_grpc.EvaluatorAsyncStub) -> None:
    rng = np.random.default_rng(1)
    golden = rng.standard_normal((4, 8))
    ref = golden.astype(np.float32)
    noisy = [(ref + rng.standard_normal(ref.shape) * 1e-2).astype(np.float32) for _ in range(2)]
    response = await stub.Compare(
        pb.CompareRequest(
            output_name="y",
            reference=_tensor(ref),
            candidate=_tensor(noisy[0]),
            candidate_repeat=_tensor(noisy[1]),
            golden=_tensor(golden, "FP64"),
            reference_repeat=_tensor(ref),
            criteria=pb.Criteria(precision="fp32"),
        )
    )
    assert not response.passed and response.finding == "non-deterministic"
    assert response.metrics.candidate_repeated and not response.metrics.candidate_deterministic
    assert response.metrics.candidate_repeat_max_abs == pytest.approx(
        float(np.abs(noisy[0] - noisy[1]).max())
    )
    assert response.reasons[0].startswith("non-deterministic")
