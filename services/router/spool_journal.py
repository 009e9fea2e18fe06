"""The usage journal: every usage event on disk before the router answers the request.

The spool sends events to metering in batches every `usage_flush_s`; until then they were only
in memory, and a router killed in between lost usage it had already answered (issue 33: 60 of
8,617 answers after a SIGKILL). The journal closes that window: `append` adds an event's bytes
to a buffer, and `commit` writes the buffer, one write for every request waiting at that moment
(group commit). The router awaits `commit` before it sends the answer. By default the write
goes to the operating system, inline: that survives the router's process dying (SIGKILL, OOM),
the fault measured, for a few microseconds. With `sync` it is also fdatasynced, in a thread, so
it survives the host losing power too, at one disk flush per commit (about 0.65 ms here at one
request in flight: `python -m benchmarks.bench_usage_journal`).

Each flush of the spool `rotate`s the journal: the file that holds the events the flush took is
closed and retired, and deleted once the flush left every one of them either acknowledged by
metering or in a segment on disk (`release`). A router that starts reads the journal files an
earlier run left and hands their events back to the spool; usage is idempotent by key, so an
event that had also been delivered or spooled is stored once.

Records are a 4-byte little-endian length and a serialized UsageEvent; a record cut short by a
crash (never committed, so never answered) ends the file's reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
import time
from pathlib import Path
from typing import BinaryIO

from google.protobuf.message import DecodeError

from switchyard.gen.switchyard.v1 import metering_pb2 as mpb

log = logging.getLogger(__name__)

_LEN = struct.Struct("<I")


class UsageJournal:
    def __init__(self, directory: Path, sync: bool = False) -> None:
        self.directory = directory
        self.sync = sync
        directory.mkdir(parents=True, exist_ok=True)
        self.retired: list[Path] = sorted(directory.glob("journal-*.log"))  # an earlier run's
        self._seq = 0
        self._path, self._file = self._open()
        self._size = 0  # bytes written to the open file (a new one), not an fstat per commit
        self._buffer = bytearray()
        self._records = 0  # records in the open file (buffered or written)
        self._appended = 0
        self._durable = 0
        self._lock = asyncio.Lock()
        self.commits = 0  # writes done: with `appended`, how well commits are grouped

    def _open(self) -> tuple[Path, BinaryIO]:
        self._seq += 1
        path = self.directory / f"journal-{time.time_ns():020d}-{os.getpid()}-{self._seq:06d}.log"
        return path, path.open("ab", buffering=0)

    def recover(self) -> list[mpb.UsageEvent]:
        """The events in the journal files an earlier run left (they stay retired until released)."""
        events: list[mpb.UsageEvent] = []
        for path in self.retired:
            events.extend(_read(path))
        if events:
            log.warning("recovered %d usage events from %d journal files", len(events), len(self.retired))
        return events

    def append(self, event: mpb.UsageEvent) -> None:
        data = event.SerializeToString()
        self._buffer += _LEN.pack(len(data))
        self._buffer += data
        self._records += 1
        self._appended += 1

    async def commit(self) -> None:
        """Returns once every event appended before the call is written (and fdatasynced with
        `sync`)."""
        target = self._appended
        if self._durable >= target:
            return
        async with self._lock:
            if self._durable >= target:  # a commit while we waited took ours too
                return
            await self._write_buffer()

    async def _write_buffer(self) -> None:
        data, upto = bytes(self._buffer), self._appended
        self._buffer.clear()
        if data:
            try:
                if self.sync:
                    await asyncio.to_thread(_write, self._file, self._size, data, True)
                else:  # a write of a few hundred bytes to the page cache: not worth a thread hop
                    _write(self._file, self._size, data, False)
            except OSError:
                self._buffer[:0] = data  # kept for the next commit; the file was cut back
                raise
            self._size += len(data)
            self.commits += 1
        self._durable = max(self._durable, upto)

    async def rotate(self) -> bool:
        """Close the current file (all it holds now durable) and open a new one; a file with no
        records is kept open. False if the disk refused (nothing rotated: release nothing)."""
        if self._records == 0:
            return True
        async with self._lock:
            try:
                await self._write_buffer()
            except OSError as exc:
                log.error("cannot write the usage journal (%s); its events stay in memory", exc.strerror)
                return False
            self._file.close()
            self.retired.append(self._path)
            self._path, self._file = self._open()
            self._records, self._size = 0, 0
        return True

    def release(self, upto: int) -> None:
        """Delete the first `upto` retired files: their events are with metering or in segments."""
        done, self.retired = self.retired[:upto], self.retired[upto:]
        for path in done:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    @property
    def unwritten(self) -> int:
        """Events appended and not yet written (a write the disk refused keeps them buffered)."""
        return self._appended - self._durable

    async def close(self) -> None:
        """The buffer written (the stop's last chance: a record not written is lost), then closed."""
        async with self._lock:
            try:
                await self._write_buffer()
            except OSError as exc:
                log.error("stopping: %d usage journal bytes not written (%s); lost", len(self._buffer), exc)
        self._file.close()
        if self._records == 0:
            with contextlib.suppress(FileNotFoundError):
                self._path.unlink()


def _write(file: BinaryIO, start: int, data: bytes, sync: bool) -> None:
    """Append (and fdatasync); on a refusal (disk full) the file is cut back to `start`, its
    size before."""
    try:
        view = memoryview(data)
        while view:
            view = view[file.write(view) or 0 :]
        if sync:
            os.fdatasync(file.fileno())
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(file.fileno(), start)
        raise


def _read(path: Path) -> list[mpb.UsageEvent]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        log.error("cannot read usage journal %s (%s)", path.name, exc.strerror)
        return []
    events: list[mpb.UsageEvent] = []
    at = 0
    while at + _LEN.size <= len(data):
        (size,) = _LEN.unpack_from(data, at)
        if at + _LEN.size + size > len(data):
            break  # cut short by a crash: never committed, never answered
        try:
            events.append(mpb.UsageEvent.FromString(data[at + _LEN.size : at + _LEN.size + size]))
        except DecodeError:
            log.error("usage journal %s has an unreadable record at byte %d; reading stops", path.name, at)
            break
        at += _LEN.size + size
    return events
