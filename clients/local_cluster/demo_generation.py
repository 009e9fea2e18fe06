"""The demo's generation step: one completion streamed through the router's OpenAI API.

It uses the official `openai` client exactly as a user would (base URL from `cluster.json`,
the team's API key as the bearer), so the demo proves what the README's first lines show:
`switchyard up` answers OpenAI's API with a generative built-in, tokens as they come, and
usage that the ledger charges per output token.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from switchyard.errors import FailedPrecondition

# The generative built-in `switchyard up` loads on the cpu executor by default.
GENERATIVE_MODEL = "tiny-lm-gen"
PROMPT = "the switchyard routes"


class GenerationFailed(FailedPrecondition):
    """The demo's streamed completion did not complete."""


@dataclass
class StreamedCompletion:
    model: str
    text: str = ""
    chunks: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: float = 0.0
    wall_ms: float = 0.0
    finish_reason: str = ""
    deltas: list[str] = field(default_factory=list)


def generative_model(models: Mapping[str, tuple[str, ...]]) -> str:
    """The generative built-in if some executor serves it, else "" (the step is skipped)."""
    return GENERATIVE_MODEL if any(GENERATIVE_MODEL in served for served in models.values()) else ""


async def stream_completion(
    base_url: str, key: str, model: str, max_tokens: int = 24, prompt: str = PROMPT
) -> StreamedCompletion:
    """One greedy completion, streamed, with `stream_options.include_usage`."""
    import openai  # the demo's client only: a wheel without it skips this step

    out = StreamedCompletion(model)
    began = time.monotonic()
    async with openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60) as client:
        try:
            stream = await client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            async for chunk in stream:
                if chunk.usage is not None:
                    out.prompt_tokens = chunk.usage.prompt_tokens
                    out.completion_tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    if not out.chunks:
                        out.ttft_ms = (time.monotonic() - began) * 1000
                    out.chunks += 1
                    out.deltas.append(choice.text)
                    out.finish_reason = choice.finish_reason or out.finish_reason
        except openai.APIError as exc:
            raise GenerationFailed(f"streamed completion of {model} at {base_url} failed: {exc}") from exc
    out.text = "".join(out.deltas)
    out.wall_ms = (time.monotonic() - began) * 1000
    if not out.completion_tokens:
        raise GenerationFailed(f"streamed completion of {model} at {base_url} reported no output tokens")
    return out


async def demo_generation(
    base_url: str, key: str, models: Mapping[str, tuple[str, ...]], tell: Callable[[str], None]
) -> StreamedCompletion | None:
    """The demo's step: says what it streamed, or why it was skipped."""
    model = generative_model(models)
    if not base_url or not model:
        tell("generation skipped: the router's OpenAI API is off or no executor serves tiny-lm-gen")
        return None
    if importlib.util.find_spec("openai") is None:
        tell("generation skipped: the `openai` client is not installed (pip install openai)")
        return None
    done = await stream_completion(base_url, key, model)
    tell(
        f"{model}: streamed {done.completion_tokens} tokens in {done.chunks} chunks through the "
        f"OpenAI API ({base_url}), first after {done.ttft_ms:.0f} ms, all in {done.wall_ms:.0f} ms "
        f"({done.finish_reason}): {PROMPT!r} -> {done.text!r}"
    )
    return done
