"""gRPC adapter of the evaluator: converts messages, calls the domain, converts back
(docs/architecture.md#code-style)."""

from __future__ import annotations

from switchyard.field_copy import copy_fields
from switchyard.gen.switchyard.v1 import evaluator_pb2 as pb
from switchyard.gen.switchyard.v1 import evaluator_pb2_grpc as pb_grpc
from switchyard.grpcio import ServicerContext
from switchyard.judge.compare import Criteria, compare
from switchyard.judge.judge_errors import BadTensor
from switchyard.judge.loss import LossCriteria, compare_loss
from switchyard.judge.tensors import DecodedTensor, decode

SERVICE_NAME = "switchyard.v1.Evaluator"


def _tensor(name: str, message: pb.Tensor, required: bool) -> DecodedTensor | None:
    if not message.datatype and not message.shape and not message.data:
        if required:
            raise BadTensor(f"{name}: missing; send the tensor with datatype, shape and data")
        return None
    if not message.datatype:
        raise BadTensor(f"{name}: datatype is empty; set an OIP datatype such as FP32")
    return decode(name, message.datatype, list(message.shape), message.data)


def _criteria(message: pb.Criteria) -> Criteria:
    return Criteria(
        precision=message.precision or "fp32",
        error_multiplier=message.error_multiplier,
        min_cosine=message.min_cosine,
        min_top1_agreement=message.min_top1_agreement,
        min_topk_agreement=message.min_topk_agreement,
        top_k=message.top_k,
        max_kl=message.max_kl,
        logits=message.logits,
        atol_floor=message.atol_floor,
    )


class EvaluatorServicer(pb_grpc.EvaluatorServicer):
    async def Compare(self, request: pb.CompareRequest, context: ServicerContext) -> pb.CompareResponse:
        reference = _tensor("reference", request.reference, required=True)
        candidate = _tensor("candidate", request.candidate, required=True)
        assert reference is not None and candidate is not None
        result = compare(
            reference,
            candidate,
            _tensor("golden", request.golden, required=False),
            _tensor("reference_repeat", request.reference_repeat, required=False),
            _criteria(request.criteria),
            _tensor("candidate_repeat", request.candidate_repeat, required=False),
        )
        m = result.metrics
        return pb.CompareResponse(
            metrics=pb.Metrics(
                max_abs_error=m.max_abs_error,
                max_rel_error=m.max_rel_error,
                mismatch_share=m.mismatch_share,
                rmse=m.rmse,
                reference_rmse=m.reference_rmse,
                cosine=m.cosine,
                top1_agreement=m.top1_agreement,
                topk_agreement=m.topk_agreement,
                kl_divergence=m.kl_divergence,
                reference_deterministic=m.reference_deterministic,
                reference_repeat_max_abs=m.reference_repeat_max_abs,
                allowed_rmse=m.allowed_rmse,
                repeat_rmse=m.repeat_rmse,
                elements=m.elements,
                allclose=m.allclose,
                candidate_deterministic=m.candidate_deterministic,
                candidate_repeat_max_abs=m.candidate_repeat_max_abs,
                candidate_repeat_rmse=m.candidate_repeat_rmse,
                candidate_repeated=m.candidate_repeated,
            ),
            passed=result.passed,
            verdict=result.verdict,
            reasons=result.reasons,
            justification=result.justification,
            finding=result.finding,
        )

    async def CompareLoss(
        self, request: pb.CompareLossRequest, context: ServicerContext
    ) -> pb.CompareLossResponse:
        result = compare_loss(
            list(request.reference),
            list(request.candidate),
            LossCriteria(
                target_loss=request.target_loss,
                max_relative_deviation=request.max_relative_deviation,
                precision=request.precision or "fp32",
                max_steps_to_target_ratio=request.max_steps_to_target_ratio,
            ),
        )
        return copy_fields(pb.CompareLossResponse, result)
