"""The usage spool on a real directory: outage -> segments on disk -> replay, nothing lost or doubled."""

from __future__ import annotations

from pathlib import Path

from services.router.spool import Spool
from switchyard.errors import AlreadyExists, Unavailable
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb


class _Sink:
    """In-memory metering stand-in with metering's idempotency rule (key -> content)."""

    def __init__(self) -> None:
        self.stored: dict[str, bytes] = {}
        self.audits: list[mpb.AppendAuditRequest] = []
        self.down = False

    async def record_usage(self, request: mpb.RecordUsageRequest) -> None:
        if self.down:
            raise Unavailable("connection refused")
        for e in request.events:
            if self.stored.get(e.idempotency_key, e.SerializeToString()) != e.SerializeToString():
                raise AlreadyExists(f"key {e.idempotency_key} stored with other content")
        for e in request.events:
            self.stored[e.idempotency_key] = e.SerializeToString()

    async def append_audit(self, request: mpb.AppendAuditRequest) -> None:
        if self.down:
            raise Unavailable("connection refused")
        self.audits.append(request)


def _segments(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.pb"))


def _read(path: Path) -> str:
    return path.read_text()


def _event(i: int, busy: int = 10) -> mpb.UsageEvent:
    return mpb.UsageEvent(
        idempotency_key=f"req-{i}", path="cpu", model="mlp", status="completed", busy_us=busy
    )


async def test_outage_spools_to_disk_and_replays_exactly_once(tmp_path: Path) -> None:
    sink = _Sink()
    spool = Spool(sink, tmp_path, flush_s=0.01, batch=10)
    spool.start()
    for i in range(25):
        spool.usage(_event(i))
    assert await spool.drain(2.0)
    sink.down = True
    for i in range(25, 60):
        spool.usage(_event(i))
    spool.audit(mpb.AppendAuditRequest(action="request.denied", outcome="denied"))
    assert not await spool.drain(0.3)
    assert spool.backlog > 0 and _segments(tmp_path)  # durable while metering is down
    await spool.close()
    # A new spool (a restarted router) picks up the segments and replays them.
    sink.down = False
    again = Spool(sink, tmp_path, flush_s=0.01, batch=10)
    again.start()
    assert await again.drain(3.0)
    await again.close()
    assert sorted(sink.stored) == sorted(f"req-{i}" for i in range(60))
    assert len(sink.audits) == 1 and not _segments(tmp_path)


async def test_a_refused_event_goes_to_dead_letter_and_the_rest_is_stored(tmp_path: Path) -> None:
    sink = _Sink()
    sink.stored["req-3"] = b"other content"
    spool = Spool(sink, tmp_path, flush_s=0.01, batch=100)
    spool.start()
    for i in range(6):
        spool.usage(_event(i))
    assert await spool.drain(2.0)
    await spool.close()
    assert sorted(sink.stored) == [f"req-{i}" for i in range(6)]
    assert sink.stored["req-3"] == b"other content"
    assert spool.stats.dead_events == 1
    assert "req-3" in _read(tmp_path / "dead-letter.jsonl")
