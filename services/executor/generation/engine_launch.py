"""Starting generation engine processes (`engine_child`), without importing what they import.

`engine_process` starts one per generative model it loads; `SPARE` holds one started ahead,
its imports (torch, transformers: most of a new engine's start) done while nobody waits for
it. Nothing here imports torch, so `executor serve` can start its first engine before its own
imports (`prestart`): the two interpreters then import side by side instead of one after the
other.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
from multiprocessing.connection import Connection

ENGINE_CHILD = "services.executor.generation.engine_child"  # the child's program (`python -m`)

Child = tuple["subprocess.Popen[bytes]", Connection]


def launch() -> Child:
    """A new engine process: it imports what a load needs, then waits for its model."""
    parent, child = multiprocessing.Pipe()
    fd = child.fileno()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    process = subprocess.Popen([sys.executable, "-m", ENGINE_CHILD, str(fd)], pass_fds=(fd,), env=env)
    child.close()
    return process, parent


class Spare:
    """One engine process started ahead, its imports done, waiting for a model: the next load
    takes it instead of waiting for a new interpreter to import torch and transformers (5-6 s
    of a 6 s load of the test Llama on this host, 0.2-0.3 s from a spare; 0.05 s in process).
    Started once an engine is warm (and by `prestart`, for the first load), so an executor
    that serves no causal LM starts none and no spare imports beside a load; it exits with
    the executor (its pipe's other end closes)."""

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
                self._child = launch()


SPARE = Spare()


def prestart() -> None:
    """Starts the spare now (if there is none): `executor serve` calls it before its own
    imports when it will load a causal LM, so its first load takes a child whose imports ran
    beside the executor's."""
    SPARE.keep()
