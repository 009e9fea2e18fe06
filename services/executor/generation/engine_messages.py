"""The messages between the executor (`engine_process.RemoteEngine`) and an engine process
(`engine_child`), pickled over a multiprocessing pipe.

executor -> engine: `Load` once; then `Submit`, `Cancel`, and `Close` at the end.
engine -> executor: `Ready` or `LoadFailed` once, at load; then `Outputs` after each iteration.

Records with explicit fields (typed named tuples). An iteration's tokens go as columns, one
list per field, not a record per token: 32 named tuples took ~10x the 30 us of 32 plain
tuples to pickle, while a list of ints or strings pickles in C. Deadlines are
`time.perf_counter()` instants: CLOCK_MONOTONIC, one clock for every process on Linux.
"""

from __future__ import annotations

from typing import NamedTuple

from services.executor.generation.scheduler import EngineCounters
from services.executor.generation.settings import SamplingParams
from services.executor.load_phases import Findings, LoadOptions, PhaseTimes
from switchyard.models.registry import ModelSpec


# ---- executor -> engine --------------------------------------------------------------------
class Load(NamedTuple):
    """Load this model, as the executor would in process, and report when it is warm."""

    spec: ModelSpec
    options: LoadOptions
    backend: str
    cpu_threads: int


class Admitted(NamedTuple):
    """A request the executor admitted (`scheduler.admit`: `max_tokens` is its checked limit),
    as every engine takes it, in process or across the pipe."""

    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    with_text: bool
    deadline: float | None


class Submit(NamedTuple):
    rid: int
    request: Admitted


class Cancel(NamedTuple):
    rid: int


class Close(NamedTuple):
    """Leave: the model is unloaded (EOF on the pipe means the same)."""


ToEngine = Submit | Cancel | Close


# ---- engine -> executor --------------------------------------------------------------------
class Stats(NamedTuple):
    """The engine's state after an iteration."""

    counters: EngineCounters  # the child's own (pickled as it is sent: a copy here)
    running: int
    compilations_after_warmup: int


class Ready(NamedTuple):
    times: PhaseTimes
    findings: Findings
    vocab_size: int
    stats: Stats


class LoadFailed(NamedTuple):
    error: BaseException  # the executor raises it as its load's error


class Failure(NamedTuple):
    """The error that ends a request (nothing of it follows)."""

    rid: int
    error: BaseException


class Outputs(NamedTuple):
    """What one iteration gave: row i of the columns is one token of request `rids[i]`, with
    the text it released, the finish reason on a request's last token, the request's device
    time so far, and its choice's logprob and top logprobs (when asked for); then the requests
    that failed, and the engine's state after the iteration (`stats`: its fields inline, as
    every record class a message names costs it ~5 us more to pickle and ~3 us to unpickle)."""

    rids: list[int]
    tokens: list[int]
    texts: list[str]
    finish_reasons: list[str | None]
    busy_us: list[int]
    logprobs: list[float | None]
    tops: list[tuple[tuple[int, float], ...]]
    failures: list[Failure]
    counters: EngineCounters
    running: int
    compilations_after_warmup: int

    @property
    def stats(self) -> Stats:
        return Stats(self.counters, self.running, self.compilations_after_warmup)


FromEngine = Ready | LoadFailed | Outputs
