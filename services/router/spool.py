"""Usage and audit events, sent to metering in batches, spooled durably on disk while it is down.

Events collect in memory and a flusher sends them every `usage_flush_s` (or sooner when a
batch fills). When metering cannot be reached the batch is written to a segment file
(written to a temporary name, fsynced, renamed), later batches go straight to disk, and the
oldest segments are replayed with back-off until metering takes them; a segment is deleted
only after metering acknowledged it. Usage is idempotent by key (the router's request id),
so a replay after an acknowledgement that got lost stores nothing twice. A batch metering
refuses as a whole is retried event by event, and an event refused on its own is kept in
`dead-letter.jsonl` for an operator rather than lost or retried forever. Audit rows are
treated alike: one metering refuses (on delivery or on replay) is dead-lettered, so a
poisoned audit never blocks the segments behind it.

Faults of the disk: a segment that cannot be written (disk full, a file-size limit, an I/O
error) is removed half-written and its batch goes back to memory, to be sent or written at a
later flush; nothing taken out of memory is dropped. Flushes are chunked (at most `batch`
events per RecordUsage, one segment per chunk). The spool is bounded (`max_bytes` on disk):
from `alarm_fraction` of it, or after a failed write, it raises an alarm in the log and
calls `set_ready(False)` (the router reports NOT_SERVING, so traffic moves to other
routers); when it has drained below that again, `set_ready(True)`.

What is at risk on a crash: events of the last flush interval not yet sent nor spooled, and
batches kept in memory while the disk refused them.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from google.protobuf import json_format
from google.protobuf.message import DecodeError

from switchyard.errors import DeadlineExceeded, FailedPrecondition, NotFound, SwitchyardError, Unavailable
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 2.0
DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_ALARM_FRACTION = 0.8
DEAD_LETTER = "dead-letter.jsonl"


class MeteringSink(Protocol):
    async def record_usage(self, request: mpb.RecordUsageRequest) -> None: ...

    async def append_audit(self, request: mpb.AppendAuditRequest) -> None: ...


@dataclass
class SpoolStats:
    sent_events: int = 0
    spooled_events: int = 0
    replayed_events: int = 0
    dead_events: int = 0
    audits_sent: int = 0
    write_failures: int = 0


class SpoolWriteFailed(Exception):
    """A segment could not be written (disk full, file-size limit, the spool's bound)."""


_DOWN = (Unavailable, DeadlineExceeded, TimeoutError, ConnectionError)
_LATER = (NotFound, FailedPrecondition)


class Spool:
    def __init__(
        self,
        sink: MeteringSink,
        directory: Path,
        flush_s: float,
        batch: int,
        max_bytes: int = DEFAULT_MAX_BYTES,
        alarm_fraction: float = DEFAULT_ALARM_FRACTION,
        set_ready: Callable[[bool], Awaitable[None]] | None = None,
    ) -> None:
        self._sink = sink
        self._dir = directory
        self._dir.mkdir(parents=True, exist_ok=True)
        for stale in self._dir.glob("*.tmp"):  # a write cut short by a crash: never acknowledged
            stale.unlink()
        # segments on disk, kept in memory (this router owns its directory): no listing per flush
        self._on_disk: list[Path] = sorted(self._dir.glob("*.pb"))
        self._sizes = {p: p.stat().st_size for p in self._on_disk}
        self._bytes = sum(self._sizes.values())
        self._max_bytes = max_bytes
        self._alarm_bytes = int(max_bytes * alarm_fraction)
        self.set_ready = set_ready
        self._pressure = False
        self._write_error = ""
        self._dead_pending: list[str] = []  # dead-letter lines the disk refused, written later
        self._flush_s = flush_s
        self._batch = max(1, batch)
        self._usage: list[mpb.UsageEvent] = []
        self._audit: list[mpb.AppendAuditRequest] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._seq = 0
        self._backoff = 0.0
        self._next_replay = 0.0
        self.stats = SpoolStats()
        self._task: asyncio.Task[None] | None = None
        self._busy = False
        self._taken = 0  # events a running flush took out of memory and still holds

    # ---- producer side (hot path: no I/O) -------------------------------------------------
    def usage(self, event: mpb.UsageEvent) -> None:
        self._usage.append(event)
        if len(self._usage) >= self._batch:
            self._wake.set()

    def audit(self, request: mpb.AppendAuditRequest) -> None:
        self._audit.append(request)
        self._wake.set()

    @property
    def backlog(self) -> int:
        """Segments on disk waiting for metering."""
        return len(self._on_disk)

    @property
    def bytes_on_disk(self) -> int:
        return self._bytes

    @property
    def pending_in_memory(self) -> int:
        """Events only in memory: queued, or taken by a flush not yet sent nor on disk."""
        return len(self._usage) + len(self._audit) + self._taken

    @property
    def under_pressure(self) -> bool:
        """Near its bound or refused by the disk: the router should not take new traffic."""
        return self._pressure

    # ---- flusher ------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="usage-spool")

    async def close(self) -> None:
        """Final flush: send what is in memory, or spool it; segments stay for the next start."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task

    async def drain(self, timeout_s: float) -> bool:
        """Wait until nothing is pending in memory or on disk (for tests and shutdown)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self._usage and not self._audit and not self._busy and not self._on_disk:
                return True
            self._wake.set()
            await asyncio.sleep(0.05)
        return False

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._flush_s)
            self._wake.clear()
            try:
                await self._flush_once()
                if not self._closing:
                    await self._replay()
                await self._check_pressure()
            except Exception:  # the flusher must survive anything; events are on disk or in memory
                log.exception("usage flusher error; retrying")
                await asyncio.sleep(0.2)
            if self._closing and (not (self._usage or self._audit) or self._write_error):
                if self._usage or self._audit:
                    log.error(
                        "stopping with %d usage and %d audit events the disk refused (%s); they are lost",
                        len(self._usage),
                        len(self._audit),
                        self._write_error,
                    )
                return

    async def _flush_once(self) -> None:
        self._busy = True  # a batch taken out of memory is pending until sent or on disk
        try:
            await self._flush_taken()
        finally:
            self._busy = False
        self._taken = 0  # events a running flush took out of memory and still holds

    async def _flush_taken(self) -> None:
        self._write_dead_pending()
        usage, self._usage = self._usage, []
        audits, self._audit = self._audit, []
        self._taken = len(usage) + len(audits)
        try:
            await self._flush_chunks(usage, audits)
        finally:
            self._taken = 0

    async def _flush_chunks(self, usage: list[mpb.UsageEvent], audits: list[mpb.AppendAuditRequest]) -> None:
        done = 0
        try:
            while done < len(usage):
                chunk = mpb.RecordUsageRequest(events=usage[done : done + self._batch])
                if self._on_disk:  # metering is down: keep order, do not wait on a timeout
                    await self._write_segment("usage", chunk.SerializeToString())
                    self.stats.spooled_events += len(chunk.events)
                else:
                    await self._send_or_spool(chunk)
                done += len(chunk.events)
                self._taken -= len(chunk.events)
        except SpoolWriteFailed:
            self._usage[:0] = usage[done:]  # back in memory, ahead of newer events: nothing lost
            self._taken -= len(usage) - done
        for n, audit in enumerate(audits):
            try:
                try:
                    await self._sink.append_audit(audit)
                    self.stats.audits_sent += 1
                except _DOWN:
                    await self._write_segment("audit", audit.SerializeToString())
                except SwitchyardError as exc:
                    self._dead_letter(audit, str(exc))
                self._taken -= 1
            except SpoolWriteFailed:
                self._audit[:0] = audits[n:]
                self._taken -= len(audits) - n
                break

    async def _send_or_spool(self, request: mpb.RecordUsageRequest) -> None:
        try:
            await self._deliver(request)
            self.stats.sent_events += len(request.events)
        except _DOWN as exc:
            log.warning("metering unreachable (%s): spooling %d usage events", exc, len(request.events))
            await self._write_segment("usage", request.SerializeToString())
            self.stats.spooled_events += len(request.events)
            self._backoff = max(self._backoff, 0.1)
            self._next_replay = time.monotonic() + self._backoff

    async def _deliver(self, request: mpb.RecordUsageRequest) -> None:
        """Send a batch; if metering refuses it as a whole, send event by event.

        An event refused for a reason that can heal (unknown path not registered yet, a
        precondition) is spooled for a later replay; one refused for its content
        (conflicting key, invalid field) goes to the dead-letter file.
        """
        try:
            await self._sink.record_usage(request)
            return
        except _DOWN:
            raise
        except SwitchyardError as exc:
            log.warning("metering refused a usage batch (%s); retrying event by event", exc)
        later: list[mpb.UsageEvent] = []
        for event in request.events:
            try:
                await self._sink.record_usage(mpb.RecordUsageRequest(events=[event], actor=request.actor))
            except _DOWN:
                raise
            except _LATER:
                later.append(event)
            except SwitchyardError as single:
                self._dead_letter(event, str(single))
        if later:
            log.warning("metering cannot take %d events yet (unknown path?); kept in the spool", len(later))
            try:
                await self._write_segment("usage", mpb.RecordUsageRequest(events=later).SerializeToString())
            except SpoolWriteFailed:
                self._usage[:0] = later  # in memory until the disk takes them
            self._next_replay = time.monotonic() + MAX_BACKOFF_S

    async def _replay(self) -> None:
        now = time.monotonic()
        if not self._on_disk or now < self._next_replay:
            return
        for path in self._on_disk[:8]:  # a copy: replayed segments leave the list
            try:
                data = await asyncio.to_thread(path.read_bytes)
                if path.name.startswith("audit"):
                    audit = mpb.AppendAuditRequest.FromString(data)
                    try:
                        await self._sink.append_audit(audit)
                        self.stats.audits_sent += 1
                    except _DOWN:
                        raise
                    except SwitchyardError as exc:  # poisoned: set aside, the rest flows on
                        if not self._dead_letter(audit, str(exc)):
                            return  # the disk refused the dead letter too: keep the segment
                else:
                    request = mpb.RecordUsageRequest.FromString(data)
                    await self._deliver(request)
                    self.stats.replayed_events += len(request.events)
            except _DOWN:
                self._backoff = min(MAX_BACKOFF_S, max(0.1, self._backoff * 2))
                self._next_replay = time.monotonic() + self._backoff
                return
            except (DecodeError, OSError) as exc:  # unreadable: moved aside for an operator
                log.error("spool segment %s is unreadable (%s); moved to %s.bad", path.name, exc, path.name)
                with contextlib.suppress(OSError):
                    path.rename(path.with_name(path.name + ".bad"))
            self._forget(path)
        self._backoff = 0.0
        if self._on_disk:
            self._wake.set()

    # ---- disk ---------------------------------------------------------------------------------
    async def _write_segment(self, kind: str, data: bytes) -> None:
        """Write one segment durably, or raise SpoolWriteFailed with nothing left on disk."""
        if self._bytes + len(data) > self._max_bytes:
            self._write_failed(f"the spool is full ({self._bytes} of {self._max_bytes} bytes)")
        self._seq += 1
        name = f"{kind}-{time.time_ns():020d}-{os.getpid()}-{self._seq:06d}.pb"
        path = self._dir / name
        try:
            await asyncio.to_thread(_durable_write, path, data)
        except OSError as exc:
            self._write_failed(f"cannot write {path.name}: {exc.strerror or exc}")
        if self._write_error:
            log.warning("the usage spool can write again (%s before)", self._write_error)
            self._write_error = ""
        bisect.insort(self._on_disk, path)
        self._sizes[path] = len(data)
        self._bytes += len(data)

    def _write_failed(self, why: str) -> None:
        self.stats.write_failures += 1
        if why != self._write_error:
            log.error("ALARM: usage spool write refused (%s); keeping the batch in memory", why)
        self._write_error = why
        raise SpoolWriteFailed(why)

    def _forget(self, path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self._on_disk.remove(path)
        self._bytes -= self._sizes.pop(path, 0)

    async def _check_pressure(self) -> None:
        high = bool(self._write_error) or self._bytes >= self._alarm_bytes
        if high == self._pressure:
            return
        self._pressure = high
        if high:
            log.error(
                "ALARM: usage spool under pressure (%d of %d bytes on disk%s); readiness NOT_SERVING",
                self._bytes,
                self._max_bytes,
                f"; {self._write_error}" if self._write_error else "",
            )
        else:
            log.warning("usage spool drained to %d bytes; readiness SERVING again", self._bytes)
        if self.set_ready is not None:
            await self.set_ready(not high)

    def _dead_letter(self, message: mpb.UsageEvent | mpb.AppendAuditRequest, reason: str) -> bool:
        """Keep a refused event for an operator; False if the disk refused (kept in memory)."""
        self.stats.dead_events += 1
        record = json.dumps({"reason": reason, "event": json_format.MessageToDict(message)})
        log.error("metering refused an event for good (%s); kept in %s", reason, DEAD_LETTER)
        self._dead_pending.append(record)
        return self._write_dead_pending()

    def _write_dead_pending(self) -> bool:
        if not self._dead_pending:
            return True
        try:
            with (self._dir / DEAD_LETTER).open("a") as f:
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
