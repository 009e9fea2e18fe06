"""The generation engine: iteration-level (continuous) batching over a static KV cache.

`GenerationRuntime` (`generation.runtime`) is the device side, and `scheduler.Scheduler` keeps
the requests. `EngineCore` puts them together and is run one iteration at a time: by the
engine process on its one thread (`engine_child`, the cpu default), or by `InProcessEngine`
in the executor's own process, from the event loop with the steps on the device thread
(accelerators, and `--generation-engine inline`). Requests wait in a bounded queue (beyond
`max_queue`, RESOURCE_EXHAUSTED: `scheduler.admit`) for a free slot. Each iteration:
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
import time
from dataclasses import dataclass

import torch

from services.executor.generation.engine_client import (
    EngineClient,
    InlineOk,
    RunOnDevice,
)
from services.executor.generation.engine_messages import Admitted
from services.executor.generation.runtime import GenerationRuntime
from services.executor.generation.sampling import Choice, choose, new_generator
from services.executor.generation.scheduler import EngineCounters, Request, Scheduler, TokenEvent
from services.executor.generation.settings import GenerationSettings
from services.executor.generation.tokenizer import Detokenizer, Tokenizer
from services.executor.load_phases import Findings, PhaseTimes
from switchyard.errors import Unavailable

STEP_EMA = 0.2  # weight of the newest step in the expected step length

Rows = tuple[list[Request], list[Request]]  # an iteration's decode rows and admitted prompts


class EngineCore:
    """The scheduler and the device side, one iteration at a time on the caller's thread: what
    the engine process drives (`iterate`, `engine_child`), and `InProcessEngine` from its event
    loop (`plan`, `compute` where it decides, `deliver`)."""

    def __init__(self, runtime: GenerationRuntime, tokenizer: Tokenizer) -> None:
        self.runtime = runtime
        self.settings = runtime.settings
        self.tokenizer = tokenizer
        self.step_s = runtime.warm_step_s()  # expected iteration length (moving average)
        self._clock = time.thread_time_ns if runtime.device.type == "cpu" else time.perf_counter_ns
        self.counters = EngineCounters()
        self.scheduler = Scheduler(self.settings, self.counters)

    @property
    def busy(self) -> bool:
        return self.scheduler.busy

    def add(self, admitted: Admitted) -> Request:
        """Queues an admitted request (`scheduler.admit` checked it)."""
        prompt, params, max_tokens, with_text, deadline = admitted
        eos = () if params.ignore_eos else tuple(self.runtime.eos_token_ids)
        request = Request(
            prompt=prompt,
            params=params,
            max_tokens=max_tokens,
            deadline=deadline,
            stop_ids=frozenset((*params.stop_token_ids, *eos)),
            eos_ids=tuple(self.runtime.eos_token_ids),
            detokenizer=Detokenizer(self.tokenizer, params.stop) if with_text or params.stop else None,
            generator=new_generator(params),
        )
        self.scheduler.add(request)
        return request

    def cancel(self, request: Request) -> None:
        """The consumer left: the request leaves at the next iteration."""
        if not request.done:
            request.cancelled = True

    def plan(self) -> Rows | None:
        """The next iteration's rows, None while no request is waiting or running."""
        self.scheduler.sweep()
        return self.scheduler.schedule() if self.scheduler.busy else None

    def iterate(self) -> None:
        """One iteration on this thread, if any request is waiting or running (the engine
        process's loop: its step needs no thread hand-off, the process computes nothing else)."""
        rows = self.plan()
        if rows is None:
            return
        try:
            chosen = self.compute(*rows)
        except Exception as exc:
            self.scheduler.fail([*rows[0], *rows[1]], exc)
            return
        self.deliver(chosen)

    def compute(self, decodes: list[Request], admitted: list[Request]) -> list[tuple[Request, Choice]]:
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

    def deliver(self, chosen: list[tuple[Request, Choice]]) -> None:
        """Each request's token event; the finished leave their slots."""
        for request, choice in chosen:
            if request.done or request.cancelled:
                if not request.done:
                    self.scheduler.finish(request, None)
                continue
            if not request.output:
                request.first_token_at = time.perf_counter()
                request.position = len(request.prompt)
            else:
                request.position += 1
            token = choice.token
            self.counters.tokens += 1
            reason, text = _append_token(request, token)
            if reason is not None:
                self.scheduler.finish(request, reason)
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


class InProcessEngine(EngineClient):
    """The engine in this process: its loop runs on the event loop, its steps on the device
    thread (`run_on_device`) or, for a lone short one, inline (`inline_ok`)."""

    def __init__(
        self,
        runtime: GenerationRuntime,
        tokenizer: Tokenizer,
        run_on_device: RunOnDevice,
        inline_ok: InlineOk | None = None,
    ) -> None:
        super().__init__(runtime.settings, tokenizer, runtime.vocab_size)
        self.core = EngineCore(runtime, tokenizer)
        self._on_device = run_on_device
        self._inline_ok = inline_ok or (lambda _s: False)
        self._wakeup = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    @property
    def outstanding(self) -> int:
        return self.core.scheduler.outstanding

    @property
    def running(self) -> int:
        return self.core.scheduler.running

    @property
    def depth(self) -> int:
        return self.core.scheduler.depth

    def _closed_message(self) -> str:
        return "the model is being unloaded; retry on another executor"

    def _core_counters(self) -> EngineCounters:
        return self.core.counters

    def _start(self, admitted: Admitted) -> Request:
        request = self.core.add(admitted)
        self._wakeup.set()
        return request

    def cancel(self, request: Request) -> None:
        if not request.done:
            self.core.cancel(request)
            self._wakeup.set()

    async def _loop(self) -> None:
        core = self.core
        while not self._closed:
            rows = core.plan()
            if rows is None:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            decodes, admitted = rows
            try:
                if len(decodes) + len(admitted) == 1 and self._inline_ok(core.step_s):
                    core.counters.inline_steps += 1
                    chosen = core.compute(decodes, admitted)
                else:
                    chosen = await self._on_device(core.compute, decodes, admitted)
            except Exception as exc:
                core.scheduler.fail([*decodes, *admitted], exc)
                continue
            core.deliver(chosen)
            # the streams send what they got before the next step: the events went straight to
            # the consumers (a stream's writer builds and writes its response in one pass)
            await asyncio.sleep(0)

    async def close(self) -> None:
        self._closed = True
        self._wakeup.set()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.core.scheduler.drain(Unavailable("the model was unloaded before this generation finished"))


@dataclass
class LocalEngine:
    """A causal LM loaded and warm in this process (`LoadedEngine`), served by `InProcessEngine`."""

    runtime: GenerationRuntime
    times: PhaseTimes
    findings: Findings

    @property
    def settings(self) -> GenerationSettings:
        return self.runtime.settings

    def compilations_after_warmup(self) -> int:
        return self.runtime.compilations_after_warmup()

    def serve(
        self, tokenizer: Tokenizer, run_on_device: RunOnDevice, inline_ok: InlineOk | None = None
    ) -> InProcessEngine:
        return InProcessEngine(self.runtime, tokenizer, run_on_device, inline_ok)


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
