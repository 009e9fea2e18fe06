"""The generation engine: iteration-level (continuous) batching over a static KV cache.

`GenerationRuntime` (`generation.runtime`) is the device side. `EngineCore` is the scheduler,
run one iteration at a time: by the engine process on its one thread (`engine_process`, the
cpu default), or by `GenerationEngine` in the executor's own process, from the event loop with
the steps on the device thread (accelerators, and `--generation-engine inline`). Requests wait
in a bounded queue (beyond `max_queue`, RESOURCE_EXHAUSTED) for a free slot. Each iteration:
1. requests cancelled or past their deadline leave, and their slots are freed;
2. up to `max_prefills_per_step` waiting requests take free slots;
3. one step: a decode row for every running request (one new token each, each at its own
   position) and the prefill of the admitted ones (each gives its first token, and joins the
   decode rows at the next step). On eager that is one forward over all their rows
   (`GenerationRuntime.step`); on compiled graphs a decode step per width bucket, then a
   prefill per prompt.
Tokens are chosen with the step (host sampling, `sampling`), so the event loop only moves
events to the streams: each request's wait in its `EventBuffer` until its consumer takes them,
all that came at once (a stream's writer that lagged sends them in one response).

Where a step runs in process: on the device thread, unless it serves one request alone and the
executor says a step of its expected length may run on the event loop (`inline_ok`: nothing else on
the device and the step short, as for a lone unary request). A short eager step is
Python-bound: on a thread of its own it pays two thread hand-offs per step and contends with
the event loop for the GIL (every torch op releases it, and takes it back only when the loop
lets go or after the switch interval). With more requests the step stays on the thread, so
that the loop keeps taking in new requests and their streams' I/O while it computes: steps on
the loop there starved arrivals, and the batch formed slowly (5 rows a step instead of 30 at
32 streams, measured). The expected length is a moving average of the measured steps, seeded
by the warm-up's: on a host device (cpu) the step's own CPU time, which neither other
processes' load nor GIL waits inflate; on an accelerator, where the step's work is not this
thread's, its wall time.

A request leaves at its stop (EOS, a stop id or string), at max_tokens, or when its consumer
goes away, and its slot serves the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from services.executor.generation.kv_cache import SlotAllocator
from services.executor.generation.runtime import GenerationRuntime
from services.executor.generation.sampling import Choice, choose, new_generator
from services.executor.generation.settings import GenerationSettings, SamplingParams
from services.executor.generation.tokenizer import Detokenizer, Tokenizer
from switchyard.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted, Unavailable

__all__ = ["EngineCore", "GenerationEngine", "GenerationRuntime", "GenerationStream", "TokenEvent"]

log = logging.getLogger(__name__)


class EngineFull(ResourceExhausted):
    """Every slot is busy and the queue is at its bound."""


@dataclass(frozen=True)
class TokenEvent:
    """What one step gave a request: its new token, the text it released, and on the last event
    the finish reason ("stop" or "length"; "cancelled" is never seen by a consumer)."""

    token_ids: tuple[int, ...]
    text: str
    choices: tuple[Choice, ...]
    finish_reason: str | None
    prompt_tokens: int
    output_tokens: int


Event = TokenEvent | BaseException  # an error ends the request's events


class EventBuffer:
    """A request's events that its consumer has not taken yet: the engine appends, the consumer
    takes them all at once (one when it keeps up, several when it lags a step or more behind).
    `on_ready` is called when an event comes to an empty buffer (so once per batch)."""

    def __init__(self) -> None:
        self._items: list[Event] = []
        self._ready = asyncio.Event()
        self.on_ready: Callable[[], None] | None = None

    def put_nowait(self, item: Event) -> None:
        self._items.append(item)
        if len(self._items) == 1:
            self._ready.set()
            if self.on_ready is not None:
                self.on_ready()

    def __len__(self) -> int:
        return len(self._items)

    def take(self) -> list[Event]:
        items, self._items = self._items, []
        self._ready.clear()
        return items

    async def get(self) -> list[Event]:
        """Every event not taken yet, waiting for one if there is none."""
        while not self._items:
            await self._ready.wait()
        return self.take()


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop_ids: frozenset[int]
    eos_ids: tuple[int, ...]
    detokenizer: Detokenizer | None
    deadline: float | None
    events: EventBuffer = field(default_factory=EventBuffer)
    generator: torch.Generator | None = None
    slot: int = -1
    position: int = 0  # where the pending token goes in the cache
    pending: int = -1  # the last chosen token, fed at the next decode step
    output: list[int] = field(default_factory=list)
    cancelled: bool = False
    done: bool = False
    rid: int = -1  # its id between the executor and its engine process (`engine_process`)
    enqueued: float = field(default_factory=time.perf_counter)
    first_token_at: float = 0.0
    busy_ns: int = 0  # this request's share of the steps it was in (device time)

    def banned(self) -> tuple[int, ...]:
        early = len(self.output) < self.params.min_tokens and not self.params.ignore_eos
        return self.eos_ids if early else ()


class Canceller(Protocol):
    def cancel(self, request: Request) -> None: ...


class GenerationStream:
    """A submitted request: iterate for its events; `cancel()` (or leaving) frees its slot."""

    def __init__(self, engine: Canceller, request: Request) -> None:
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
        return _split(self._request.events.take())

    async def batches(self) -> AsyncGenerator[list[TokenEvent]]:
        """The events in batches: all that came while the consumer was away each time; the last
        batch ends with the finish. Raises the error that ended the request, after its events."""
        try:
            while True:
                events, error = _split(await self._request.events.get())
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


def _split(items: list[Event]) -> tuple[list[TokenEvent], BaseException | None]:
    """The token events of a batch, and its error (the engine sends nothing after one)."""
    events = [e for e in items if isinstance(e, TokenEvent)]
    errors = [e for e in items if isinstance(e, BaseException)]
    return events, (errors[0] if errors else None)


RunOnDevice = Callable[..., Awaitable[Any]]
InlineOk = Callable[[float], bool]  # may a step expected to take this many seconds run on the loop?

STEP_EMA = 0.2  # weight of the newest step in the expected step length


@dataclass
class EngineCounters:
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    rejected_full: int = 0
    inline_steps: int = 0  # iterations run on the event loop (the rest on the device thread)
    prefills: int = 0
    decode_steps: int = 0
    decode_rows: int = 0  # decode rows the steps gave tokens to
    tokens: int = 0
    compute_ns: int = 0


def engine_full(s: GenerationSettings) -> EngineFull:
    return EngineFull(
        f"all {s.decode_slots} decode slots are busy and {s.max_queue} requests wait (the queue's "
        "bound); retry later"
    )


def check_prompt(s: GenerationSettings, vocab: int, prompt: list[int], params: SamplingParams) -> int:
    """The request's max_tokens, or INVALID_ARGUMENT with the lengths that do not fit."""
    if not prompt:
        raise InvalidArgument("the prompt is empty; send at least one token of text_input or input_ids")
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise InvalidArgument(f"input_ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}")
    if len(prompt) > s.max_prompt:
        raise InvalidArgument(
            f"the prompt has {len(prompt)} tokens, over this model's longest prompt of {s.max_prompt} "
            f"tokens (context {s.max_context}); shorten it"
        )
    if params.max_tokens is not None and params.max_tokens > s.max_new_tokens:
        raise InvalidArgument(
            f"max_tokens is {params.max_tokens}, over this model's limit of {s.max_new_tokens}"
        )
    room = s.max_context - len(prompt)
    wanted = params.max_tokens if params.max_tokens is not None else min(16, s.max_new_tokens, room)
    if len(prompt) + wanted > s.max_context:
        raise InvalidArgument(
            f"the prompt has {len(prompt)} tokens and max_tokens is {wanted}: {len(prompt) + wanted} "
            f"tokens, over this model's context of {s.max_context}; lower max_tokens to {room} or less"
        )
    return wanted


class EngineCore:
    """The scheduler, run one iteration at a time by `iterate()` on the caller's thread: what
    the engine process drives (`engine_process`), and `GenerationEngine` from its event loop."""

    def __init__(self, runtime: GenerationRuntime, tokenizer: Tokenizer) -> None:
        self.runtime = runtime
        self.settings = runtime.settings
        self.tokenizer = tokenizer
        self.step_s = runtime.warm_step_s()  # expected iteration length (moving average)
        self._clock = time.thread_time_ns if runtime.device.type == "cpu" else time.perf_counter_ns
        self._slots = SlotAllocator(self.settings.decode_slots)
        self._waiting: deque[Request] = deque()
        self._running: dict[int, Request] = {}  # by slot
        self._closed = False
        self.counters = EngineCounters()

    # ---- admission -----------------------------------------------------------------------
    @property
    def depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def busy(self) -> bool:
        return bool(self._running or self._waiting)

    @property
    def vocab_size(self) -> int:
        return self.runtime.vocab_size

    def submit(
        self, prompt: list[int], params: SamplingParams, with_text: bool, deadline: float | None = None
    ) -> GenerationStream:
        if self._closed:
            raise Unavailable("the model is being unloaded; retry on another executor")
        max_tokens = check_prompt(self.settings, self.runtime.vocab_size, prompt, params)
        if self._slots.free == 0 and len(self._waiting) >= self.settings.max_queue:
            self.counters.rejected_full += 1
            raise engine_full(self.settings)
        eos = () if params.ignore_eos else tuple(self.runtime.eos_token_ids)
        request = Request(
            prompt=list(prompt),
            params=params,
            max_tokens=max_tokens,
            stop_ids=frozenset((*params.stop_token_ids, *eos)),
            eos_ids=tuple(self.runtime.eos_token_ids),
            detokenizer=Detokenizer(self.tokenizer, params.stop) if with_text or params.stop else None,
            deadline=deadline,
            generator=new_generator(params),
        )
        self._waiting.append(request)
        self.counters.requests += 1
        self.wake()
        return GenerationStream(self, request)

    def wake(self) -> None:
        """A request came or left (a loop that waits for one wakes)."""

    def cancel(self, request: Request) -> None:
        """The consumer left: the request leaves at the next iteration."""
        if not request.done:
            request.cancelled = True
            self.wake()

    # ---- the loop ------------------------------------------------------------------------
    def _sweep(self) -> None:
        """Cancelled and expired requests leave; their slots are free for this iteration."""
        now = time.perf_counter()
        for request in list(self._running.values()):
            if request.cancelled:
                self._finish(request, None)
        kept: deque[Request] = deque()
        for request in self._waiting:
            if request.cancelled:
                self.counters.cancelled += 1
                request.done = True
            elif request.deadline is not None and now >= request.deadline:
                request.done = True
                request.events.put_nowait(
                    DeadlineExceeded("the deadline passed while the request waited for a decode slot")
                )
            else:
                kept.append(request)
        self._waiting = kept

    def _finish(self, request: Request, reason: str | None) -> None:
        if request.slot >= 0:
            self._running.pop(request.slot, None)
            self._slots.give_back(request.slot)
            request.slot = -1
        request.done = True
        if reason is None:
            self.counters.cancelled += 1
        else:
            self.counters.completed += 1

    def _admit(self) -> tuple[list[Request], list[Request]]:
        """This iteration's rows: the running requests (in slot order) and the waiting ones that
        take free slots now, up to `max_prefills_per_step`."""
        decodes = sorted(self._running.values(), key=lambda r: r.slot)
        admitted: list[Request] = []
        while self._waiting and self._slots.free and len(admitted) < self.settings.max_prefills_per_step:
            request = self._waiting.popleft()
            request.slot = self._slots.take()
            self._running[request.slot] = request
            admitted.append(request)
        return decodes, admitted

    def _failed(self, requests: list[Request], exc: Exception) -> None:
        """A failed step fails the requests in it, not the engine."""
        log.exception("a generation step failed")
        for request in requests:
            self._finish(request, "error")
            request.events.put_nowait(exc)

    def iterate(self) -> None:
        """One iteration on this thread, if any request is waiting or running (the engine
        process's loop: its step needs no thread hand-off, the process computes nothing else)."""
        self._sweep()
        if not self.busy:
            return
        decodes, admitted = self._admit()
        try:
            chosen = self._compute(decodes, admitted)
        except Exception as exc:
            self._failed([*decodes, *admitted], exc)
            return
        for request, choice in chosen:
            self._deliver(request, choice)

    def _compute(self, decodes: list[Request], admitted: list[Request]) -> list[tuple[Request, Choice]]:
        """One iteration's compute (on the device thread, inline, or in the engine process): the
        decode step and the prefills (one mixed step on eager), then each request's next choice."""
        start = time.perf_counter_ns()
        clock = self._clock()
        logits = self.runtime.step(
            [(r.slot, r.pending, r.position) for r in decodes], [(r.slot, r.prompt) for r in admitted]
        )
        elapsed = time.perf_counter_ns() - start
        if decodes:
            self.counters.decode_steps += 1
            self.counters.decode_rows += len(decodes)
        self.counters.prefills += len(admitted)
        # each request's share of the step's device time, by the tokens it put in
        rows = [*decodes, *admitted]
        tokens = len(decodes) + sum(len(r.prompt) for r in admitted)
        for r in decodes:
            r.busy_ns += elapsed // tokens
        for r in admitted:
            r.busy_ns += elapsed * len(r.prompt) // tokens
        out = _choices(rows, logits)
        self.counters.compute_ns += time.perf_counter_ns() - start
        self.step_s += STEP_EMA * ((self._clock() - clock) / 1e9 - self.step_s)
        return out

    def _deliver(self, request: Request, choice: Choice) -> None:
        if request.done or request.cancelled:
            if not request.done:
                self._finish(request, None)
            return
        if not request.output:
            request.first_token_at = time.perf_counter()
            request.position = len(request.prompt)
        else:
            request.position += 1
        token = choice.token
        self.counters.tokens += 1
        reason, text = _append_token(request, token)
        if reason is not None:
            self._finish(request, reason)
        request.events.put_nowait(
            TokenEvent(
                token_ids=(token,),
                text=text,
                choices=(choice,),
                finish_reason=reason,
                prompt_tokens=len(request.prompt),
                output_tokens=len(request.output),
            )
        )


class GenerationEngine(EngineCore):
    """The engine in this process: its loop runs on the event loop, its steps on the device
    thread (`run_on_device`) or, for a lone short one, inline (`inline_ok`)."""

    def __init__(
        self,
        runtime: GenerationRuntime,
        tokenizer: Tokenizer,
        run_on_device: RunOnDevice,
        inline_ok: InlineOk | None = None,
    ) -> None:
        super().__init__(runtime, tokenizer)
        self._on_device = run_on_device
        self._inline_ok = inline_ok or (lambda _s: False)
        self._wakeup = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    def wake(self) -> None:
        self._wakeup.set()

    async def _loop(self) -> None:
        while not self._closed:
            self._sweep()
            if not self.busy:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            decodes, admitted = self._admit()
            try:
                if len(decodes) + len(admitted) == 1 and self._inline_ok(self.step_s):
                    self.counters.inline_steps += 1
                    chosen = self._compute(decodes, admitted)
                else:
                    chosen = await self._on_device(self._compute, decodes, admitted)
            except Exception as exc:
                self._failed([*decodes, *admitted], exc)
                continue
            for request, choice in chosen:
                self._deliver(request, choice)
            # the streams send what they got before the next step: the events went straight to
            # the consumers (a stream's writer builds and writes its response in one pass)
            await asyncio.sleep(0)

    async def close(self) -> None:
        self._closed = True
        self._wakeup.set()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        for request in (*self._waiting, *self._running.values()):
            if not request.done:
                request.done = True
                request.events.put_nowait(
                    Unavailable("the model was unloaded before this generation finished")
                )
        self._waiting.clear()
        self._running.clear()


def _choices(rows: list[Request], logits: torch.Tensor) -> list[tuple[Request, Choice]]:
    """Each row's next token: greedy rows from one argmax over the step, the others sampled."""
    best = torch.argmax(logits, dim=-1).tolist()
    out: list[tuple[Request, Choice]] = []
    for i, r in enumerate(rows):
        banned = r.banned()
        if r.params.greedy and r.params.logprobs is None and not banned:
            out.append((r, Choice(int(best[i]))))
        else:
            out.append((r, choose(logits[i], r.params, r.generator, banned)))
    return out


def _append_token(request: Request, token: int) -> tuple[str | None, str]:
    """Adds `token` to the request's output: (the finish reason, None while it goes on; the
    text it releases)."""
    request.output.append(token)
    request.pending = token
    reason: str | None = None
    text = ""
    if token in request.stop_ids:
        reason = "stop"
    detok = request.detokenizer
    if detok is not None and reason is None:
        detok.add(token)
        if detok.stopped:
            reason = "stop"
    if reason is None and len(request.output) >= request.max_tokens:
        reason = "length"
    if detok is not None:
        text = detok.release(final=reason is not None)
    return reason, text


async def collect(stream: GenerationStream) -> list[TokenEvent]:
    return [event async for event in stream]
