"""The ledger's transactions: the engines, the audit key, the clock and the integrity watch
that every ledger operation shares, and the one way to run a read or a write with them.

A write runs in one transaction together with its audit row, so a call is all or nothing.
PostgreSQL may refuse a transaction that raced another writer (a unique key taken meanwhile,
a serialisation failure): the call is retried from the start, where it then sees the other
writer's rows (a duplicate batch becomes "duplicates", not an error).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

from services.metering import audit, integrity
from services.metering.db import Engines, Reach

T = TypeVar("T")
RETRIES = 5


def now_us() -> int:
    return time.time_ns() // 1000


class Transactions:
    """Reads and writes against the ledger's engines, each with the audit key bound; safe to
    share between threads. Owned by the Ledger and shared by its parts."""

    def __init__(self, engines: Engines, audit_key: bytes, clock: Callable[[], int] = now_us) -> None:
        self.engines = engines
        self.audit_key = audit_key
        self.clock = clock
        self.watch = integrity.Watch()  # a broken chain stops the writes (integrity.py)
        self.reach = Reach()  # a lost database connection: UNAVAILABLE, logged once per outage

    def write(self, fn: Callable[[Connection, int], T]) -> T:
        """Run `fn` in one write transaction, retrying when it lost a race with another writer."""
        self.watch.check_writable()
        for attempt in range(RETRIES):
            try:
                with self.reach.guard(), self.engines.write.begin() as conn:
                    audit.bind_key(conn, self.audit_key)
                    return fn(conn, self.clock())
            except (IntegrityError, OperationalError) as exc:
                if attempt == RETRIES - 1 or not _retryable(exc):
                    raise
                time.sleep(0.01 * (attempt + 1))
        raise AssertionError("unreachable")

    def read(self, fn: Callable[[Connection], T]) -> T:
        with self.reach.guard(), self.engines.read.connect() as conn:
            audit.bind_key(conn, self.audit_key)  # row MACs are checked on reads (rowmac.py)
            return fn(conn)


def _retryable(exc: DBAPIError) -> bool:
    """Races that a fresh attempt resolves: a key taken meanwhile, serialisation, a busy SQLite."""
    if isinstance(exc, IntegrityError):
        return True
    code = getattr(exc.orig, "sqlstate", None)
    return code in ("40001", "40P01") or "database is locked" in str(exc.orig)
