"""The engine process's own side: `python -m` this module, the pipe's end as its argument
(`engine_process` starts it).

It loads its model as the executor would in process (`runtime.load_runtime`: the same phases,
findings and warm-up), reports `Ready` (or `LoadFailed`), then loops: the executor's messages
since the last iteration (blocking while idle), one iteration of the core (`EngineCore.iterate`:
the process computes nothing else, so a step needs no thread hand-off), and what it gave, in
one `Outputs` message. It imports nothing of the executor's process side (`loaded_model`,
`engine_process`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from multiprocessing.connection import Connection

from services.executor.generation.engine import EngineCore
from services.executor.generation.engine_messages import (
    Cancel,
    Failure,
    Load,
    LoadFailed,
    Outputs,
    Ready,
    Stats,
    Submit,
    ToEngine,
)
from services.executor.generation.runtime import load_runtime
from services.executor.generation.scheduler import Request, TokenEvent
from services.executor.generation.tokenizer import load_tokenizer


def serve(conn: Connection) -> None:
    """Loads the model the executor sends, then serves it until "close" or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the executor stops it, by Close or EOF
    from services.executor.device import select_backend

    # the hf format's (2 s of a 3 s start on this host), imported ahead only while nobody
    # waits: a spare with no load yet. A load already here (a child started for it, or a spare
    # taken while it imported torch) imports it only if its model is in that format, so a
    # built-in model's engine does not wait for transformers.
    if not conn.poll():
        with contextlib.suppress(ImportError):
            import transformers.models.llama.modeling_llama  # noqa: F401
    try:
        load: Load = conn.recv()
    except EOFError:
        return  # a spare whose executor has gone
    try:
        backend = select_backend(load.backend, load.cpu_threads)
        runtime, times, findings = load_runtime(load.spec, backend, load.options)
        core = EngineCore(runtime, load_tokenizer(runtime.settings.tokenizer, load.spec.folder))
    except BaseException as exc:
        conn.send(LoadFailed(exc))
        return
    conn.send(Ready(times, findings, runtime.vocab_size, _stats(core)))
    requests: dict[int, Request] = {}
    with contextlib.suppress(EOFError, OSError):  # EOF: the executor has gone
        while _take_in(conn, core, requests):
            core.iterate()
            _send_out(conn, core, requests)


def _stats(core: EngineCore) -> Stats:
    return Stats(
        counters=core.counters,  # not astuple: its deep copy was 15 of the 21 us a call
        running=core.scheduler.running,
        compilations_after_warmup=core.runtime.compilations_after_warmup(),
    )


def _take_in(conn: Connection, core: EngineCore, requests: dict[int, Request]) -> bool:
    """The executor's messages since the last iteration (waiting for one while idle); False at
    `Close`."""
    if not core.busy:
        conn.poll(None)
    while conn.poll():
        message: ToEngine = conn.recv()
        if isinstance(message, Submit):
            requests[message.rid] = core.add(message.request)
        elif isinstance(message, Cancel):
            request = requests.pop(message.rid, None)
            if request is not None:
                core.cancel(request)
        else:
            return False
    return True


def _send_out(conn: Connection, core: EngineCore, requests: dict[int, Request]) -> None:
    """What the iteration gave, in one message (and the engine's state after it)."""
    running, compilations = core.scheduler.running, core.runtime.compilations_after_warmup()
    out = Outputs([], [], [], [], [], [], [], [], core.counters, running, compilations)
    for rid, request in list(requests.items()):
        if not request.events:
            continue
        ended = False
        for item in request.events.take():
            if isinstance(item, TokenEvent):
                (choice,) = item.choices
                out.rids.append(rid)
                out.tokens.append(choice.token)
                out.texts.append(item.text)
                out.finish_reasons.append(item.finish_reason)
                out.busy_us.append(request.busy_ns // 1000)
                out.logprobs.append(choice.logprob)
                out.tops.append(choice.top)
                ended = item.finish_reason is not None
            else:
                out.failures.append(Failure(rid, item))
                ended = True
        if ended:
            del requests[rid]
    conn.send(out)


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
    # no interpreter teardown: it holds nothing to save, and tearing down torch and transformers
    # took 1-1.5 s, which a reload of the model waited for
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
