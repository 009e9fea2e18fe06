"""Reading a generation from its OIP answers (switchyard/judge/oip_generations.py): the same
tokens and logprobs from a stream of answers as from one unary answer."""

from __future__ import annotations

import json

import numpy as np

from switchyard import oip_params
from switchyard.gen.inference import grpc_service_pb2 as pb
from switchyard.judge.oip_generations import generated


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
