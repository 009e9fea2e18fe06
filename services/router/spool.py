"""Usage and audit events, sent to metering in batches, spooled durably on disk while it is down.

Events collect in memory and a flusher sends them every `usage_flush_s` (or sooner when a
batch fills). When metering cannot be reached the batch is written to a segment file
(written to a temporary name, fsynced, renamed), later batches go straight to disk, and the
oldest segments are replayed with back-off until metering takes them; a segment is deleted
only after metering acknowledged it. Usage is idempotent by key (the router's request id),
so a replay after an acknowledgement that got lost stores nothing twice. A batch metering
refuses as a whole is retried event by event, and an event refused on its own is kept in
`dead-letter.jsonl` for an operator rather than lost or retried forever.

What is at risk on a crash: events of the last flush interval not yet sent nor spooled.
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
from typing import Protocol

from google.protobuf import json_format

from switchyard.errors import DeadlineExceeded, FailedPrecondition, NotFound, SwitchyardError, Unavailable
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 2.0


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


_DOWN = (Unavailable, DeadlineExceeded, TimeoutError, ConnectionError)
_LATER = (NotFound, FailedPrecondition)


class Spool:
    def __init__(self, sink: MeteringSink, directory: Path, flush_s: float, batch: int) -> None:
        self._sink = sink
        self._dir = directory
        self._dir.mkdir(parents=True, exist_ok=True)
        # segments on disk, kept in memory (this router owns its directory): no listing per flush
        self._on_disk: list[Path] = sorted(self._dir.glob("*.pb"))
        self._flush_s = flush_s
        self._batch = batch
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
            except Exception:  # the flusher must survive anything; events are on disk or in memory
                log.exception("usage flusher error; retrying")
                await asyncio.sleep(0.2)
            if self._closing and not self._usage and not self._audit:
                return

    async def _flush_once(self) -> None:
        self._busy = True  # a batch taken out of memory is pending until sent or on disk
        try:
            await self._flush_taken()
        finally:
            self._busy = False

    async def _flush_taken(self) -> None:
        usage, self._usage = self._usage, []
        audits, self._audit = self._audit, []
        if usage:
            request = mpb.RecordUsageRequest(events=usage)
            if self._on_disk:  # metering is down: keep order, do not wait on a timeout
                await self._write_segment("usage", request.SerializeToString())
                self.stats.spooled_events += len(usage)
            else:
                await self._send_or_spool(request)
        for audit in audits:
            try:
                await self._sink.append_audit(audit)
                self.stats.audits_sent += 1
            except _DOWN:
                await self._write_segment("audit", audit.SerializeToString())
            except SwitchyardError as exc:
                self._dead_letter(audit, str(exc))

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
            await self._write_segment("usage", mpb.RecordUsageRequest(events=later).SerializeToString())
            self._next_replay = time.monotonic() + MAX_BACKOFF_S

    async def _replay(self) -> None:
        now = time.monotonic()
        if not self._on_disk or now < self._next_replay:
            return
        for path in self._on_disk[:8]:  # a copy: replayed segments leave the list
            data = await asyncio.to_thread(path.read_bytes)
            try:
                if path.name.startswith("audit"):
                    await self._sink.append_audit(mpb.AppendAuditRequest.FromString(data))
                else:
                    request = mpb.RecordUsageRequest.FromString(data)
                    await self._deliver(request)
                    self.stats.replayed_events += len(request.events)
            except _DOWN:
                self._backoff = min(MAX_BACKOFF_S, max(0.1, self._backoff * 2))
                self._next_replay = time.monotonic() + self._backoff
                return
            path.unlink()
            self._on_disk.remove(path)
        self._backoff = 0.0
        if self._on_disk:
            self._wake.set()

    # ---- disk ---------------------------------------------------------------------------------
    async def _write_segment(self, kind: str, data: bytes) -> None:
        self._seq += 1
        name = f"{kind}-{time.time_ns():020d}-{os.getpid()}-{self._seq:06d}.pb"
        path = self._dir / name
        await asyncio.to_thread(_durable_write, path, data)
        bisect.insort(self._on_disk, path)

    def _dead_letter(self, message: mpb.UsageEvent | mpb.AppendAuditRequest, reason: str) -> None:
        self.stats.dead_events += 1
        record = {"reason": reason, "event": json_format.MessageToDict(message)}
        log.error("metering refused an event for good (%s); kept in dead-letter.jsonl", reason)
        with (self._dir / "dead-letter.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")


def _durable_write(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself must survive a crash
    finally:
        os.close(fd)
