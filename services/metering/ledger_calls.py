"""The Ledger's calls from the event loop: writes on one thread (in-process writers queue here
rather than contend for SQLite's lock; batching gives the throughput), reads on a small pool so
reports never wait behind a write. The call's context (its trace span) goes along into the
worker thread.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from services.metering.authorize import Authorizer
from services.metering.ledger import Ledger
from services.metering.metering_metrics import MeteringStats

T = TypeVar("T")


class LedgerCalls:
    """The ledger, its authorizer, and the threads their calls run on; the base of metering's
    servicer parts."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.stats = (
            MeteringStats()
        )  # read by the Prometheus collector (services/metering/metering_metrics.py)
        self.authorizer = Authorizer(ledger)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ledger-write")
        self._readers = ThreadPoolExecutor(4, thread_name_prefix="ledger-read")

    def write_queue_depth(self) -> int:
        return self._writer._work_queue.qsize()  # calls waiting behind the one being written

    def shutdown(self) -> None:
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)

    # The call's context (its trace span) goes along into the worker thread; a lost database
    # connection becomes UNAVAILABLE there (db.Reach), for the reports that read directly too.
    async def _w(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(
            self._writer, contextvars.copy_context().run, self._reaching, fn
        )

    async def _r(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(
            self._readers, contextvars.copy_context().run, self._reaching, fn
        )

    def _reaching(self, fn: Callable[[], T]) -> T:
        with self.ledger.tx.reach.guard():
            return fn()
