"""A generative model's serving settings: the `[generation]` table of its `model.toml`.

Plain data (no torch), so the model repository can parse and validate it anywhere; the
executor's generation engine is built from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from switchyard.errors import InvalidArgument

MAX_GRAPHS_PER_KIND = 8  # torch.compile keeps this many graphs of one step function by default


def _powers_of_two_to(limit: int) -> tuple[int, ...]:
    out, n = [], 1
    while n < limit:
        out.append(n)
        n *= 2
    out.append(limit)
    return tuple(out)


@dataclass(frozen=True)
class GenerationSettings:
    """How a causal LM is served. Every shape the engine runs is fixed by these, so a static-shape
    backend compiles exactly `len(prompt_buckets) + len(decode_buckets)` graphs at warm-up.

    - `max_context`: prompt plus generated tokens, per request (the KV cache's length);
    - `max_new_tokens`: the most tokens one request may ask for;
    - `prompt_buckets`: prefill lengths; a prompt is padded up to the smallest that fits, and
      the largest is the longest prompt accepted;
    - `decode_slots`: requests decoding at once (KV cache rows); more wait in the queue;
    - `decode_buckets`: decode-step widths (default powers of two up to `decode_slots`);
    - `max_queue`: requests waiting for a slot before RESOURCE_EXHAUSTED;
    - `max_prefills_per_step`: prompts admitted between two decode steps;
    - `tokenizer`: "bytes" (UTF-8 bytes are tokens), or a tokenizer.json (or its folder),
      relative to the version folder; "" = the version folder's tokenizer.json;
    - `eos_token_ids`: tokens that end a generation (unless the request sets ignore_eos).
    """

    max_context: int
    max_new_tokens: int
    prompt_buckets: tuple[int, ...]
    decode_slots: int
    decode_buckets: tuple[int, ...] = ()
    max_queue: int = 64
    max_prefills_per_step: int = 4
    tokenizer: str = ""
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        buckets = tuple(sorted(set(self.prompt_buckets)))
        if not buckets or buckets[0] < 1 or buckets[-1] > self.max_context:
            raise InvalidArgument(
                f"prompt_buckets {list(self.prompt_buckets)} must be between 1 and max_context "
                f"({self.max_context})"
            )
        if self.decode_slots < 1 or self.decode_slots > 1024:
            raise InvalidArgument(f"decode_slots is {self.decode_slots}; use 1 to 1024")
        decode = tuple(sorted(set(self.decode_buckets))) or _powers_of_two_to(self.decode_slots)
        if decode[0] < 1 or decode[-1] != self.decode_slots:
            raise InvalidArgument(
                f"decode_buckets {list(decode)} must be >= 1 and end at decode_slots ({self.decode_slots})"
            )
        if len(buckets) > MAX_GRAPHS_PER_KIND or len(decode) > MAX_GRAPHS_PER_KIND:
            raise InvalidArgument(
                f"at most {MAX_GRAPHS_PER_KIND} prompt buckets and {MAX_GRAPHS_PER_KIND} decode buckets"
            )
        if not 1 <= self.max_new_tokens < self.max_context:
            raise InvalidArgument(
                f"max_new_tokens is {self.max_new_tokens}; use 1 to max_context - 1 ({self.max_context - 1})"
            )
        if self.max_queue < 0 or self.max_prefills_per_step < 1:
            raise InvalidArgument("max_queue must be >= 0 and max_prefills_per_step >= 1")
        object.__setattr__(self, "prompt_buckets", buckets)
        object.__setattr__(self, "decode_buckets", decode)

    @property
    def max_prompt(self) -> int:
        return self.prompt_buckets[-1]

    @classmethod
    def from_table(cls, table: dict[str, Any]) -> GenerationSettings:
        """From a `[generation]` TOML table (keys as the field names)."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(table) - known)
        if unknown:
            raise InvalidArgument(f"unknown [generation] key(s) {unknown}; known: {sorted(known)}")
        values = dict(table)
        for key in ("prompt_buckets", "decode_buckets", "eos_token_ids"):
            if key in values:
                values[key] = tuple(int(v) for v in values[key])
        return cls(**values)
