"""Shadow pairs sent to the evaluator service (Compare, one call per output tensor).

The evaluator is the project's judge of "same answer" (docs/architecture.md#trials: justified tolerance); the
router asks it about each mirrored pair and records its metrics and verdict. With no
golden float64 run on live traffic the evaluator falls back to allclose at the precision's
default tolerance, and says so in its justification. If the evaluator cannot be reached the
router compares locally (`shadow_divergence.divergence`), so shadow data is never lost to an outage.
"""

from __future__ import annotations

import math

import grpc

from services.router.executor_pool import CHANNEL_OPTIONS
from switchyard import tls
from switchyard.gen.inference import grpc_service_pb2 as pb
from switchyard.gen.switchyard.v1 import evaluator_pb2 as epb
from switchyard.gen.switchyard.v1 import evaluator_pb2_grpc as egrpc
from switchyard.judge.output_divergence import Divergence


class EvaluatorUnavailable(Exception):
    """The evaluator did not answer; the caller falls back to the local comparison."""


def _raw_tensors(response: pb.ModelInferResponse) -> dict[str, epb.Tensor]:
    out: dict[str, epb.Tensor] = {}
    for i, tensor in enumerate(response.outputs):
        if i >= len(response.raw_output_contents):
            raise ValueError(f"output {tensor.name} is not in raw_output_contents")
        out[tensor.name] = epb.Tensor(
            datatype=tensor.datatype, shape=list(tensor.shape), data=response.raw_output_contents[i]
        )
    return out


class EvaluatorComparer:
    def __init__(
        self,
        address: str,
        precision: str = "fp32",
        timeout_s: float = 5.0,
        security: tls.Security | None = None,
    ) -> None:
        self.address = address
        self._precision = precision
        self._timeout = timeout_s
        self._channel = tls.aio_channel(address, CHANNEL_OPTIONS, security, expect=tls.EVALUATOR)
        self._stub = egrpc.EvaluatorStub(self._channel)

    async def compare(self, reference: pb.ModelInferResponse, candidate: pb.ModelInferResponse) -> Divergence:
        ref, cand = _raw_tensors(reference), _raw_tensors(candidate)
        if set(ref) != set(cand):
            return Divergence(math.inf, 0.0, 1.0, True, f"outputs differ: {sorted(ref)} vs {sorted(cand)}")
        worst = Divergence(0.0, 1.0, 0.0, False)
        for name, tensor in ref.items():
            request = epb.CompareRequest(
                output_name=name,
                reference=tensor,
                candidate=cand[name],
                criteria=epb.Criteria(precision=self._precision),
            )
            try:
                reply = await self._stub.Compare(request, timeout=self._timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise EvaluatorUnavailable(exc.details()) from None
                raise ValueError(f"evaluator refused output {name}: {exc.details()}") from None
            m = reply.metrics
            failed = [r for r in reply.reasons if r.endswith("fail")]
            worst = Divergence(
                max(worst.max_abs_error, m.max_abs_error),
                min(worst.cosine, m.cosine),
                max(worst.mismatch_share, m.mismatch_share),
                worst.diverged or not reply.passed,
                worst.reason if reply.passed else f"{name}: {'; '.join(failed) or reply.verdict}",
            )
        return worst

    async def close(self) -> None:
        await self._channel.close()
