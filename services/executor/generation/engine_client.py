"""The executor's one interface to a causal LM's generation engine, as vLLM V1's `EngineClient`.

- `LoadedEngine`: a model loaded and warm, not serving yet (`LoadedModel.generation`): its
  load's report, its compile counter, and `serve()`, which starts its client on the event loop.
- `EngineClient`: what the executor and its servicers call (`LoadedModel.engine`): `submit`
  (checked and bounded by `scheduler.admit`, the same for every engine), `cancel`, the
  counters and `close`. Two implement it: `engine.InProcessEngine` (its core in this process,
  stepped from the event loop) and `engine_process.RemoteEngine` (its core in an engine
  process, over typed messages, `engine_messages`).
- `GenerationStream`: a submitted request, whichever engine runs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from services.executor.generation.engine_messages import Admitted
from services.executor.generation.scheduler import (
    EngineCounters,
    EngineFull,
    Request,
    TokenEvent,
    admit,
    split,
)
from services.executor.generation.settings import GenerationSettings, SamplingParams
from services.executor.generation.tokenizer import Tokenizer
from services.executor.load_phases import Findings, PhaseTimes
from switchyard.errors import Unavailable

RunOnDevice = Callable[..., Awaitable[Any]]
InlineOk = Callable[[float], bool]  # may a step expected to take this many seconds run on the loop?


class EngineClient(ABC):
    """A causal LM's engine, wherever its core runs. `submit` is written here once: the client
    is open, the request fits the model and the engine has room (`scheduler.admit`); then the
    implementation starts it (`_start`)."""

    def __init__(self, settings: GenerationSettings, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._rejected = 0  # requests refused by the bound (RESOURCE_EXHAUSTED)
        self._closed = False

    def submit(
        self, prompt: list[int], params: SamplingParams, with_text: bool, deadline: float | None = None
    ) -> GenerationStream:
        """Starts a generation; iterate the stream for its events. `deadline` is a
        `time.perf_counter()` instant (CLOCK_MONOTONIC, one clock for every process on Linux)."""
        if self._closed:
            raise Unavailable(self._closed_message())
        try:
            max_tokens = admit(self.settings, self.vocab_size, prompt, params, self.outstanding)
        except EngineFull:
            self._rejected += 1
            raise
        return GenerationStream(
            self, self._start(Admitted(list(prompt), params, max_tokens, with_text, deadline))
        )

    @property
    def counters(self) -> EngineCounters:
        counters = self._core_counters()
        return dataclasses.replace(counters, rejected_full=counters.rejected_full + self._rejected)

    @property
    @abstractmethod
    def outstanding(self) -> int:
        """Requests admitted and not finished (what the bound counts)."""

    @property
    @abstractmethod
    def running(self) -> int:
        """Requests in a decode slot."""

    @property
    @abstractmethod
    def depth(self) -> int:
        """Requests waiting for a slot."""

    @abstractmethod
    def _closed_message(self) -> str: ...

    @abstractmethod
    def _core_counters(self) -> EngineCounters: ...

    @abstractmethod
    def _start(self, admitted: Admitted) -> Request:
        """Hands an admitted request to the core; the request its stream reads."""

    @abstractmethod
    def cancel(self, request: Request) -> None:
        """The consumer left: the request leaves at the core's next iteration."""

    @abstractmethod
    async def close(self) -> None:
        """Stops the engine; every request not finished ends with UNAVAILABLE."""


class LoadedEngine(Protocol):
    """A causal LM loaded and warm, in this process (`engine.LocalEngine`) or in an engine
    process (`engine_process.EngineProcess`)."""

    @property
    def settings(self) -> GenerationSettings: ...

    @property
    def times(self) -> PhaseTimes: ...

    @property
    def findings(self) -> Findings: ...

    def compilations_after_warmup(self) -> int: ...

    def serve(
        self, tokenizer: Tokenizer, run_on_device: RunOnDevice, inline_ok: InlineOk | None = None
    ) -> EngineClient:
        """Its client, on the running event loop: steps in process go to `run_on_device`, or
        run on the loop where `inline_ok` allows."""
        ...


class GenerationStream:
    """A submitted request: iterate for its events; `cancel()` (or leaving) frees its slot."""

    def __init__(self, engine: EngineClient, request: Request) -> None:
        self._engine = engine
        self._request = request
        self.prompt_tokens = len(request.prompt)

    @property
    def output_tokens(self) -> int:
        return len(self._request.output)

    @property
    def busy_us(self) -> int:
        """Device time of this request so far: its prefill and its share of each decode step."""
        return self._request.busy_ns // 1000

    @property
    def queue_s(self) -> float:
        r = self._request
        return (r.first_token_at - r.enqueued) if r.first_token_at else 0.0

    def cancel(self) -> None:
        self._engine.cancel(self._request)

    def on_ready(self, callback: Callable[[], None]) -> None:
        """`callback()` when events come that were not there at the last `take()` (called now if
        some are waiting already): a consumer that takes them as it can (`take`)."""
        self._request.events.on_ready = callback
        if self._request.events:
            callback()

    def take(self) -> tuple[list[TokenEvent], BaseException | None]:
        """The events that came since the last take, and the error that ended the request, if
        one came (after them)."""
        return split(self._request.events.take())

    async def batches(self) -> AsyncGenerator[list[TokenEvent]]:
        """The events in batches: all that came while the consumer was away each time; the last
        batch ends with the finish. Raises the error that ended the request, after its events."""
        try:
            while True:
                events, error = split(await self._request.events.get())
                if events:
                    yield events
                if error is not None:
                    raise error
                if events and events[-1].finish_reason is not None:
                    return
        finally:
            self.cancel()

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        async with contextlib.aclosing(self.batches()) as batches:
            async for batch in batches:
                for event in batch:
                    yield event
