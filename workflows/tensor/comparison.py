"""The correctness comparison's activity: each output of a candidate path against the
reference's, through the evaluator (its float64 golden, the repeats for determinism), judged
by the spec's criteria at the candidate's precision (docs/architecture.md#trials).
"""

from __future__ import annotations

from temporalio import activity

from switchyard.field_copy import copy_fields
from switchyard.gen.switchyard.v1 import evaluator_pb2 as epb
from workflows.activities import payloads
from workflows.activities.connections import Connections, grpc_errors
from workflows.pipeline.types import CompareRequest, CorrectnessResult, OutputVerdict, TensorData
from workflows.spec.trial_spec import Criteria


def _criteria(c: Criteria, precision: str) -> epb.Criteria:
    return copy_fields(epb.Criteria, c, precision=precision)


def _tensor(t: TensorData | None) -> epb.Tensor | None:
    return None if t is None else epb.Tensor(datatype=t.datatype, shape=t.shape, data=payloads.raw(t))


class ComparisonActivities:
    def __init__(self, connections: Connections) -> None:
        self.connections = connections

    @activity.defn(name="compare_outputs")
    async def compare_outputs(self, request: CompareRequest) -> CorrectnessResult:
        wanted = list(request.criteria.outputs or [t.name for t in request.reference])
        verdicts = [await self._compare(request, ref) for ref in request.reference if ref.name in wanted]
        return CorrectnessResult(bool(verdicts) and all(v.passed for v in verdicts), verdicts)

    async def _compare(self, request: CompareRequest, ref: TensorData) -> OutputVerdict:
        def named(tensors: list[TensorData]) -> TensorData | None:
            return next((t for t in tensors if t.name == ref.name), None)

        candidate = named(request.candidate)
        if candidate is None:
            return OutputVerdict(ref.name, False, {}, [f"output {ref.name} missing"], "")
        with grpc_errors(f"Compare {ref.name} of {request.target.path}"):
            r = await self.connections.evaluator().Compare(
                epb.CompareRequest(
                    output_name=ref.name,
                    reference=_tensor(ref),
                    candidate=_tensor(candidate),
                    golden=_tensor(named(request.golden)),
                    reference_repeat=_tensor(named(request.reference_repeat)),
                    criteria=_criteria(request.criteria, request.target.precision),
                    candidate_repeat=_tensor(named(request.candidate_repeat)),
                ),
                timeout=120,
            )
        metrics = {f.name: getattr(r.metrics, f.name) for f in r.metrics.DESCRIPTOR.fields}
        return OutputVerdict(ref.name, r.passed, metrics, list(r.reasons), r.justification, r.finding)
