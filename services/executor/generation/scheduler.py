"""Admission and scheduling of generation requests, written once for both engines.

- `admit`: whether a request may enter an engine, for every engine client (`engine_client`):
  its prompt and limits checked against the model's (INVALID_ARGUMENT, with the lengths that
  do not fit), and the requests outstanding bounded by the decode slots plus `max_queue`
  (beyond it, RESOURCE_EXHAUSTED). The engine process's client counts the requests it sent
  and not seen finish; the engine in process, those waiting or running.
- `Scheduler`: the requests of one engine core (`engine.EngineCore`): the waiting queue, the
  running ones by decode slot, the slots. Each iteration, cancelled and expired requests
  leave (`sweep`), then up to `max_prefills_per_step` waiting requests take free slots, the
  lowest first (`schedule`).
- `Request`, `TokenEvent` and `EventBuffer`: a request's state and the events its consumer
  takes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.executor.generation.kv_cache import SlotAllocator
from services.executor.generation.sampling import Choice
from services.executor.generation.settings import GenerationSettings, SamplingParams
from services.executor.generation.tokenizer import Detokenizer
from switchyard.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted

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


def split(items: list[Event]) -> tuple[list[TokenEvent], BaseException | None]:
    """The token events of a batch, and its error (the engine sends nothing after one)."""
    events = [e for e in items if isinstance(e, TokenEvent)]
    errors = [e for e in items if isinstance(e, BaseException)]
    return events, (errors[0] if errors else None)


@dataclass
class Request:
    """A request as its engine client and its stream see it; the engine core's own fields
    (stops, detokenizer, generator, slot, position) stay at their defaults in a client whose
    core is in another process."""

    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    deadline: float | None
    stop_ids: frozenset[int] = frozenset()
    eos_ids: tuple[int, ...] = ()
    detokenizer: Detokenizer | None = None
    events: EventBuffer = field(default_factory=EventBuffer)
    generator: torch.Generator | None = None
    slot: int = -1
    position: int = 0  # where the pending token goes in the cache
    pending: int = -1  # the last chosen token, fed at the next decode step
    output: list[int] = field(default_factory=list)
    cancelled: bool = False
    done: bool = False
    rid: int = -1  # its id between the executor and its engine process (`engine_messages`)
    enqueued: float = field(default_factory=time.perf_counter)
    first_token_at: float = 0.0
    busy_ns: int = 0  # this request's share of the steps it was in (device time)

    def banned(self) -> tuple[int, ...]:
        early = len(self.output) < self.params.min_tokens and not self.params.ignore_eos
        return self.eos_ids if early else ()


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


def admit(
    s: GenerationSettings, vocab: int, prompt: list[int], params: SamplingParams, outstanding: int
) -> int:
    """The request's max_tokens if it may join `outstanding` requests (waiting or running);
    INVALID_ARGUMENT if it does not fit the model, RESOURCE_EXHAUSTED (`EngineFull`) if every
    slot is taken and `max_queue` requests wait."""
    max_tokens = check_prompt(s, vocab, prompt, params)
    if outstanding >= s.decode_slots + s.max_queue:
        raise EngineFull(
            f"all {s.decode_slots} decode slots are busy and {s.max_queue} requests wait (the "
            "queue's bound); retry later"
        )
    return max_tokens


class Scheduler:
    """One engine core's requests: waiting (in arrival order) and running (by decode slot)."""

    def __init__(self, settings: GenerationSettings, counters: EngineCounters) -> None:
        self.settings = settings
        self.counters = counters
        self._slots = SlotAllocator(settings.decode_slots)
        self._waiting: deque[Request] = deque()
        self._running: dict[int, Request] = {}  # by slot

    @property
    def depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def outstanding(self) -> int:
        return len(self._waiting) + len(self._running)

    @property
    def busy(self) -> bool:
        return bool(self._running or self._waiting)

    def add(self, request: Request) -> None:
        self._waiting.append(request)
        self.counters.requests += 1

    def sweep(self) -> None:
        """Cancelled and expired requests leave; their slots are free for this iteration."""
        now = time.perf_counter()
        for request in list(self._running.values()):
            if request.cancelled:
                self.finish(request, None)
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

    def schedule(self) -> tuple[list[Request], list[Request]]:
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

    def finish(self, request: Request, reason: str | None) -> None:
        """`request` leaves its slot: finished for `reason`, or cancelled (None)."""
        if request.slot >= 0:
            self._running.pop(request.slot, None)
            self._slots.give_back(request.slot)
            request.slot = -1
        request.done = True
        if reason is None:
            self.counters.cancelled += 1
        else:
            self.counters.completed += 1

    def fail(self, requests: list[Request], exc: Exception) -> None:
        """A failed step fails the requests in it, not the engine."""
        log.exception("a generation step failed")
        for request in requests:
            self.finish(request, "error")
            request.events.put_nowait(exc)

    def drain(self, error: BaseException) -> None:
        """Every request not done ends with `error` (the engine is closing)."""
        for request in (*self._waiting, *self._running.values()):
            if not request.done:
                request.done = True
                request.events.put_nowait(error)
        self._waiting.clear()
        self._running.clear()
