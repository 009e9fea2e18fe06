"""Per-request sampling parameters (engine settings: `switchyard.models.generation`).

Frozen and validated once at the edge. Sampling parameters arrive as the JSON object
Triton's vLLM backend takes in `sampling_parameters` (vLLM's `SamplingParams` names), so a
client written for Triton + vLLM works unchanged; an unknown key or a value out of range is
refused with the key named.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from switchyard.errors import InvalidArgument
from switchyard.models.generation import GenerationSettings

__all__ = ["GenerationSettings", "SamplingParams", "parse_sampling"]


@dataclass(frozen=True)
class SamplingParams:
    """One request's decoding (vLLM's names). temperature 0 is greedy; top_k 0 or -1 and top_p 1
    are off; `seed` makes a sampled request reproducible; `logprobs` = how many top tokens'
    logprobs to return besides the chosen one's (None: no logprobs)."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


MAX_LOGPROBS = 20
MAX_STOPS = 64  # stop strings a request may send
MAX_STOP_BYTES = 4096  # their UTF-8 bytes in all
MAX_STOP_TOKEN_IDS = 256
_FLOATS = ("temperature", "top_p")
_INTS = ("max_tokens", "top_k", "seed", "logprobs", "min_tokens")
# Accepted for compatibility with clients that always send them; only the neutral value.
_NEUTRAL = {
    "n": 1,
    "best_of": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "detokenize": True,
}


def parse_sampling(raw: str | bytes | dict[str, Any], vocab_size: int) -> SamplingParams:
    """`sampling_parameters` JSON (or an already decoded object) -> SamplingParams."""
    obj = _decode_sampling(raw)
    values: dict[str, Any] = {}
    for key, value in obj.items():
        if value is None:
            continue
        if key in _NEUTRAL:
            if value != _NEUTRAL[key]:
                raise InvalidArgument(
                    f"sampling parameter {key!r} = {value!r} is not supported; "
                    f"send {_NEUTRAL[key]!r} or omit it"
                )
            continue
        values[key] = _sampling_value(key, value, vocab_size)
    params = SamplingParams(**values)
    _check_ranges(params, vocab_size)
    return params


def _decode_sampling(raw: str | bytes | dict[str, Any]) -> dict[str, Any]:
    if isinstance(raw, str | bytes):
        if not raw:
            return {}
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidArgument(f"sampling_parameters is not JSON: {exc}") from None
    else:
        obj = raw
    if not isinstance(obj, dict):
        raise InvalidArgument("sampling_parameters must be a JSON object")
    return obj


def _sampling_value(key: str, value: Any, vocab_size: int) -> Any:
    """One parameter's value, checked for its type (its range: `_check_ranges`)."""
    if key in _FLOATS:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise InvalidArgument(f"sampling parameter {key!r} must be a number, got {value!r}")
        return float(value)
    if key in _INTS:
        if isinstance(value, str) and value.lstrip("-").isdigit():
            value = int(value)  # Triton's examples send numbers as strings
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgument(f"sampling parameter {key!r} must be an integer, got {value!r}")
        return value
    if key == "stop":
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise InvalidArgument("sampling parameter 'stop' must be a string or a list of non-empty strings")
        return _bounded_stops(stops)
    if key == "stop_token_ids":
        return _stop_token_ids(value, vocab_size)
    if key == "ignore_eos":
        if not isinstance(value, bool):
            raise InvalidArgument(f"sampling parameter 'ignore_eos' must be true or false, got {value!r}")
        return value
    known = sorted({*_FLOATS, *_INTS, "stop", "stop_token_ids", "ignore_eos", *_NEUTRAL})
    raise InvalidArgument(f"unknown sampling parameter {key!r}; known: {', '.join(known)}")


def _bounded_stops(stops: list[str]) -> tuple[str, ...]:
    """The stop strings, within MAX_STOPS strings and MAX_STOP_BYTES bytes in all: each is
    matched against every generated token on the engine all requests share."""
    if len(stops) > MAX_STOPS:
        raise InvalidArgument(f"sampling parameter 'stop' has {len(stops)} strings; the limit is {MAX_STOPS}")
    size = sum(len(s.encode()) for s in stops)
    if size > MAX_STOP_BYTES:
        raise InvalidArgument(
            f"sampling parameter 'stop' has {size} bytes in all; the limit is {MAX_STOP_BYTES}"
        )
    return tuple(stops)


def _stop_token_ids(value: Any, vocab_size: int) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise InvalidArgument("sampling parameter 'stop_token_ids' must be a list of integers")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(
            f"sampling parameter 'stop_token_ids' has {len(value)} ids; the limit is {MAX_STOP_TOKEN_IDS}"
        )
    bad = [t for t in value if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(
            f"sampling parameter 'stop_token_ids' has ids {bad} outside 0..{vocab_size - 1}"
        )
    return tuple(value)


def _check_ranges(p: SamplingParams, vocab_size: int) -> None:
    if p.max_tokens is not None and p.max_tokens < 1:
        raise InvalidArgument(f"sampling parameter 'max_tokens' is {p.max_tokens}; send at least 1")
    if not 0.0 <= p.temperature <= 100.0:
        raise InvalidArgument(f"sampling parameter 'temperature' is {p.temperature}; use 0 (greedy) to 100")
    if p.top_k < -1 or p.top_k > vocab_size:
        raise InvalidArgument(
            f"sampling parameter 'top_k' is {p.top_k}; use -1 or 0 (off) or 1..{vocab_size}"
        )
    if not 0.0 < p.top_p <= 1.0:
        raise InvalidArgument(f"sampling parameter 'top_p' is {p.top_p}; use a value in (0, 1]")
    if p.seed is not None and not 0 <= p.seed < 2**63:
        raise InvalidArgument(f"sampling parameter 'seed' is {p.seed}; use 0 to 2**63 - 1")
    if p.logprobs is not None and not 0 <= p.logprobs <= MAX_LOGPROBS:
        raise InvalidArgument(f"sampling parameter 'logprobs' is {p.logprobs}; use 0 to {MAX_LOGPROBS}")
    if p.min_tokens < 0:
        raise InvalidArgument(f"sampling parameter 'min_tokens' is {p.min_tokens}; send 0 or more")
