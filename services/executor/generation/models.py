"""Causal LMs with a static KV cache: prefill and decode as fixed-shape steps over a model's weights.

Each adapter runs its model's own layers (embeddings, norms, projections, MLPs, rotary
embedding) and does attention itself, against the engine's cache rows:

- `prefill(ids [1, bucket], length [1], slot [1], cache) -> logits [1, vocab]`: the
  prompt (padded to its bucket on compiled paths), causal attention within it, the slot's
  cache row written, and the logits of the last real position (`length - 1`);
- `decode(tokens [n], positions [n], cache) -> logits [n, vocab]`: one token for each
  of the leading n slots at its own position, written into the cache, attention over the
  slot's row masked to positions <= its own;
- `mixed(tokens [T], positions [T], slots [T], decoded [], prompt_lengths [k], cache)
  -> logits [decoded + k, vocab]` (eager only): one forward over the decode rows (the first
  `decoded` tokens, any slots) and k whole prompts packed after them, so the weights'
  matmuls run once over all T rows; decode rows attend over their cache rows, each prompt
  causally within itself (a block-diagonal mask); the logits of every decode row and of
  each prompt's last token.

Lengths, slots and positions are tensors, never Python numbers, so a step's graph depends
only on its bucket: XLA and inductor compile one graph per prompt bucket and one per decode
width, all at warm-up. The mixed step's shapes follow its rows, so only eager runs it.

Why not the Hugging Face model's own forward with `StaticCache` and `cache_position`: the
static cache writes every row of a batch at the same `cache_position`, so the rows of one
decode step must all be at the same position, which continuous batching never has (each slot
is at its own length). Its forward also builds masks and checks on the host per call. Our
attention over the model's own modules keeps per-slot positions in one graph; it is held to
exact token equality with `model.generate` by the tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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


class Layers(NamedTuple):
    """The cache's tensors a step reads and writes: keys and values, one per layer."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]


# attend(q [b, heads, s, dim], k, v [b, kv heads, s, dim]) -> [b, heads, s, dim]: stores the
# new keys and values in the layer's cache and attends as the step's rows need
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class MixedRows:
    """Where a mixed step's rows go. Decode rows (the first n tokens, any slots in slot order)
    attend over the cache rows up to the highest of their slots, and over the positions up to
    the furthest of theirs (not the whole context: the cache is read, not recomputed, so the
    positions past every row's are only memory traffic): a free row inside that width attends
    too and is dropped (attention is a small part of a row's cost; the weights' matmuls run
    over the step's own rows only). The prompts packed after them attend each
    within itself (block-diagonal and causal); none reads the cache, which they only write."""

    def __init__(
        self, positions: torch.Tensor, slots: torch.Tensor, decoded: int, lengths: list[int]
    ) -> None:
        self.n, self.slots, self.positions = decoded, slots, positions
        self.width = self.span = 0
        self.dense = True  # rows [0, n) in order: no free row inside
        self.logit_rows: torch.Tensor | None = None  # the rows that give logits (None: all)
        # each half's masks only when the step has rows of it: a decode-only step (most steps
        # under load) builds no prompt masks
        if decoded:
            self.width = int(slots[:decoded].max()) + 1
            self.dense = self.width == decoded
            wide = positions[:decoded]
            if not self.dense:
                wide = wide.new_zeros(self.width).index_copy_(0, slots[:decoded], wide)
            self.span = int(wide.max()) + 1
            self.decode_mask = _decode_mask(wide, self.span)
        if lengths:
            counts = torch.tensor(lengths, dtype=torch.int64, device=slots.device)
            segment = torch.repeat_interleave(torch.arange(len(lengths), device=slots.device), counts)
            at = positions[decoded:]
            self.prompt_mask = (segment[:, None] == segment[None, :]) & (at[None, :] <= at[:, None])
            ends = counts.cumsum(0) + decoded - 1
            self.last_mask = self.prompt_mask.index_select(0, ends - decoded)  # the last layer's
            # every decode row and each prompt's last token
            self.logit_rows = torch.cat([torch.arange(decoded, device=slots.device), ends])

    def attend(self, attention: Attention, keys: torch.Tensor, values: torch.Tensor) -> Attend:
        n, width, span, slots = self.n, self.width, self.span, self.slots[: self.n]

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # every new key and value to its (slot, position) at once: [T, kv heads, dim]
            keys[self.slots, :, self.positions] = k[0].transpose(0, 1)
            values[self.slots, :, self.positions] = v[0].transpose(0, 1)
            parts = []
            if n:
                rows = q[0, :, :n].transpose(0, 1).unsqueeze(2)  # [n, heads, 1, dim]
                if not self.dense:
                    rows = rows.new_zeros((width, *rows.shape[1:])).index_copy_(0, slots, rows)
                out = attention(rows, keys[:width, :, :span], values[:width, :, :span], self.decode_mask)
                if not self.dense:
                    out = out.index_select(0, slots)
                parts.append(out[:, :, 0].transpose(0, 1).unsqueeze(0))
            if q.shape[2] > n:
                whole = q.shape[2] == k.shape[2]  # else the last layer's, each prompt's last token
                mask = self.prompt_mask if whole else self.last_mask
                parts.append(attention(q[:, :, n:], k[:, :, n:], v[:, :, n:], mask))
            return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]

        return attend


class CausalLM(nn.Module):
    """`prefill`, `decode` and `mixed` (the module docstring's contract) over a model's layers;
    an adapter says how to embed (with the positions, broadcast like the ids), run one layer's
    projections around `attend`, attend (`_attention`: q against keys and values under a mask),
    and read the logits ([b, s, vocab])."""

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    def _layers(self) -> Any:
        raise NotImplementedError

    def _layer(
        self, layer: Any, x: torch.Tensor, context: Any, attend: Attend, keep: torch.Tensor | None
    ) -> torch.Tensor:
        """The layer over `x` [b, s, d]; with `keep`, its output only at those positions (keys and
        values still from all of them): the last layer's, where only some rows give logits."""
        raise NotImplementedError

    def _attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        raise NotImplementedError

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _run(
        self, x: torch.Tensor, context: Any, attend_at: Callable[[int], Attend], keep: torch.Tensor | None
    ) -> torch.Tensor:
        """The layers; the last one computes its queries, attention and MLP at `keep` only (the
        positions whose logits are read; None: all): a prompt's other positions need only its
        keys and values there, for the cache."""
        layers = list(self._layers())
        for i, layer in enumerate(layers):
            x = self._layer(layer, x, context, attend_at(i), keep if i == len(layers) - 1 else None)
        return x

    def prefill(
        self, ids: torch.Tensor, length: torch.Tensor, slot: torch.Tensor, cache: Layers
    ) -> torch.Tensor:
        keys, values = cache
        s = ids.shape[1]
        x, context = self._embed(ids, torch.arange(s, device=ids.device)[None, :])
        causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()

        def attend_at(i: int) -> Attend:
            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                _store_prompt(keys[i], slot, k)
                _store_prompt(values[i], slot, v)
                return self._attention(
                    q, k, v, causal if q.shape[2] == s else causal.index_select(0, length - 1)
                )

            return attend

        return self._logits(self._run(x, context, attend_at, length - 1))[:, 0]

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: Layers) -> torch.Tensor:
        keys, values = cache
        x, context = self._embed(tokens[:, None], positions[:, None])
        mask = _decode_mask(positions, keys[0].shape[2])

        def attend_at(i: int) -> Attend:
            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                k_all, v_all = _store_step(keys[i], positions, k), _store_step(values[i], positions, v)
                return self._attention(q, k_all, v_all, mask)

            return attend

        return self._logits(self._run(x, context, attend_at, None))[:, 0]

    def mixed(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        decoded: torch.Tensor,
        prompt_lengths: torch.Tensor,
        cache: Layers,
    ) -> torch.Tensor:
        keys, values = cache
        rows = MixedRows(positions, slots, int(decoded), prompt_lengths.tolist())
        x, context = self._embed(tokens[None, :], positions[None, :])

        def attend_at(i: int) -> Attend:
            return rows.attend(self._attention, keys[i], values[i])

        return self._logits(self._run(x, context, attend_at, rows.logit_rows))[0]


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
        return self.lm.head(self.lm.ln_f(x))  # type: ignore[no-any-return]

    def _layer(
        self, layer: Any, x: torch.Tensor, context: Any, attend: Attend, keep: torch.Tensor | None
    ) -> torch.Tensor:
        b, s, d = x.shape
        heads, dim = self.cache_shape.kv_heads, self.cache_shape.head_dim
        q, k, v = layer.qkv(layer.ln1(x)).split(d, dim=-1)
        if keep is not None:
            q, x = q.index_select(1, keep), x.index_select(1, keep)
        q = q.reshape(b, -1, heads, dim).transpose(1, 2)
        k = k.view(b, s, heads, dim).transpose(1, 2)
        v = v.view(b, s, heads, dim).transpose(1, 2)
        attn = attend(q, k, v)
        x = x + layer.proj(attn.transpose(1, 2).reshape(b, -1, d))
        return x + layer.ff2(nn.functional.gelu(layer.ff1(layer.ln2(x))))  # type: ignore[no-any-return]

    def _attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        scores = (q @ keys.transpose(-2, -1)) / math.sqrt(self.cache_shape.head_dim)
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        return torch.softmax(scores, dim=-1) @ values


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

    def _layer(
        self, layer: Any, x: torch.Tensor, context: Any, attend: Attend, keep: torch.Tensor | None
    ) -> torch.Tensor:
        b, s, _ = x.shape
        dim = self.cache_shape.head_dim
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        k = attn.k_proj(h).view(b, s, -1, dim).transpose(1, 2)
        v = attn.v_proj(h).view(b, s, -1, dim).transpose(1, 2)
        if keep is None:
            q = attn.q_proj(h).view(b, s, -1, dim).transpose(1, 2)
            q, k = self._rotary(q, k, *context)
        else:  # the queries at `keep` only, each rotated at its own position
            h, x = h.index_select(1, keep), x.index_select(1, keep)
            q = attn.q_proj(h).view(b, len(keep), -1, dim).transpose(1, 2)
            cos, sin = context
            q = self._rotary(q, q, cos.index_select(1, keep), sin.index_select(1, keep))[0]
            k = self._rotary(k, k, cos, sin)[1]
        out = attend(q, k, v).transpose(1, 2).reshape(b, q.shape[2], -1)
        x = x + attn.o_proj(out)
        return x + layer.mlp(layer.post_attention_layernorm(x))  # type: ignore[no-any-return]

    def _attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        # grouped-query attention without repeating the cache per query head (HF's repeat_kv
        # copies every layer's whole cache each step): query head h reads kv head h // groups,
        # so the queries of one kv head are stacked as rows against its keys and values
        b, _, s, dim = q.shape
        kv = keys.shape[1]
        grouped = q.reshape(b, kv, self.groups * s, dim)
        scores = ((grouped @ keys.transpose(-2, -1)) * self.scaling).view(b, kv, self.groups, s, -1)
        scores = scores.masked_fill(~mask.unsqueeze(-3), torch.finfo(scores.dtype).min)
        # at least float32, as HF's eager attention; an fp64 (golden) run stays float64 throughout
        weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
        return (weights.view(b, kv, self.groups * s, -1) @ values).view(b, -1, s, dim)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm.lm_head(self.body.norm(x))  # type: ignore[no-any-return]

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


class Step(nn.Module):
    """One of the adapter's steps (`prefill`, `decode` or `mixed`) as a module for a backend:
    inputs the step's own `inputs` tensors, then *keys, *values."""

    def __init__(self, lm: Any, layers: int, kind: str, inputs: int) -> None:
        super().__init__()
        self.adapter = lm
        self.layers = layers
        self.kind = kind
        self.inputs = inputs

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        own, cache = tensors[: self.inputs], tensors[self.inputs :]
        n = self.layers
        return getattr(self.adapter, self.kind)(*own, Layers(list(cache[:n]), list(cache[n:])))  # type: ignore[no-any-return]
