"""gRPC adapter of the evaluator: decodes the messages, calls the judge library
(switchyard/judge: compare, loss), encodes its records back (docs/architecture.md#who-judges-what).
The messages declare the records' fields by the same names, so `copy_fields` converts them."""

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
    return copy_fields(Criteria, message, precision=message.precision or "fp32")


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
        return copy_fields(pb.CompareResponse, result, metrics=copy_fields(pb.Metrics, result.metrics))

    async def CompareLoss(
        self, request: pb.CompareLossRequest, context: ServicerContext
    ) -> pb.CompareLossResponse:
        result = compare_loss(
            list(request.reference),
            list(request.candidate),
            copy_fields(LossCriteria, request, precision=request.precision or "fp32"),
        )
        return copy_fields(pb.CompareLossResponse, result)
