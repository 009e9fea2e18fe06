"""Shadow traffic: divergence between a primary answer and a candidate's, and its statistics.

The caller always gets the primary answer; the mirrored copy runs afterwards in a background
task, bounded by `shadow_max_pending` (a mirror that would exceed it is skipped and counted,
so shadowing can never slow the primary path down without limit). Each pair is compared
output by output; `divergence` decodes the answers and applies the judge's local rule
(switchyard/judge/output_divergence.py: max absolute error, cosine similarity, share of
elements outside atol + rtol·|reference|) when no evaluator service is configured.

A generative model's pair (the primary's streamed or unary completion and the candidate's) is
read by `switchyard.judge.oip_generations.generated` and judged by the trial's own rule,
`switchyard.judge.divergence.judge_pair`: tokens equal up to the first divergence, each side's
token in the other's top-k there, logprobs within the precision's tolerance.
Only greedy requests are compared (a sampled one may differ by design); the top-k condition
needs the logprobs the caller asked for, and a divergence without them is counted as
unchecked, not as a failure.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from switchyard import oip_params
from switchyard.codec import CONTENT_FIELDS
from switchyard.gen.inference import grpc_service_pb2 as pb
from switchyard.judge.divergence import GenerationVerdict
from switchyard.judge.output_divergence import Divergence, outputs_divergence
from switchyard.judge.tensors import decode


def output_arrays(response: pb.ModelInferResponse) -> dict[str, np.ndarray]:
    """Numeric outputs as float64 arrays (BF16 widened exactly); BYTES outputs as object arrays."""
    out: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(response.outputs):
        shape = tuple(tensor.shape)
        dtype = tensor.datatype
        if i < len(response.raw_output_contents):
            raw = response.raw_output_contents[i]
            if dtype == "BYTES":
                array = np.array([raw], dtype=object)
            else:  # the judge's decoding: byte size checked, BF16 widened exactly
                array = decode(tensor.name, dtype, list(shape), raw).values
        elif dtype in CONTENT_FIELDS:
            array = np.asarray(getattr(tensor.contents, CONTENT_FIELDS[dtype]), dtype=np.float64)
        else:
            array = np.array([bytes(b) for b in tensor.contents.bytes_contents], dtype=object)
        out[tensor.name] = array.reshape(shape) if array.dtype != object else array
    return out


def divergence(
    reference: pb.ModelInferResponse, candidate: pb.ModelInferResponse, atol: float, rtol: float
) -> Divergence:
    """Compare every output of two responses (the judge's local rule); the worst output decides."""
    return outputs_divergence(output_arrays(reference), output_arrays(candidate), atol, rtol)


def _first_bytes(raw: bytes) -> bytes:
    n = int.from_bytes(raw[:4], "little") if len(raw) >= 4 else 0
    return raw[4 : 4 + n]


def greedy_request(request: pb.ModelInferRequest) -> bool:
    """Whether a generation request decodes greedily (temperature 0, or top_k 1), so that two
    paths' answers should agree; vLLM's default temperature is 1 (sampled)."""
    for i, tensor in enumerate(request.inputs):
        if tensor.name != "sampling_parameters" or i >= len(request.raw_input_contents):
            continue
        try:
            params = json.loads(_first_bytes(request.raw_input_contents[i]) or b"{}")
        except ValueError:
            return False
        return isinstance(params, dict) and (params.get("temperature") == 0 or params.get("top_k") == 1)
    return False


def is_generation(response: pb.ModelInferResponse) -> bool:
    return oip_params.NUM_OUTPUT_TOKENS in response.parameters and any(
        o.name == "output_ids" for o in response.outputs
    )


@dataclass
class ShadowStats:
    model: str
    candidate: str
    pairs: int = 0
    failures: int = 0
    skipped: int = 0
    diverged: int = 0
    max_abs_error: float = 0.0
    sum_max_abs_error: float = 0.0
    min_cosine: float = 1.0
    comparer: str = "local"
    last_reasons: list[str] = field(default_factory=list)
    # generations (a decoupled model's pairs), under the divergence rule
    generations: int = 0
    token_divergences: int = 0  # pairs whose tokens diverged at some position
    rule_failures: int = 0  # pairs that fail the rule (checked)
    unchecked: int = 0  # diverged, but without logprobs for the top-k check
    sampled: int = 0  # not compared: the request sampled (temperature > 0)
    first_divergence_min: int = -1
    first_divergence_sum: int = 0
    first_divergences: list[int] = field(default_factory=list)  # the latest, oldest first

    def add_generation(self, d: GenerationVerdict) -> None:
        self.pairs += 1
        self.generations += 1
        failed = d.checked and not d.passed  # identical tokens with logprobs off count too
        self.rule_failures += int(failed)
        self.diverged += int(failed)
        if failed and d.first_divergence < 0:
            self.last_reasons = [*self.last_reasons[-4:], d.reason]
        if d.first_divergence < 0:
            return
        self.token_divergences += 1
        self.unchecked += int(not d.checked)
        self.first_divergence_sum += d.first_divergence
        best = self.first_divergence_min
        self.first_divergence_min = d.first_divergence if best < 0 else min(best, d.first_divergence)
        self.first_divergences = [*self.first_divergences[-15:], d.first_divergence]
        self.last_reasons = [*self.last_reasons[-4:], d.reason]

    @property
    def first_divergence_mean(self) -> float:
        return self.first_divergence_sum / self.token_divergences if self.token_divergences else -1.0

    def add(self, d: Divergence) -> None:
        self.pairs += 1
        self.diverged += int(d.diverged)
        self.max_abs_error = max(self.max_abs_error, d.max_abs_error)
        if math.isfinite(d.max_abs_error):
            self.sum_max_abs_error += d.max_abs_error
        self.min_cosine = min(self.min_cosine, d.cosine)
        if d.diverged:
            self.last_reasons = [*self.last_reasons[-4:], d.reason]

    @property
    def mean_max_abs_error(self) -> float:
        return self.sum_max_abs_error / self.pairs if self.pairs else 0.0
