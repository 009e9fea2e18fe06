"""A generation read from its OIP answers: the one reader for the router's shadow and the
trial worker, so both judge the same tokens and logprobs.

An answer is a ModelInferResponse (one per token or chunk when streamed, else one): the new
token ids are the last `num_output_tokens` of what the `output_ids` outputs carried (a
prepended prompt is left out), and the `logprobs` parameter's JSON gives, per generated
token, `{"logprob": ..., "top": [[id, logprob, token], ...]}` (services/executor/generation/
generation_oip.py writes it). The messages are read by shape (`OipAnswer`), so this module
imports no protobuf.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import numpy as np

from switchyard import oip_params
from switchyard.judge.divergence import Generated


class _Output(Protocol):
    @property
    def name(self) -> str: ...


class _Parameter(Protocol):
    @property
    def int64_param(self) -> int: ...
    @property
    def string_param(self) -> str: ...


class OipAnswer(Protocol):
    """What is read of a ModelInferResponse."""

    @property
    def outputs(self) -> Sequence[_Output]: ...
    @property
    def raw_output_contents(self) -> Sequence[bytes]: ...
    @property
    def parameters(self) -> Mapping[str, _Parameter]: ...


def generated(responses: Iterable[OipAnswer]) -> Generated:
    """One generation from its responses, with the logprobs and top-k where the caller asked."""
    ids: list[int] = []
    logprobs: list[float] = []
    top: list[tuple[tuple[int, float], ...]] = []
    produced = 0
    for r in responses:
        for i, output in enumerate(r.outputs):
            if output.name == "output_ids" and i < len(r.raw_output_contents):
                ids += [int(t) for t in np.frombuffer(r.raw_output_contents[i], dtype="<i8")]
        if oip_params.NUM_OUTPUT_TOKENS in r.parameters:
            produced = int(r.parameters[oip_params.NUM_OUTPUT_TOKENS].int64_param)
        if oip_params.LOGPROBS in r.parameters:
            for entry in json.loads(r.parameters[oip_params.LOGPROBS].string_param):
                logprobs.append(float(entry["logprob"]))
                top.append(tuple((int(e[0]), float(e[1])) for e in entry["top"]))  # [id, logprob, text]
    tokens = ids[-produced:] if produced else []
    return Generated(tuple(tokens), tuple(logprobs), tuple(top))
