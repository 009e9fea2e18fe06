"""The generation engine in a process of its own: the default on the host CPU (`executor serve
--generation-engine process`, `ExecutorConfig.generation_engine`), as vLLM's V1 engine core
runs beside its API server.

Why: in one process the engine's steps (eager torch, whose small ops are mostly Python) and the
gRPC event loop (a response built and written per stream per token) take turns on one GIL, so
the executor never used more than one core, however many streams it served. Here the child
holds the model, the KV cache and the scheduler (`EngineCore`, driven by `iterate()`: the
process computes nothing else, so a step needs no thread hand-off), and the executor's loop
only moves requests in and events out, each step's events in one message.

- `EngineProcess` (parent, at load, on the device thread): spawns the child, which loads the
  model exactly as the executor would in process (a `LoadedModel` of its own: the same phases,
  findings and warm-up), and waits until it is warm. ModelReady stays false until then.
- `RemoteEngine` (parent, on the event loop): `GenerationEngine`'s surface (submit, cancel,
  counters, running, depth, close). It checks a request before sending it (bad input is
  INVALID_ARGUMENT at once, as in process) and bounds the requests outstanding by the slots
  plus `max_queue` (then RESOURCE_EXHAUSTED).
- `_serve` (child): reads the executor's messages between iterations (blocking while idle),
  runs one iteration, and sends what it gave.

A spare child, its imports done, waits for the next load (`_Spare`), and a child leaves by
`os._exit` after its last message: a reload takes 0.2-0.3 s, not the 5-6 s of a new
interpreter importing torch and transformers plus 1-1.5 s of the old one's teardown.

Messages (pickled, over a multiprocessing pipe):
    executor -> engine: ("load", spec, options, backend, cpu_threads) once; then
        ("submit", rid, prompt, params, with_text, deadline) | ("cancel", rid) | ("close",)
    engine -> executor: ("ready", Ready) | ("failed", exception) once, at load; then per
        iteration ("events", [(rid, token, text, finish_reason, busy_us, logprob, top) or
        (rid, exception)], Stats)
Deadlines are `time.perf_counter()` instants: CLOCK_MONOTONIC, one clock for every process on
Linux. A child that dies fails its requests with UNAVAILABLE; the model then answers
UNAVAILABLE until it is loaded again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from services.executor.generation.engine import (
    EngineCore,
    EngineCounters,
    GenerationStream,
    Request,
    TokenEvent,
    check_prompt,
    engine_full,
)
from services.executor.generation.sampling import Choice
from services.executor.generation.settings import GenerationSettings, SamplingParams
from services.executor.generation.tokenizer import Tokenizer, load_tokenizer
from switchyard.errors import SwitchyardError, Unavailable

if TYPE_CHECKING:
    from services.executor.loaded_model import Findings, LoadOptions, PhaseTimes
    from switchyard.models.repository import ModelSpec

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Stats:
    """The engine's state after an iteration."""

    counters: EngineCounters  # the child's own (pickled as it is sent: a copy here)
    running: int
    compilations_after_warmup: int


@dataclass(frozen=True)
class Ready:
    times: PhaseTimes
    findings: Findings
    vocab_size: int
    stats: Stats


def _stats(engine: EngineCore) -> Stats:
    return Stats(
        counters=engine.counters,  # not astuple: its deep copy was 15 of the 21 us a call
        running=engine.running,
        compilations_after_warmup=engine.runtime.compilations_after_warmup(),
    )


class EngineProcess:
    """The child process of one generative model, started and warm."""

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
        error if it failed. The child is a fresh interpreter (`python -m` this module, the pipe's
        end passed as a file descriptor): no fork of a process with gRPC's threads, and, unlike
        multiprocessing's spawn, no re-import of the caller's main module."""
        settings = spec.generation
        assert settings is not None
        process, parent = _SPARE.take() or _launch()
        _SPARE.keep()  # the next load's, importing while this one loads
        try:
            parent.send(("load", spec, options, backend, cpu_threads))
            while not parent.poll(0.5):
                if process.poll() is not None:
                    raise EOFError
            kind, payload = parent.recv()
        except (EOFError, OSError):
            _stop(process, parent)
            raise Unavailable(
                f"the generation engine of {spec.name} exited while loading (exit code "
                f"{process.returncode}); see the executor's log"
            ) from None
        except BaseException:
            _stop(process, parent)
            raise
        if kind == "failed":
            _stop(process, parent)
            raise payload
        log.info("%s:%s: generation engine in process %d, warm", spec.name, spec.version, process.pid)
        return cls(process, parent, settings, payload)

    def compilations_after_warmup(self) -> int:
        return self.stats.compilations_after_warmup

    def stop(self) -> None:
        _stop(self.process, self.conn)


Child = tuple["subprocess.Popen[bytes]", Connection]


def _launch() -> Child:
    """A new engine process: it imports what a load needs, then waits for its model."""
    parent, child = multiprocessing.Pipe()
    fd = child.fileno()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    process = subprocess.Popen([sys.executable, "-m", __name__, str(fd)], pass_fds=(fd,), env=env)
    child.close()
    return process, parent


class _Spare:
    """One engine process started ahead, its imports done, waiting for a model: the next load
    takes it instead of waiting for a new interpreter to import torch and transformers (5-6 s
    of a 6 s load of the test Llama on this host, 0.2-0.3 s from a spare; 0.05 s in process).
    Started with the first engine, so an executor that serves no causal LM starts none; it
    exits with the executor (its pipe's other end closes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._child: Child | None = None

    def take(self) -> Child | None:
        with self._lock:
            child, self._child = self._child, None
        if child is not None and child[0].poll() is not None:  # it died waiting
            child[1].close()
            return None
        return child

    def keep(self) -> None:
        with self._lock:
            if self._child is None:
                self._child = _launch()


_SPARE = _Spare()


def _stop(process: subprocess.Popen[bytes], conn: Connection) -> None:
    """Asks the child to leave, waits for it, kills it if it does not."""
    with contextlib.suppress(OSError):  # it may have gone already
        conn.send(("close",))
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log.warning("the generation engine process %d did not stop; killing it", process.pid)
        process.kill()
        process.wait()
    conn.close()


class RemoteEngine:
    """The executor's side of an engine process: `GenerationEngine`'s surface."""

    def __init__(self, process: EngineProcess, tokenizer: Tokenizer) -> None:
        self.settings = process.settings
        self.tokenizer = tokenizer
        self.vocab_size = process.vocab_size
        self._process = process
        self._requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self._rejected = 0
        self._closed = False
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(process.conn.fileno(), self._read)

    @property
    def counters(self) -> EngineCounters:
        counters = self._process.stats.counters
        return dataclasses.replace(counters, rejected_full=counters.rejected_full + self._rejected)

    @property
    def running(self) -> int:
        return self._process.stats.running

    @property
    def depth(self) -> int:
        """Requests waiting for a slot, those on their way to the engine included."""
        return max(0, len(self._requests) - self._process.stats.running)

    def submit(
        self, prompt: list[int], params: SamplingParams, with_text: bool, deadline: float | None = None
    ) -> GenerationStream:
        if self._closed:
            raise Unavailable("the model's generation engine has stopped; load the model again")
        max_tokens = check_prompt(self.settings, self.vocab_size, prompt, params)
        if len(self._requests) >= self.settings.decode_slots + self.settings.max_queue:
            self._rejected += 1
            raise engine_full(self.settings)
        rid = next(self._ids)
        request = Request(
            prompt=list(prompt),
            params=params,
            max_tokens=max_tokens,
            stop_ids=frozenset(),
            eos_ids=(),
            detokenizer=None,
            deadline=deadline,
            rid=rid,
        )
        self._send(("submit", rid, request.prompt, params, with_text, deadline))
        self._requests[rid] = request
        return GenerationStream(self, request)

    def cancel(self, request: Request) -> None:
        if self._requests.pop(request.rid, None) is not None:
            request.cancelled = request.done = True
            self._send(("cancel", request.rid))

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            self._process.conn.send(message)
        except OSError:
            self._lost()
            raise Unavailable("the model's generation engine has stopped; load the model again") from None

    def _read(self) -> None:
        """One iteration's events (the loop calls this again while more are waiting): the
        streams write each iteration's tokens before the next are read, as in process, and
        merge them only when their writers lag."""
        try:
            _, events, stats = self._process.conn.recv()
        except (EOFError, OSError):
            self._lost()
            return
        self._process.stats = stats
        for item in events:
            self._event(item)

    def _event(self, item: tuple[Any, ...]) -> None:
        request = self._requests.get(item[0])
        if request is None:  # cancelled here since
            return
        if len(item) == 2:  # the error that ends it
            del self._requests[request.rid]
            request.done = True
            request.events.put_nowait(item[1])
            return
        _, token, text, reason, busy_us, logprob, top = item
        if not request.output:
            request.first_token_at = time.perf_counter()
        request.output.append(token)
        request.busy_ns = busy_us * 1000
        if reason is not None:
            del self._requests[request.rid]
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


# ---- the child ---------------------------------------------------------------------------
def _child(conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the executor stops it, by "close" or EOF
    from services.executor.device import select_backend
    from services.executor.loaded_model import LoadedModel

    with contextlib.suppress(ImportError):  # the hf format's, imported while nobody waits
        import transformers.models.llama.modeling_llama  # noqa: F401
    try:
        _, spec, options, backend, cpu_threads = conn.recv()
    except EOFError:
        return  # a spare whose executor has gone
    try:
        model = LoadedModel(spec, select_backend(backend, cpu_threads), options)
        model.load()
        runtime = model.generation
        assert runtime is not None and not isinstance(runtime, EngineProcess)
        engine = EngineCore(runtime, load_tokenizer(runtime.settings.tokenizer, spec.folder))
    except BaseException as exc:  # the executor raises it as its load's error
        conn.send(("failed", exc))
        return
    conn.send(("ready", Ready(model.times, model.findings, runtime.vocab_size, _stats(engine))))
    streams: dict[int, GenerationStream] = {}
    with contextlib.suppress(EOFError, OSError):  # EOF: the executor has gone
        while _take_in(conn, engine, streams):
            engine.iterate()
            _send_out(conn, engine, streams)


def _take_in(conn: Connection, engine: EngineCore, streams: dict[int, GenerationStream]) -> bool:
    """The executor's messages since the last iteration (waiting for one while idle); False at
    "close"."""
    if not engine.busy:
        conn.poll(None)
    while conn.poll():
        message = conn.recv()
        if message[0] == "close":
            return False
        if message[0] == "cancel":
            stream = streams.pop(message[1], None)
            if stream is not None:
                stream.cancel()
            continue
        _, rid, prompt, params, with_text, deadline = message
        try:
            streams[rid] = engine.submit(prompt, params, with_text, deadline)
        except SwitchyardError as exc:
            conn.send(("events", [(rid, exc)], _stats(engine)))
    return True


def _send_out(conn: Connection, engine: EngineCore, streams: dict[int, GenerationStream]) -> None:
    """What the iteration gave, in one message (and the engine's state after it)."""
    out: list[tuple[Any, ...]] = []
    for rid, stream in list(streams.items()):
        events, error = stream.take()
        for e in events:
            (c,) = e.choices
            out.append((rid, e.token_ids[0], e.text, e.finish_reason, stream.busy_us, c.logprob, c.top))
        if error is not None:
            out.append((rid, error))
        if error is not None or (events and events[-1].finish_reason is not None):
            del streams[rid]
    conn.send(("events", out, _stats(engine)))


if __name__ == "__main__":
    # by its own name, so that what it pickles (Ready, Stats) unpickles in the executor
    from services.executor.generation import engine_process

    engine_process._child(Connection(int(sys.argv[1])))
    # no interpreter teardown: it holds nothing to save, and tearing down torch and transformers
    # took 1-1.5 s, which a reload of the model waited for
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
