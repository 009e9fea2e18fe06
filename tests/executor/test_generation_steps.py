"""The generation runtime's steps against the model's own full forward pass: an eager mixed
step (decode rows at scattered slots, with free rows among them, and several prompts packed
in one forward) and the compiled paths' steps (a decode step over the leading slots, then
each prompt padded to its bucket, here run eagerly) give, for every row, the logits the model
gives the whole sequence at its last position. In float64, so a wrong mask, position or cache
row shows far above rounding."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from services.executor.device import select_backend
from services.executor.generation.runtime import GenerationRuntime
from switchyard.models import tiny_lm
from switchyard.models.generation import GenerationSettings

SETTINGS = GenerationSettings(max_context=64, max_new_tokens=40, prompt_buckets=(8, 16, 32), decode_slots=8)
Forward = Callable[[list[int]], torch.Tensor]  # ids -> logits at the last position


def llama(directory: Path) -> tuple[nn.Module, Forward]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(directory).double()
    model.train(False)
    return model, lambda ids: model(torch.tensor([ids])).logits[0, -1]


def tiny() -> tuple[nn.Module, Forward]:
    torch.manual_seed(0)
    model = tiny_lm.build().double()
    model.train(False)
    return model, lambda ids: model(torch.tensor([ids]))[0, -1]


@pytest.mark.parametrize("path", ["mixed", "bucketed"])
@pytest.mark.parametrize("kind", ["llama", "tiny-lm"])
def test_every_row_of_a_step_equals_the_full_forward(kind: str, path: str, llama_dir: Path) -> None:
    module, forward = llama(llama_dir) if kind == "llama" else tiny()
    runtime = GenerationRuntime(module, SETTINGS, select_backend("cpu"), "eager", torch.float64)
    assert runtime.mixed_step is not None  # eager: one forward an iteration
    if path == "bucketed":
        runtime.mixed_step = None  # the steps compiled graphs run (xla, tpu, cpu-compile)
    vocab = runtime.vocab_size
    prompts = {slot: [(7 * slot + 3 * i) % vocab for i in range(n)] for slot, n in
               ((0, 5), (2, 11), (5, 3), (1, 7), (3, 2))}  # fmt: skip
    seqs: dict[int, list[int]] = {}

    def step(decoding: list[int], joining: list[int]) -> None:
        rows = [(s, seqs[s][-1], len(seqs[s]) - 1) for s in decoding]
        logits = runtime.step(rows, [(s, prompts[s]) for s in joining])
        assert logits.shape == (len(decoding) + len(joining), vocab)
        for s in joining:
            seqs[s] = list(prompts[s])
        with torch.no_grad():
            for s, row in zip([*decoding, *joining], logits, strict=True):
                expected = forward(seqs[s])
                gap = float((row - expected).abs().max())
                assert gap < 1e-9, (kind, s, gap)
                seqs[s].append(int(row.argmax()))

    step([], [0, 2, 5])  # three prompts in one forward
    step([0, 2, 5], [1, 3])  # decode rows with free slots among them, and prompts into two of those
    step([0, 1, 2, 3, 5], [])  # slot 4 free inside the width
    step([0, 1, 2, 3], [])  # rows [0, 4): no free row inside
    step([1, 3], [])
