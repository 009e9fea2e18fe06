"""The `tiny-lm` reference model: a small decoder-only transformer language model.

It has the operators that matter for serving LLMs: token and position embeddings, causal
self-attention written out (matmul, mask, softmax), layer norm, GELU MLP, and a logits head.
Input `input_ids` INT64 [batch, seq] (seq <= MAX_SEQ, default 32); output `logits`
FP32 [batch, seq, VOCAB]. Seeded weights committed as safetensors (about 2 MB).
"""

from __future__ import annotations

import math

import torch
from torch import nn

VOCAB = 512
D_MODEL = 128
N_HEADS = 4
N_LAYERS = 2
D_FF = 512
MAX_SEQ = 64
DEFAULT_SEQ = 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.ff1 = nn.Linear(D_MODEL, D_FF)
        self.ff2 = nn.Linear(D_FF, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D_MODEL, dim=-1)
        head = D_MODEL // N_HEADS
        q = q.view(b, s, N_HEADS, head).transpose(1, 2)
        k = k.view(b, s, N_HEADS, head).transpose(1, 2)
        v = v.view(b, s, N_HEADS, head).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(head)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        attn = torch.softmax(scores, dim=-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.ff2(nn.functional.gelu(self.ff1(self.ln2(x))))  # type: ignore[no-any-return]


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Embedding(MAX_SEQ, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(N_LAYERS))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.tok(input_ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # type: ignore[no-any-return]


def build() -> TinyLM:
    return TinyLM()


def example_inputs(batch: int, generator: torch.Generator) -> list[torch.Tensor]:
    return [torch.randint(0, VOCAB, (batch, DEFAULT_SEQ), generator=generator)]


def train_batch(batch: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Seeded sequences that repeat a short random motif, one more token than the model sees.

    The motif makes the data learnable, so the loss curve falls within a few steps. Rows are
    drawn in order, so rows [a, b) of a batch are the same whichever rank takes them.
    """
    motif = torch.randint(0, VOCAB, (batch, 8), generator=generator)
    return [motif.repeat(1, DEFAULT_SEQ // 8 + 1)[:, : DEFAULT_SEQ + 1]]


def batch_loss(
    module: nn.Module, data: list[torch.Tensor], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Next-token prediction (mean cross-entropy over the batch's tokens)."""
    ids = data[0].to(device)
    logits = module(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))


def train_loss(
    module: nn.Module, batch: int, generator: torch.Generator, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    return batch_loss(module, train_batch(batch, generator), dtype, device)
