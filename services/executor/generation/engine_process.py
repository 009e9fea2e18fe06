"""The generation engine in a process of its own: the default on the host CPU (`executor serve
--generation-engine process`, `ExecutorConfig.generation_engine`), as vLLM's V1 engine core
runs beside its API server.

Why: in one process the engine's steps (eager torch, whose small ops are mostly Python) and the
gRPC event loop (a response built and written per stream per token) take turns on one GIL, so
the executor never used more than one core, however many streams it served. Here the child
holds the model, the KV cache and the scheduler (`EngineCore`, driven by `iterate()`: the
process computes nothing else, so a step needs no thread hand-off), and the executor's loop
only moves requests in and events out, each step's events in one message.

- `EngineProcess` (at load, on the device thread): spawns the child (`engine_child`), which
  loads the model exactly as the executor would in process (`runtime.load_runtime`: the same
  phases, findings and warm-up), and waits until it is warm. ModelReady stays false until
  then. It is the model's `LoadedEngine`; `serve()` gives its client.
- `RemoteEngine` (on the event loop): the `EngineClient` across processes. Its `submit` is the
  one every engine has (`EngineClient.submit`: bad input is INVALID_ARGUMENT at once, as in
  process, and the requests outstanding are bounded by the slots plus `max_queue`, then
  RESOURCE_EXHAUSTED); it sends what was admitted, and hands each iteration's events to the
  streams.

A spare child, its imports done, waits for the next load (`_Spare`), and a child leaves by
`os._exit` after its last message: a reload takes 0.2-0.3 s, not the 5-6 s of a new
interpreter importing torch and transformers plus 1-1.5 s of the old one's teardown.

The messages are typed records (`engine_messages`). A child that dies fails its requests with
UNAVAILABLE; the model then answers UNAVAILABLE until it is loaded again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import subprocess
import time
from multiprocessing.connection import Connection

from services.executor.generation.engine_client import EngineClient, InlineOk, RunOnDevice
from services.executor.generation.engine_launch import SPARE as _SPARE
from services.executor.generation.engine_launch import launch as _launch
from services.executor.generation.engine_messages import (
    Admitted,
    Cancel,
    Close,
    Failure,
    Load,
    LoadFailed,
    Outputs,
    Ready,
    Submit,
    ToEngine,
)
from services.executor.generation.sampling import Choice
from services.executor.generation.scheduler import EngineCounters, Request, TokenEvent
from services.executor.generation.settings import GenerationSettings
from services.executor.generation.tokenizer import Tokenizer
from services.executor.load_phases import LoadOptions
from switchyard.errors import SwitchyardError, Unavailable
from switchyard.models.repository import ModelSpec

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0


class EngineProcess:
    """The child process of one generative model, started and warm (a `LoadedEngine`)."""

    def __init__(
        self, process: subprocess.Popen[bytes], conn: Connection, settings: GenerationSettings, ready: Ready
    ) -> None:
        self.process = process
        self.conn = conn
        self.settings = settings
        self.times = ready.times
        self.findings = ready.findings
        self.vocab_size = ready.vocab_size
        self.stats = ready.stats

    @classmethod
    def start(cls, spec: ModelSpec, options: LoadOptions, backend: str, cpu_threads: int) -> EngineProcess:
        """Starts the engine of `spec` and waits until it is loaded and warm; raises the load's
        error if it failed. The child is a fresh interpreter (`python -m engine_child`, the
        pipe's end passed as a file descriptor): no fork of a process with gRPC's threads, and,
        unlike multiprocessing's spawn, no re-import of the caller's main module."""
        settings = spec.generation
        assert settings is not None
        process, parent = _SPARE.take() or _launch()
        try:
            parent.send(Load(spec, options, backend, cpu_threads))
            while not parent.poll(0.5):
                if process.poll() is not None:
                    raise EOFError
            reply: Ready | LoadFailed = parent.recv()
        except (EOFError, OSError):
            _stop(process, parent)
            raise Unavailable(
                f"the generation engine of {spec.name} exited while loading (exit code "
                f"{process.returncode}); see the executor's log"
            ) from None
        except BaseException:
            _stop(process, parent)
            raise
        if isinstance(reply, LoadFailed):
            _stop(process, parent)
            raise reply.error
        log.info("%s:%s: generation engine in process %d, warm", spec.name, spec.version, process.pid)
        # the next load's, importing once this one is warm: started beside the load, its
        # imports took a core from it (about 12 s of CPU on a 2-core host, as long as the load's)
        _SPARE.keep()
        return cls(process, parent, settings, reply)

    def compilations_after_warmup(self) -> int:
        return self.stats.compilations_after_warmup

    def serve(
        self, tokenizer: Tokenizer, run_on_device: RunOnDevice, inline_ok: InlineOk | None = None
    ) -> RemoteEngine:
        """Its client (the steps run in the child: `run_on_device` and `inline_ok` go unused)."""
        return RemoteEngine(self, tokenizer)

    def send(self, message: ToEngine) -> None:
        self.conn.send(message)

    def stop(self) -> None:
        _stop(self.process, self.conn)


def _stop(process: subprocess.Popen[bytes], conn: Connection) -> None:
    """Asks the child to leave, waits for it, kills it if it does not."""
    with contextlib.suppress(OSError):  # it may have gone already
        conn.send(Close())
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log.warning("the generation engine process %d did not stop; killing it", process.pid)
        process.kill()
        process.wait()
    conn.close()


class RemoteEngine(EngineClient):
    """The executor's side of an engine process: the `EngineClient` across processes."""

    def __init__(self, process: EngineProcess, tokenizer: Tokenizer) -> None:
        super().__init__(process.settings, tokenizer, process.vocab_size)
        self._process = process
        self._requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(process.conn.fileno(), self._read)

    @property
    def outstanding(self) -> int:
        """Requests sent and not seen finish, those on their way to the engine included."""
        return len(self._requests)

    @property
    def running(self) -> int:
        return self._process.stats.running

    @property
    def depth(self) -> int:
        """Requests waiting for a slot, those on their way to the engine included."""
        return max(0, len(self._requests) - self._process.stats.running)

    def _closed_message(self) -> str:
        return "the model's generation engine has stopped; load the model again"

    def _core_counters(self) -> EngineCounters:
        return self._process.stats.counters

    def _start(self, admitted: Admitted) -> Request:
        rid = next(self._ids)
        prompt, params, max_tokens, _, deadline = admitted
        request = Request(prompt=prompt, params=params, max_tokens=max_tokens, deadline=deadline, rid=rid)
        self._send(Submit(rid, admitted))
        self._requests[rid] = request
        return request

    def cancel(self, request: Request) -> None:
        if self._requests.pop(request.rid, None) is not None:
            request.cancelled = request.done = True
            self._send(Cancel(request.rid))

    def _send(self, message: ToEngine) -> None:
        try:
            self._process.send(message)
        except OSError:
            self._lost()
            raise Unavailable(self._closed_message()) from None

    def _read(self) -> None:
        """One iteration's events (the loop calls this again while more are waiting): the
        streams write each iteration's tokens before the next are read, as in process, and
        merge them only when their writers lag."""
        try:
            out: Outputs = self._process.conn.recv()
        except (EOFError, OSError):
            self._lost()
            return
        self._process.stats = out.stats
        requests = self._requests
        now = time.perf_counter()
        for rid, token, text, reason, busy_us, logprob, top in zip(
            out.rids, out.tokens, out.texts, out.finish_reasons, out.busy_us, out.logprobs, out.tops,
            strict=True,
        ):  # fmt: skip
            request = requests.get(rid)
            if request is None:  # cancelled here since
                continue
            if not request.output:
                request.first_token_at = now
            request.output.append(token)
            request.busy_ns = busy_us * 1000
            if reason is not None:
                del requests[rid]
                request.done = True
            request.events.put_nowait(
                TokenEvent(
                    token_ids=(token,),
                    text=text,
                    choices=(Choice(token, logprob, top),),
                    finish_reason=reason,
                    prompt_tokens=len(request.prompt),
                    output_tokens=len(request.output),
                )
            )
        for failure in out.failures:
            self._failed(failure)

    def _failed(self, failure: Failure) -> None:
        """The error that ends a request."""
        request = self._requests.pop(failure.rid, None)
        if request is not None:
            request.done = True
            request.events.put_nowait(failure.error)

    def _detach(self) -> bool:
        """Takes no more requests and stops reading the child; False if that was done already."""
        if self._closed:
            return False
        self._closed = True
        self._loop.remove_reader(self._process.conn.fileno())
        return True

    def _lost(self) -> None:
        """The child is gone: every request fails, and so does every later one."""
        if not self._detach():
            return
        code = self._process.process.poll()
        log.error("the generation engine process exited (exit code %s)", code)
        self._fail_all(
            Unavailable(f"the model's generation engine exited (exit code {code}); load the model again")
        )

    def _fail_all(self, error: SwitchyardError) -> None:
        requests, self._requests = self._requests, {}
        for request in requests.values():
            request.done = True
            request.events.put_nowait(error)

    async def close(self) -> None:
        self._detach()
        self._fail_all(Unavailable("the model was unloaded before this generation finished"))
        await asyncio.to_thread(self._process.stop)
