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
routers); when it has drained below that again, `set_ready(True)`. A write the disk refuses
also frees the disk's reserve and turns the spool to `refusing` (`spool_reserve`): the router
refuses new metered requests, the requests in flight journal their usage into the freed room,
and what metering cannot take stays in memory (bounded: nothing new is accepted) until the
disk has room again.

Nothing answered is at risk on a crash: every usage event is also appended to the usage
journal (`spool_journal`), and the router awaits `durable()` (the journal's group commit)
before it answers. A flush rotates the journal; the retired files are deleted once a flush left
nothing in memory, and a restarted router replays what an earlier run's journal holds. So a
stop that can neither deliver nor spool an event leaves it in the journal for the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from google.protobuf.message import DecodeError

from services.router.spool_delivery import DOWN, MeteringDelivery, MeteringSink
from services.router.spool_journal import UsageJournal
from services.router.spool_reserve import DEFAULT_SIZE, DiskReserve
from services.router.spool_segments import SegmentStore, SpoolStats, SpoolWriteFailed
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 2.0
DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_ALARM_FRACTION = 0.8


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
        journal_sync: bool = False,
        reserve_bytes: int = DEFAULT_SIZE,
    ) -> None:
        self._sink = sink
        self.stats = SpoolStats()
        self._disk = SegmentStore(directory, max_bytes, alarm_fraction, self.stats, reserve_bytes)
        self._delivery = MeteringDelivery(sink, self._disk, self.stats)
        self.set_ready = set_ready
        self._flush_s = flush_s
        self._batch = max(1, batch)
        self._usage: list[mpb.UsageEvent] = []
        self._audit: list[mpb.AppendAuditRequest] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._backoff = 0.0
        self._next_replay = 0.0
        self._task: asyncio.Task[None] | None = None
        self._busy = False
        self._taken = 0  # events a running flush took out of memory and still holds
        self._journal = UsageJournal(directory, journal_sync)
        self._usage.extend(self._journal.recover())
        self._returned = False  # a flush put events back in memory: keep the journal files

    # ---- producer side (hot path: no I/O) -------------------------------------------------
    def usage(self, event: mpb.UsageEvent) -> None:
        self._usage.append(event)
        self._journal.append(event)
        if len(self._usage) >= self._batch:
            self._wake.set()

    async def durable(self) -> None:
        """Returns once every usage event given so far is on disk (the journal's group commit)."""
        await _commit(self._journal, self._disk.reserve)

    @property
    def refusal(self) -> str:  # why new metered requests are refused ("" while they are taken)
        return self._disk.reserve.refusal

    @property
    def journal_commits(self) -> int:
        return self._journal.commits

    def audit(self, request: mpb.AppendAuditRequest) -> None:
        self._audit.append(request)
        self._wake.set()

    @property
    def backlog(self) -> int:
        """Segments on disk waiting for metering."""
        return len(self._disk.segments)

    @property
    def bytes_on_disk(self) -> int:
        return self._disk.bytes

    @property
    def pending_in_memory(self) -> int:
        """Events only in memory: queued, or taken by a flush not yet sent nor on disk."""
        return len(self._usage) + len(self._audit) + self._taken

    @property
    def under_pressure(self) -> bool:
        """Near its bound or refused by the disk: the router should not take new traffic."""
        return self._disk.pressure

    # ---- flusher ------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="usage-spool")

    async def close(self) -> None:
        """Final flush: send what is in memory, or spool it; segments stay for the next start."""
        self._closing = True
        self._disk.reserve.close()  # its room is the final flush's
        self._wake.set()
        if self._task is not None:
            await self._task

    async def drain(self, timeout_s: float) -> bool:
        """Wait until nothing is pending in memory or on disk (for tests and shutdown)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self._usage and not self._audit and not self._busy and not self._disk.segments:
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
            if self._closing and (not (self._usage or self._audit) or self._disk.write_error):
                await self._journal.close()
                _log_left(len(self._usage), len(self._audit), self._journal.unwritten, self._disk)
                return

    async def _flush_once(self) -> None:
        if self.refusal and not self._closing and time.monotonic() < self._next_replay:
            return  # metering was unreachable a moment ago and the disk has no room: in memory
        self._disk.write_dead_pending()
        rotated = await self._journal.rotate()  # the retired files hold every event taken below
        retired = len(self._journal.retired) if rotated else 0
        self._returned = False
        usage, self._usage = self._usage, []
        audits, self._audit = self._audit, []
        self._busy = True  # a batch taken out of memory is pending until sent or on disk
        self._taken = len(usage) + len(audits)  # what this flush took out of memory and still holds
        try:
            await self._flush_chunks(usage, audits)
            if not self._returned:
                self._journal.release(retired)  # all taken is acknowledged or in a segment
        finally:
            self._busy = False
            self._taken = 0

    async def _flush_chunks(self, usage: list[mpb.UsageEvent], audits: list[mpb.AppendAuditRequest]) -> None:
        done = 0
        try:
            while done < len(usage):
                chunk = mpb.RecordUsageRequest(events=usage[done : done + self._batch])
                if self._disk.segments and not self._closing:  # metering down: keep order, no timeout
                    await self._disk.write("usage", chunk.SerializeToString())
                    self.stats.spooled_events += len(chunk.events)
                else:
                    await self._send_or_spool(chunk)
                done += len(chunk.events)
                self._taken -= len(chunk.events)
        except SpoolWriteFailed:
            self._usage[:0] = usage[done:]  # back in memory, ahead of newer events: nothing lost
            self._returned = True
            self._taken -= len(usage) - done
        for n, audit in enumerate(audits):
            try:
                try:
                    await self._delivery.audit(audit)
                except DOWN:
                    await self._disk.write("audit", audit.SerializeToString())
                self._taken -= 1
            except SpoolWriteFailed:
                self._audit[:0] = audits[n:]
                self._taken -= len(audits) - n
                break

    async def _send_or_spool(self, request: mpb.RecordUsageRequest) -> None:
        try:
            await self._deliver(request)
            self.stats.sent_events += len(request.events)
        except DOWN as exc:
            self._backoff = max(self._backoff, 0.1)  # with no room on disk, the next try in 2 s
            self._next_replay = time.monotonic() + (MAX_BACKOFF_S if self.refusal else self._backoff)
            log.warning("metering unreachable (%s): spooling %d usage events", exc, len(request.events))
            await self._disk.write("usage", request.SerializeToString())
            self.stats.spooled_events += len(request.events)

    async def _deliver(self, request: mpb.RecordUsageRequest) -> None:
        """Sends a batch (`spool_delivery`); what metering cannot take yet is spooled again."""
        later = await self._delivery.usage(request)
        if later:
            try:
                await self._disk.write("usage", mpb.RecordUsageRequest(events=later).SerializeToString())
            except SpoolWriteFailed:
                self._usage[:0] = later  # in memory until the disk takes them
                self._returned = True
            self._next_replay = time.monotonic() + MAX_BACKOFF_S

    async def _replay(self) -> None:
        now = time.monotonic()
        if not self._disk.segments or now < self._next_replay:
            return
        for path in self._disk.segments[:8]:  # a copy: replayed segments leave the list
            try:
                data = await asyncio.to_thread(path.read_bytes)
                if path.name.startswith("audit"):
                    if not await self._delivery.audit(mpb.AppendAuditRequest.FromString(data)):
                        return  # the disk refused the dead letter too: keep the segment
                else:
                    request = mpb.RecordUsageRequest.FromString(data)
                    await self._deliver(request)
                    self.stats.replayed_events += len(request.events)
            except DOWN:
                self._backoff = min(MAX_BACKOFF_S, max(0.1, self._backoff * 2))
                self._next_replay = time.monotonic() + self._backoff
                return
            except (DecodeError, OSError) as exc:  # unreadable: moved aside for an operator
                log.error("spool segment %s is unreadable (%s); moved to %s.bad", path.name, exc, path.name)
                with contextlib.suppress(OSError):
                    path.rename(path.with_name(path.name + ".bad"))
            self._disk.forget(path)
        self._backoff = 0.0
        if self._disk.segments:
            self._wake.set()

    async def _check_pressure(self) -> None:
        high = self._disk.pressure_changed(self._closing)
        if high is not None and self.set_ready is not None:
            await self.set_ready(not high)


async def _commit(journal: UsageJournal, reserve: DiskReserve) -> None:
    """A refused write frees the disk's reserve and is tried once more, in its room."""
    try:
        await journal.commit()
    except OSError as exc:
        if not reserve.release(f"cannot write the usage journal: {exc.strerror or exc}"):
            raise
        await journal.commit()


def _log_left(usage: int, audits: int, unwritten: int, disk: SegmentStore) -> None:
    """A stop that could neither deliver nor spool: the usage is in the journal (every answered
    request's event was written there before its answer, or recovered from it) but for what
    the disk refused even to the journal; audit rows are not journaled."""
    if not usage and not audits:
        return
    log.error(
        "stopping with %d usage events neither metering nor the disk took (%s): %d stay in the "
        "usage journal for the next start on %s, %d were not written to it (lost, unless metering "
        "had them); %d audit events are lost",
        usage,
        disk.write_error,
        max(0, usage - unwritten),
        disk.directory,
        min(usage, unwritten),
        audits,
    )
