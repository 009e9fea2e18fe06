"""The usage spool's disk: segment files, their bound, and the dead-letter file.

A segment is one batch (a RecordUsageRequest, or one AppendAuditRequest) metering has not
acknowledged yet, written to a temporary name, fsynced, renamed, and the directory fsynced, so
a crash leaves either the whole segment or none. The store keeps the list of its segments in
memory (this router owns its directory: no listing per flush), in name order, which is the
order they were written. It refuses a segment that would pass `max_bytes`, or one the disk
refuses, with SpoolWriteFailed and nothing left on disk. An event metering refuses for good
is appended to `dead-letter.jsonl` with the reason, for an operator; lines the disk refuses
are kept in memory and written later. The store holds the disk's reserve (`spool_reserve`):
a write the disk refuses frees it and turns the spool to refusing new requests, and while
refusing no segment is written, so the freed room goes to the journal of the requests in
flight. `spool.Spool` decides what goes where and when.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import json_format

from services.router.spool_reserve import DiskReserve
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb

log = logging.getLogger(__name__)

DEAD_LETTER = "dead-letter.jsonl"


@dataclass
class DiskStats:
    """What the disk refused: events kept in the dead-letter file, segments not written."""

    dead_events: int = 0
    write_failures: int = 0
    refused_requests: int = 0  # new metered requests refused while the disk had no room


@dataclass
class SpoolStats(DiskStats):
    """The spool's counters (Prometheus reads them: `router_metrics`): usage events sent to
    metering at once, written to disk while it was down, and sent from disk later."""

    sent_events: int = 0
    spooled_events: int = 0
    replayed_events: int = 0
    audits_sent: int = 0


class SpoolWriteFailed(Exception):
    """A segment could not be written (disk full, file-size limit, the spool's bound)."""


class SegmentStore:
    def __init__(
        self, directory: Path, max_bytes: int, alarm_fraction: float, stats: DiskStats, reserve_bytes: int
    ) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.reserve = DiskReserve(directory, reserve_bytes)
        for stale in directory.glob("*.tmp"):  # a write cut short by a crash: never acknowledged
            stale.unlink()
        self.segments: list[Path] = sorted(directory.glob("*.pb"))
        self._sizes = {p: p.stat().st_size for p in self.segments}
        self.bytes = sum(self._sizes.values())
        self.max_bytes = max_bytes
        self.alarm_bytes = int(max_bytes * alarm_fraction)
        self.write_error = ""  # why the last write failed; "" once one succeeds again
        self.pressure = False  # as last reported (`pressure_changed`)
        self._stats = stats
        self._dead_pending: list[str] = []  # dead-letter lines the disk refused, written later
        self._seq = 0

    @property
    def high(self) -> bool:
        """Near its bound or refused by the disk."""
        return bool(self.write_error or self.reserve.refusing) or self.bytes >= self.alarm_bytes

    def restore(self) -> None:
        """Refusing: take requests again once the disk has room and the spool is under its alarm."""
        if self.bytes < self.alarm_bytes and self.reserve.restore():
            self.write_error = ""

    def pressure_changed(self, closing: bool) -> bool | None:
        """The pressure, when it changed since the last call (None: unchanged); a spool that
        refuses requests first checks whether the disk has room again (not while stopping:
        a stop ends once the disk refused, and the journal keeps the rest)."""
        if not closing:
            self.restore()
        if self.high == self.pressure:
            return None
        self.pressure = self.high
        self._log_pressure(self.pressure)
        return self.pressure

    def _log_pressure(self, high: bool) -> None:
        if high:
            log.error(
                "ALARM: usage spool under pressure (%d of %d bytes on disk%s); readiness NOT_SERVING",
                self.bytes,
                self.max_bytes,
                f"; {self.write_error}" if self.write_error else "",
            )
        else:
            log.warning("usage spool drained to %d bytes; readiness SERVING again", self.bytes)

    async def write(self, kind: str, data: bytes) -> None:
        """Write one segment durably, or raise SpoolWriteFailed with nothing left on disk."""
        if self.reserve.refusing:  # the disk's room is the journal's now
            self._failed(self.reserve.refusing)
        if self.bytes + len(data) > self.max_bytes:
            self._failed(f"the spool is full ({self.bytes} of {self.max_bytes} bytes)")
        self._seq += 1
        name = f"{kind}-{time.time_ns():020d}-{os.getpid()}-{self._seq:06d}.pb"
        path = self.directory / name
        try:
            await asyncio.to_thread(_durable_write, path, data)
        except OSError as exc:
            self._failed(f"cannot write {path.name}: {exc.strerror or exc}")
        if self.write_error:
            log.warning("the usage spool can write again (%s before)", self.write_error)
            self.write_error = ""
        bisect.insort(self.segments, path)
        self._sizes[path] = len(data)
        self.bytes += len(data)

    def _failed(self, why: str) -> None:
        self._stats.write_failures += 1
        if why != self.write_error:
            log.error("ALARM: usage spool write refused (%s); keeping the batch in memory", why)
        self.write_error = why
        self.reserve.release(why)
        raise SpoolWriteFailed(why)

    def forget(self, path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self.segments.remove(path)
        self.bytes -= self._sizes.pop(path, 0)

    def dead_letter(self, message: mpb.UsageEvent | mpb.AppendAuditRequest, reason: str) -> bool:
        """Keep a refused event for an operator; False if the disk refused (kept in memory)."""
        self._stats.dead_events += 1
        record = json.dumps({"reason": reason, "event": json_format.MessageToDict(message)})
        log.error("metering refused an event for good (%s); kept in %s", reason, DEAD_LETTER)
        self._dead_pending.append(record)
        return self.write_dead_pending()

    def write_dead_pending(self) -> bool:
        if not self._dead_pending:
            return True
        try:
            with (self.directory / DEAD_LETTER).open("a") as f:
                f.write("".join(line + "\n" for line in self._dead_pending))
        except OSError as exc:
            log.error("cannot write %s (%s); dead letters kept in memory", DEAD_LETTER, exc.strerror)
            return False
        self._dead_pending.clear()
        return True


def _durable_write(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()  # never leave a half-written segment behind
        raise
    tmp.rename(path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself must survive a crash
    finally:
        os.close(fd)
