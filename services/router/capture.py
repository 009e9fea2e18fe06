"""Workload capture: a share of a route's requests written to disk for replay in trials.

Opt-in per route (`[routes.X.capture] share, max_mb, retention`). On the hot path a sampled
request's bytes are appended to a bounded in-memory queue and nothing else; when the queue is
full the request is not captured (counted in `dropped`): capture never makes serving wait.
A writer task drains the queue on a thread: it keeps only the input tensors (name, datatype,
shape, raw bytes; never the caller's identity, request id or parameters; a generation adds the
output length the router saw, `output_tokens_seen`) and appends them as
length-prefixed ModelInferRequests to the route's current segment file. A segment closes when
it reaches its size (max_mb / 4) or the router stops; its sha256 then goes into the route's
`manifest.json`, and each closed segment is one workload, `<route>.<time-ordered id>`, immutable
from then on. Segments beyond `max_mb` in total or older than `retention` seconds are deleted,
oldest first. Folders are created 0700 and files 0600: captured inputs may be sensitive.
The file format, and its reading for replay, is the judge library's
(switchyard/judge/capture_format.py), so that trials read workloads without this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.router import ids, wire, wire_write
from switchyard.errors import InvalidArgument
from switchyard.judge.capture_format import (
    PARTIAL_SUFFIX,
    RECORD_SUFFIX,
    SEEN,
    frame,
    read_manifest,
    write_manifest,
)
from switchyard.models.manifest import file_sha256

log = logging.getLogger(__name__)
FLUSH_S = 0.25  # how often the writer takes what was sampled


@dataclass(frozen=True)
class CaptureSpec:
    share: float
    max_mb: int = 64
    retention_s: float = 7 * 24 * 3600.0
    max_pending: int = 256  # sampled requests waiting for the writer; beyond that, dropped


def parse_capture(raw: Any, where: str) -> CaptureSpec:
    if not isinstance(raw, dict):
        raise InvalidArgument(f"{where}.capture must be a table (share, max_mb, retention)")
    unknown = set(raw) - {"share", "max_mb", "retention", "max_pending"}
    if unknown:
        raise InvalidArgument(
            f"{where}.capture: unknown keys {sorted(unknown)}; allowed: share, max_mb, retention"
        )
    try:
        spec = CaptureSpec(
            share=float(raw.get("share", 0.0)),
            max_mb=int(raw.get("max_mb", 64)),
            retention_s=float(raw.get("retention", 7 * 24 * 3600)),
            max_pending=int(raw.get("max_pending", 256)),
        )
    except (TypeError, ValueError):
        raise InvalidArgument(f"{where}.capture: share, retention are numbers, max_mb an integer") from None
    if not 0.0 < spec.share <= 1.0:
        raise InvalidArgument(f"{where}.capture.share must be within (0, 1], got {spec.share}")
    if not 1 <= spec.max_mb <= 1 << 20:
        raise InvalidArgument(f"{where}.capture.max_mb must be 1..1048576 (MiB), got {spec.max_mb}")
    if spec.retention_s <= 0:
        raise InvalidArgument(f"{where}.capture.retention must be > 0 seconds, got {spec.retention_s}")
    if spec.max_pending < 1:
        raise InvalidArgument(f"{where}.capture.max_pending must be >= 1")
    return spec


_KEPT = (1, 2, 5, 7)  # ModelInferRequest: model_name, model_version, inputs, raw_input_contents


def inputs_only(raw: bytes) -> bytes:
    """The request reduced to model, version and input tensors, by walking the wire format
    (no decode of the tensor bytes): id (3), parameters (4) and requested outputs (6) go."""
    found = wire.scan_fields(raw, frozenset(_KEPT))
    view = memoryview(raw)
    parts: list[bytes | memoryview] = []
    for number in _KEPT:
        for start, end in found.get(number, ()):
            key, length = wire_write.encode_varint(number << 3 | 2), wire_write.encode_varint(end - start)
            parts += [key, length, view[start:end]]
    return b"".join(parts)


@dataclass
class CaptureStats:
    sampled: int = 0
    written: int = 0
    dropped: int = 0  # sampled while the queue was full: not captured, serving not delayed


@dataclass
class Capturer:
    route: str
    spec: CaptureSpec
    folder: Path
    rng: random.Random = field(default_factory=random.Random)
    stats: CaptureStats = field(default_factory=CaptureStats)

    def __post_init__(self) -> None:
        self.queue: deque[bytes | tuple[bytes, int]] = deque()
        self.wake = asyncio.Event()
        self.segment_bytes = max(64 * 1024, self.spec.max_mb * (1 << 20) // 4)
        self._file: Any = None
        self._current: dict[str, Any] = {}
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.paused = False  # tests: a writer that has fallen behind
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)

    # ---- hot path -------------------------------------------------------------------------
    def offer(self, raw: bytes, output_tokens: int | None = None) -> None:
        """A served request, sampled at the route's share; a generation also gives the output
        length it saw (kept as the record's only parameter, `output_tokens_seen`)."""
        if self.rng.random() >= self.spec.share:
            return
        self.stats.sampled += 1
        if len(self.queue) >= self.spec.max_pending:
            self.stats.dropped += 1
            return
        self.queue.append(raw if output_tokens is None else (raw, output_tokens))

    # ---- writer -----------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"capture-{self.route}")

    async def _run(self) -> None:
        """Drains every FLUSH_S: one thread hand-off per interval, not one per request."""
        while not self._closing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), FLUSH_S)
            self.wake.clear()
            await self._drain()

    async def _drain(self) -> None:
        if self.paused and not self._closing:
            return
        batch = []
        while self.queue:
            batch.append(self.queue.popleft())
        if batch:
            try:
                await asyncio.to_thread(self._write, batch)
            except Exception as exc:  # a full disk must not take serving down: log, drop
                self.stats.dropped += len(batch)
                log.warning(
                    "capture of route %s: writing failed, %d request(s) dropped: %s",
                    self.route,
                    len(batch),
                    exc,
                )

    def _write(self, batch: list[bytes | tuple[bytes, int]]) -> None:
        for item in batch:
            raw, seen = item if isinstance(item, tuple) else (item, None)
            try:
                record = inputs_only(raw)
            except Exception:  # not a request the router would have served
                continue
            if seen is not None:  # the router's own count, not the caller's parameters
                record += wire_write.parameters_field({SEEN: seen})
            if self._file is None:
                self._open()
            framed = frame(record)
            self._file.write(framed)
            self._current["requests"] += 1
            self._current["bytes"] += len(framed)
            self.stats.written += 1
            if self._current["bytes"] >= self.segment_bytes:
                self._close_segment()
        if self._file is not None:
            self._file.flush()

    def _open(self) -> None:
        workload = f"{self.route}.{ids.time_ordered_hex()[:16]}"
        path = self.folder / f"{workload}{PARTIAL_SUFFIX}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        self._file = os.fdopen(fd, "wb")
        self._current = {"id": workload, "requests": 0, "bytes": 0, "started_unix_s": time.time()}

    def _close_segment(self) -> None:
        if self._file is None:
            return
        self._file.close()
        self._file = None
        entry = dict(self._current)
        partial = self.folder / f"{entry['id']}{PARTIAL_SUFFIX}"
        final = self.folder / f"{entry['id']}{RECORD_SUFFIX}"
        entry["sha256"] = file_sha256(partial)
        entry["closed_unix_s"] = time.time()
        entry["file"] = final.name
        partial.rename(final)
        manifest = read_manifest(self.folder)
        manifest["workloads"].append(entry)
        self._retain(manifest)
        write_manifest(self.folder, manifest)

    def _retain(self, manifest: dict[str, Any]) -> None:
        now = time.time()
        kept: list[dict[str, Any]] = []
        total = 0
        for entry in reversed(manifest["workloads"]):  # newest first
            fresh = now - float(entry["closed_unix_s"]) <= self.spec.retention_s
            if fresh and total + int(entry["bytes"]) <= self.spec.max_mb * (1 << 20):
                kept.append(entry)
                total += int(entry["bytes"])
            else:
                (self.folder / entry["file"]).unlink(missing_ok=True)
        manifest["workloads"] = list(reversed(kept))

    async def close(self) -> None:
        self._closing = True
        self.wake.set()
        if self._task is not None:
            await self._task
        await self._drain()
        await asyncio.to_thread(self._close_segment)
