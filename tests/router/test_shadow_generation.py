"""The shadow's generation comparison (services/router/shadow_divergence.py): generations read from
streamed and unary responses, the trial's divergence rule on each pair, and the statistics."""

from __future__ import annotations

import json

import numpy as np

from services.router.shadow_divergence import (
    ShadowStats,
    generated,
    generation_divergence,
    greedy_request,
    is_generation,
)
from switchyard import codec, oip_params
from switchyard.gen.inference import grpc_service_pb2 as pb


def response(ids: list[int], produced: int, tops: list[list[int]] | None = None) -> pb.ModelInferResponse:
    r = pb.ModelInferResponse(model_name="m")
    r.outputs.add(name="output_ids", datatype="INT64", shape=[len(ids)])
    r.raw_output_contents.append(np.asarray(ids, dtype=np.int64).tobytes())
    r.parameters[oip_params.NUM_OUTPUT_TOKENS].int64_param = produced
    if tops is not None:
        entries = [
            {
                "id": row[0],
                "token": "x",
                "logprob": -0.5,
                "top": [[t, -0.5 - j, "x"] for j, t in enumerate(row)],
            }
            for row in tops
        ]
        r.parameters[oip_params.LOGPROBS].string_param = json.dumps(entries)
    return r


def test_streamed_and_unary_answers_give_the_same_generation() -> None:
    streamed = [response([5], 1, [[5, 6]]), response([7], 2, [[7, 8]]), response([9], 3, [[9, 1]])]
    unary = [response([1, 2, 5, 7, 9], 3, [[5, 6], [7, 8], [9, 1]])]  # the prompt prepended
    a, b = generated(streamed), generated(unary)
    assert a.tokens == b.tokens == (5, 7, 9)
    assert a.top == b.top and a.logprobs == (-0.5, -0.5, -0.5)
    assert is_generation(unary[0]) and not is_generation(pb.ModelInferResponse())


def test_only_greedy_requests_are_compared() -> None:
    def request(params: dict[str, object] | None) -> pb.ModelInferRequest:
        r = pb.ModelInferRequest(model_name="m")
        if params is not None:
            r.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
            r.raw_input_contents.append(codec.encode_bytes([json.dumps(params).encode()]))
        return r

    assert greedy_request(request({"temperature": 0, "max_tokens": 4}))
    assert greedy_request(request({"top_k": 1}))
    assert not greedy_request(request({"temperature": 0.7}))
    assert not greedy_request(request(None))  # vLLM's default temperature is 1


def test_divergences_and_their_first_position_in_the_statistics() -> None:
    stats = ShadowStats("llama", "b/llama:perturbed")
    same = generation_divergence(generated([response([1, 2, 3], 3, [[1], [2], [3]])]),
                                 generated([response([1, 2, 3], 3, [[1], [2], [3]])]))  # fmt: skip
    stats.add_generation(same)
    assert same.passed and same.first_divergence == -1
    # a near-tie at position 2: each token in the other's top-2
    ref = generated([response([1, 2, 3, 4], 4, [[1, 9], [2, 9], [3, 8], [4, 9]])])
    tie = generation_divergence(ref, generated([response([1, 2, 8, 5], 4, [[1, 9], [2, 9], [8, 3], [5, 9]])]))
    stats.add_generation(tie)
    assert tie.passed and tie.first_divergence == 2
    # a different model: its token is not in the primary's top-k at position 1
    wrong = generation_divergence(generated([response([1, 2, 3], 3, [[1, 9], [2, 9], [3, 9]])]),
                                  generated([response([1, 7, 3], 3, [[1, 9], [7, 6], [3, 9]])]))  # fmt: skip
    stats.add_generation(wrong)
    assert not wrong.passed and wrong.checked and "position 1" in wrong.reason
    # no logprobs asked for: a divergence is counted, unchecked, not a failure
    blind = generation_divergence(
        generated([response([4, 4, 4, 4], 4)]), generated([response([4, 4, 4, 5], 4)])
    )
    stats.add_generation(blind)
    assert not blind.checked
    assert (stats.pairs, stats.generations, stats.token_divergences) == (4, 4, 3)
    assert (stats.rule_failures, stats.unchecked, stats.diverged) == (1, 1, 1)
    assert stats.first_divergence_min == 1 and stats.first_divergences == [2, 1, 3]
    assert stats.first_divergence_mean == 2.0
    assert any("position 1" in r for r in stats.last_reasons)
