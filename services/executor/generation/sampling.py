"""Choosing the next token from a row of logits, on the host (float32, CPU).

Greedy is argmax (the first of equal maxima, as `torch.argmax` and `generate` take it).
Sampling applies temperature, then top-k, then top-p (the smallest set of tokens whose
probability reaches top_p, the most likely always kept), then draws from the request's own
generator: a request with a seed gets the same tokens whatever else shares its decode steps.
Logprobs are of the model's distribution (log-softmax of the raw logits), as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.executor.generation.settings import SamplingParams


@dataclass(frozen=True)
class Choice:
    token: int
    logprob: float | None = None  # of the chosen token, when logprobs were asked for
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), most likely first


def new_generator(params: SamplingParams) -> torch.Generator | None:
    if params.greedy:
        return None
    generator = torch.Generator()
    if params.seed is not None:
        generator.manual_seed(params.seed)
    else:
        generator.seed()
    return generator


def choose(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    banned: tuple[int, ...] = (),
) -> Choice:
    """`logits`: [vocab] float32 on the CPU. `banned`: ids that may not be chosen (EOS under min_tokens)."""
    row = logits
    if banned:
        row = row.clone()
        row[list(banned)] = float("-inf")
    if params.greedy or generator is None:
        token = int(torch.argmax(row))
    else:
        scaled = row / params.temperature
        if 0 < params.top_k < scaled.shape[0]:
            kth = torch.topk(scaled, params.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if params.top_p < 1.0:
            ordered, order = torch.sort(scaled, descending=True)
            probs = torch.softmax(ordered, dim=-1)
            before = torch.cumsum(probs, dim=-1) - probs  # mass of the more likely tokens
            drop = before >= params.top_p
            drop[0] = False
            scaled = scaled.scatter(0, order[drop], float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        token = int(torch.multinomial(probs, 1, generator=generator))
    if params.logprobs is None:
        return Choice(token)
    logprobs = torch.log_softmax(logits, dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if params.logprobs > 0:
        values, ids = torch.topk(logprobs, params.logprobs)
        top = tuple((int(i), float(v)) for i, v in zip(ids, values, strict=True))
    return Choice(token, float(logprobs[token]), top)
