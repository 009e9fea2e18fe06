"""Causal LMs with a static KV cache: prefill and decode as fixed-shape steps over a model's weights.

Each adapter runs its model's own layers (embeddings, norms, projections, MLPs, rotary
embedding) and does attention itself, against the engine's cache rows:

- `prefill(ids [1, bucket], length [1], slot [1], keys, values) -> logits [1, vocab]`: the
  prompt (padded to its bucket on compiled paths), causal attention within it, the slot's
  cache row written, and the logits of the last real position (`length - 1`);
- `decode(tokens [n], positions [n], keys, values) -> logits [n, vocab]`: one token for each
  of the leading n slots at its own position, written into the cache, attention over the
  slot's row masked to positions <= its own.

Lengths, slots and positions are tensors, never Python numbers, so a step's graph depends
only on its bucket: XLA and inductor compile one graph per prompt bucket and one per decode
width, all at warm-up.

Why not the Hugging Face model's own forward with `StaticCache` and `cache_position`: the
static cache writes every row of a batch at the same `cache_position`, so the rows of one
decode step must all be at the same position, which continuous batching never has (each slot
is at its own length). Its forward also builds masks and checks on the host per call. Our
attention over the model's own modules keeps per-slot positions in one graph; it is held to
exact token equality with `model.generate` by the tests.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from services.executor.generation.kv_cache import CacheShape
from switchyard.errors import FailedPrecondition
from switchyard.models import tiny_lm
from switchyard.models.formats import HFModule


def _store_prompt(cache: torch.Tensor, slot: torch.Tensor, new: torch.Tensor) -> None:
    """Writes a prompt's keys or values [1, heads, bucket, dim] as the slot's whole row."""
    padded = nn.functional.pad(new, (0, 0, 0, cache.shape[2] - new.shape[2]))
    cache.index_copy_(0, slot, padded)


def _store_step(cache: torch.Tensor, positions: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Writes one position per leading slot (new: [n, heads, 1, dim]); returns rows [0, n)."""
    n = new.shape[0]
    rows = torch.arange(n, device=new.device)
    cache[rows, :, positions] = new[:, :, 0]
    return cache[:n]


def _decode_mask(positions: torch.Tensor, context: int) -> torch.Tensor:
    """[n, 1, 1, context]: True where a slot may attend (positions up to its own)."""
    at = torch.arange(context, device=positions.device)
    return (at[None, :] <= positions[:, None])[:, None, None, :]


class LayerStep(NamedTuple):
    """What one layer needs in a step: the adapter's context (Llama's rotary cos and sin), the
    layer's cache rows, how new keys and values are stored into them, and the attention mask."""

    context: Any
    keys: torch.Tensor
    values: torch.Tensor
    store: Any
    mask: torch.Tensor


class CausalLM(nn.Module):
    """`prefill` and `decode` (the module docstring's contract) over a model's layers; an
    adapter says how to embed (with the positions, broadcast like the ids), run one layer, and
    read the logits."""

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    def _layers(self) -> Any:
        raise NotImplementedError

    def _layer(self, layer: Any, x: torch.Tensor, step: LayerStep) -> torch.Tensor:
        raise NotImplementedError

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def prefill(
        self,
        ids: torch.Tensor,
        length: torch.Tensor,
        slot: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> torch.Tensor:
        s = ids.shape[1]
        x, context = self._embed(ids, torch.arange(s, device=ids.device)[None, :])
        causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()

        def store(cache: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
            _store_prompt(cache, slot, new)
            return new

        for i, layer in enumerate(self._layers()):
            x = self._layer(layer, x, LayerStep(context, keys[i], values[i], store, causal))
        return self._logits(x.index_select(1, length - 1))

    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> torch.Tensor:
        x, context = self._embed(tokens[:, None], positions[:, None])
        mask = _decode_mask(positions, keys[0].shape[2])

        def store(cache: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
            return _store_step(cache, positions, new)

        for i, layer in enumerate(self._layers()):
            x = self._layer(layer, x, LayerStep(context, keys[i], values[i], store, mask))
        return self._logits(x)


class TinyLMAdapter(CausalLM):
    def __init__(self, lm: tiny_lm.TinyLM) -> None:
        super().__init__()
        self.lm = lm
        self.cache_shape = CacheShape(tiny_lm.N_LAYERS, tiny_lm.N_HEADS, tiny_lm.D_MODEL // tiny_lm.N_HEADS)
        self.vocab_size = tiny_lm.VOCAB
        self.max_positions = tiny_lm.MAX_SEQ
        self.eos_token_ids: tuple[int, ...] = ()

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return self.lm.tok(ids) + self.lm.pos(positions), None

    def _layers(self) -> Any:
        return self.lm.blocks

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm.head(self.lm.ln_f(x))[:, 0]  # type: ignore[no-any-return]

    def _layer(self, layer: Any, x: torch.Tensor, step: LayerStep) -> torch.Tensor:
        b, s, d = x.shape
        heads, dim = self.cache_shape.kv_heads, self.cache_shape.head_dim
        q, k, v = layer.qkv(layer.ln1(x)).split(d, dim=-1)
        q = q.view(b, s, heads, dim).transpose(1, 2)
        k = k.view(b, s, heads, dim).transpose(1, 2)
        v = v.view(b, s, heads, dim).transpose(1, 2)
        k_all, v_all = step.store(step.keys, k), step.store(step.values, v)
        scores = (q @ k_all.transpose(-2, -1)) / math.sqrt(dim)
        scores = scores.masked_fill(~step.mask, torch.finfo(scores.dtype).min)
        attn = torch.softmax(scores, dim=-1) @ v_all
        x = x + layer.proj(attn.transpose(1, 2).reshape(b, s, d))
        return x + layer.ff2(nn.functional.gelu(layer.ff1(layer.ln2(x))))  # type: ignore[no-any-return]


LLAMA_FAMILY = ("llama", "mistral", "qwen2")


class LlamaAdapter(CausalLM):
    """Llama-style decoders of Hugging Face transformers (RMSNorm, rotary, GQA, gated MLP)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        config: Any = lm.config
        body: Any = lm.model
        self.lm: Any = lm
        self.body: Any = body
        attn = body.layers[0].self_attn
        self.cache_shape = CacheShape(config.num_hidden_layers, config.num_key_value_heads, attn.head_dim)
        self.groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = float(attn.scaling)
        self.vocab_size = int(config.vocab_size)
        self.max_positions = int(config.max_position_embeddings)
        eos = getattr(getattr(lm, "generation_config", None), "eos_token_id", None)
        eos = config.eos_token_id if eos is None else eos
        self.eos_token_ids = (
            tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (int(eos),))
        )
        from transformers.models.llama import modeling_llama

        self._rotary = modeling_llama.apply_rotary_pos_emb

    def _layer(self, layer: Any, x: torch.Tensor, step: LayerStep) -> torch.Tensor:
        b, s, _ = x.shape
        dim = self.cache_shape.head_dim
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(b, s, -1, dim).transpose(1, 2)
        k = attn.k_proj(h).view(b, s, -1, dim).transpose(1, 2)
        v = attn.v_proj(h).view(b, s, -1, dim).transpose(1, 2)
        q, k = self._rotary(q, k, *step.context)
        k_all, v_all = step.store(step.keys, k), step.store(step.values, v)  # [b, kv heads, t, dim]
        # grouped-query attention without repeating the cache per query head (HF's repeat_kv
        # copies every layer's whole cache each step): query head h reads kv head h // groups,
        # so the queries of one kv head are stacked as rows against its keys and values
        kv = k_all.shape[1]
        grouped = q.reshape(b, kv, self.groups * s, dim)
        scores = ((grouped @ k_all.transpose(-2, -1)) * self.scaling).view(b, kv, self.groups, s, -1)
        scores = scores.masked_fill(~step.mask.unsqueeze(-3), torch.finfo(scores.dtype).min)
        # at least float32, as HF's eager attention; an fp64 (golden) run stays float64 throughout
        weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
        out = (weights.view(b, kv, self.groups * s, -1) @ v_all).view(b, -1, s, dim)
        out = out.transpose(1, 2).reshape(b, s, -1)
        x = x + attn.o_proj(out)
        return x + layer.mlp(layer.post_attention_layernorm(x))  # type: ignore[no-any-return]

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm.lm_head(self.body.norm(x))[:, 0]  # type: ignore[no-any-return]

    def _layers(self) -> Any:
        return self.body.layers

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Any]:
        x = self.body.embed_tokens(ids)
        return x, self.body.rotary_emb(x, positions)  # (cos, sin)


def causal_lm_for(module: nn.Module) -> Any:
    """The adapter for a loaded module, or FAILED_PRECONDITION naming what is supported."""
    if isinstance(module, tiny_lm.TinyLM):
        return TinyLMAdapter(module)
    inner = getattr(module, "model", None)
    if isinstance(module, HFModule) and isinstance(inner, nn.Module):
        module = inner  # the repository's hf wrapper: the transformers model inside
    model_type = getattr(getattr(module, "config", None), "model_type", "")
    if model_type in LLAMA_FAMILY and hasattr(module, "lm_head"):
        return LlamaAdapter(module)
    raise FailedPrecondition(
        f"generation supports tiny-lm and Hugging Face causal LMs of type {', '.join(LLAMA_FAMILY)}; "
        f"this model is {type(module).__name__} (model_type {model_type!r})"
    )


class PrefillStep(nn.Module):
    """The prefill as a module: inputs (ids, length, slot, *keys, *values) for a backend."""

    def __init__(self, lm: Any, layers: int) -> None:
        super().__init__()
        self.adapter = lm
        self.layers = layers

    def forward(
        self, ids: torch.Tensor, length: torch.Tensor, slot: torch.Tensor, *cache: torch.Tensor
    ) -> torch.Tensor:
        n = self.layers
        return self.adapter.prefill(ids, length, slot, list(cache[:n]), list(cache[n:]))  # type: ignore[no-any-return]


class DecodeStep(nn.Module):
    """One decode step as a module: inputs (tokens, positions, *keys, *values)."""

    def __init__(self, lm: Any, layers: int) -> None:
        super().__init__()
        self.adapter = lm
        self.layers = layers

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, *cache: torch.Tensor) -> torch.Tensor:
        n = self.layers
        return self.adapter.decode(tokens, positions, list(cache[:n]), list(cache[n:]))  # type: ignore[no-any-return]
