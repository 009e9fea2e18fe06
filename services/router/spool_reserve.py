"""Room kept on the spool's disk for the requests already accepted when the disk fills.

The router answers a request only once its usage is in the journal on disk (`spool_journal`).
On a full disk that write fails after the executor has answered, and the request can then be
neither answered (its usage is not durable) nor left out of the ledger (the work was done).
So the spool keeps a reserve: a file of `size` bytes, allocated in its directory at start.
The first write the disk refuses (the journal's or a segment's) deletes it, which frees that
room for the journal writes of the requests in flight, and turns the spool to refusing: the
router refuses new metered requests with RESOURCE_EXHAUSTED naming the spool, before it
forwards them, and writes no segment (what metering cannot take stays in memory, bounded by
what was accepted before, and in the journal). Every flush checks the disk again: once it has
twice `size` free (and at least `MIN_FREE`), the reserve is allocated again and the router
takes requests again. A stop frees it too, so the final flush has room for what metering
cannot take.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

NAME = "reserve.bin"
DEFAULT_SIZE = 1 << 20  # ~6,000 journal records: more than any router has in flight
MIN_FREE = 64 << 10  # what the disk must have free before the spool takes requests again


def free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


class DiskReserve:
    def __init__(self, directory: Path, size: int) -> None:
        self.directory = directory
        self.path = directory / NAME
        self.size = max(0, size)
        self.refusing = ""  # why new metered requests are refused ("" while they are taken)
        self._held = False
        if not self._allocate():
            self.refusing = f"less than {self.size} bytes free on the disk under {directory}"
            log.error("ALARM: usage spool %s: %s; refusing new metered requests", directory, self.refusing)

    def _allocate(self) -> bool:
        if self._held or self.size == 0:
            self._held = True
            return True
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.size)
            finally:
                os.close(fd)
        except OSError:
            with contextlib.suppress(OSError):
                self.path.unlink()
            return False
        self._held = True
        return True

    @property
    def refusal(self) -> str:
        """The message new metered requests are refused with ("" while they are taken)."""
        if not self.refusing:
            return ""
        why = self.refusing
        return f"the router's usage spool {self.directory} has no room ({why}); retry later or elsewhere"

    def release(self, why: str) -> bool:
        """A write was refused: refuse new requests, and free the reserve's room for those in
        flight. False if it was already free (nothing more to give)."""
        if not self.refusing:
            self.refusing = why
            log.error(
                "ALARM: usage spool %s: %s; refusing new metered requests (RESOURCE_EXHAUSTED) until "
                "the disk has room; its reserve of %d bytes is freed for the requests in flight",
                self.directory,
                why,
                self.size,
            )
        if not self._held:
            return False
        self._free()
        return True

    def restore(self) -> bool:
        """While refusing: the reserve allocated again once the disk has twice its size free.
        True if the spool takes requests again."""
        if not self.refusing:
            return False
        free = free_bytes(self.directory)
        if free < max(2 * self.size, MIN_FREE) or not self._allocate():
            return False
        log.warning(
            "usage spool %s has room again (%d bytes free; was: %s); serving metered requests again",
            self.directory,
            free,
            self.refusing,
        )
        self.refusing = ""
        return True

    def close(self) -> None:
        """Stopping: the room is the final flush's (no new request comes any more)."""
        self._free()
        self.refusing = ""

    def _free(self) -> None:
        self._held = False
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
