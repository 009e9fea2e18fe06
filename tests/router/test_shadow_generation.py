"""The shadow's generation comparison (services/router/shadow_divergence.py): which requests
are compared, the judge's rule on each pair (switchyard.judge.divergence.judge_pair), and
the statistics."""

from __future__ import annotations

import json

from services.router.shadow_divergence import ShadowStats, greedy_request, is_generation
from switchyard import codec
from switchyard.gen.inference import grpc_service_pb2 as pb
from switchyard.judge.divergence import judge_pair
from switchyard.judge.oip_generations import generated
from tests.judge.test_oip_generations import response


def test_a_generation_answer_is_told_from_a_tensor_answer() -> None:
    assert is_generation(response([1, 2, 5], 3)) and not is_generation(pb.ModelInferResponse())


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
    same = judge_pair(generated([response([1, 2, 3], 3, [[1], [2], [3]])]),
                                 generated([response([1, 2, 3], 3, [[1], [2], [3]])]))  # fmt: skip
    stats.add_generation(same)
    assert same.passed and same.first_divergence == -1
    # a near-tie at position 2: each token in the other's top-2
    ref = generated([response([1, 2, 3, 4], 4, [[1, 9], [2, 9], [3, 8], [4, 9]])])
    tie = judge_pair(ref, generated([response([1, 2, 8, 5], 4, [[1, 9], [2, 9], [8, 3], [5, 9]])]))
    stats.add_generation(tie)
    assert tie.passed and tie.first_divergence == 2
    # a different model: its token is not in the primary's top-k at position 1
    wrong = judge_pair(generated([response([1, 2, 3], 3, [[1, 9], [2, 9], [3, 9]])]),
                                  generated([response([1, 7, 3], 3, [[1, 9], [7, 6], [3, 9]])]))  # fmt: skip
    stats.add_generation(wrong)
    assert not wrong.passed and wrong.checked and "position 1" in wrong.reason
    # no logprobs asked for: a divergence is counted, unchecked, not a failure
    blind = judge_pair(generated([response([4, 4, 4, 4], 4)]), generated([response([4, 4, 4, 5], 4)]))
    stats.add_generation(blind)
    assert not blind.checked
    assert (stats.pairs, stats.generations, stats.token_divergences) == (4, 4, 3)
    assert (stats.rule_failures, stats.unchecked, stats.diverged) == (1, 1, 1)
    assert stats.first_divergence_min == 1 and stats.first_divergences == [2, 1, 3]
    assert stats.first_divergence_mean == 2.0
    assert any("position 1" in r for r in stats.last_reasons)
