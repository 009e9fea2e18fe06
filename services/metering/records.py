"""Domain records of the metering service: what goes in and what comes out, free of gRPC.

The servicer converts protobuf messages to these and back; the domain never sees a message.
Validation that needs no database lives here too, so a bad field fails before any write.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import NamedTuple

from services.metering.metering_errors import BadInput

KINDS = ("request", "trial", "train", "prepare")
JOB_STATUSES = ("completed", "failed", "cancelled")
MAX_KEY = 200
MAX_US = 2**62  # far beyond any real timestamp or duration; keeps products inside int64 checks
MAX_TOKENS = 2**40  # per event; sums over a ledger's lines stay far inside BIGINT


@dataclass(frozen=True)
class Actor:
    principal: str = ""  # the authenticated identity (with mTLS); what the caller said without
    source: str = ""
    request_id: str = ""
    trace_id: str = ""
    on_behalf_of: str = ""  # the principal the caller named, when it is not the one authenticated


class UsageEvent(NamedTuple):
    """One usage event. A named tuple: immutable, and cheap to build from a message (a batch
    builds thousands); its plain-tuple repr is the content the digest covers."""

    idempotency_key: str
    path: str
    model: str = ""
    model_version: str = ""
    team: str = ""
    principal: str = ""
    job_id: str = ""
    kind: str = "request"
    status: str = ""
    met_quality: bool = False
    busy_us: int = 0
    started_us: int = 0
    ended_us: int = 0
    trial_id: str = ""
    arm: str = ""
    tags: tuple[tuple[str, str], ...] = ()
    reservation_id: str = ""
    prompt_tokens: int = 0  # a generation request's tokens (0 for any other usage)
    output_tokens: int = 0

    def content_hash(self) -> str:
        """Digest of every field: the same key must come back with the same digest."""
        # repr() of a tuple of str/int/bool is unambiguous (quotes are escaped) and fast. The
        # plain tuple's repr of all fields in declaration order, as stored digests were made;
        # without tokens, of the fields before them, so an event stored before tokens were
        # metered (migration 0005) is still a duplicate of itself when it is retried.
        fields = self if self.prompt_tokens or self.output_tokens else self[:_UNTOKENED]
        return hashlib.sha256(tuple.__repr__(fields).encode()).hexdigest()

    @property
    def effective_job_id(self) -> str | None:
        """The job this usage belongs to; preparation is charged to the path, not to a job."""
        if self.kind == "prepare":
            return self.job_id or None
        return self.job_id or self.idempotency_key


_UNTOKENED = UsageEvent._fields.index("prompt_tokens")


def check_key(value: str, what: str) -> None:
    if not value:
        raise BadInput(f"{what} is empty; give a durable id (request id, or workflow run id + activity id)")
    if len(value) > MAX_KEY:
        raise BadInput(f"{what} is {len(value)} characters; at most {MAX_KEY}")


def check_time(value: int, what: str) -> None:
    if value < 0:
        raise BadInput(f"{what} is negative ({value}); give microseconds since the Unix epoch")
    if value > MAX_US:
        raise BadInput(f"{what} ({value}) is out of range")


def validate_event(ev: UsageEvent, index: int) -> None:
    """Raise BadInput naming the first bad field. The same checks as `_explain_event`, as one
    expression first: a valid event (the usual case) then costs no message formatting."""
    key, ended, started, busy = ev.idempotency_key, ev.ended_us, ev.started_us, ev.busy_us
    if (
        key
        and len(key) <= MAX_KEY
        and ev.path
        and ev.kind in KINDS
        and (not ev.status or ev.status in JOB_STATUSES)
        and 0 <= busy <= MAX_US
        and 0 <= started <= MAX_US
        and 0 <= ended <= MAX_US
        and (not ended or (started <= ended and busy <= ended - started))
        and (not ev.job_id or len(ev.job_id) <= MAX_KEY)
        and 0 <= ev.prompt_tokens <= MAX_TOKENS
        and 0 <= ev.output_tokens <= MAX_TOKENS
    ):
        return
    _explain_event(ev, index)


def _explain_event(ev: UsageEvent, index: int) -> None:
    where = f"event {index} ({ev.idempotency_key or 'no key'})"
    check_key(ev.idempotency_key, f"{where}: idempotency_key")
    if not ev.path:
        raise BadInput(f"{where}: path is empty; name the accelerator path that did the work")
    if ev.kind not in KINDS:
        raise BadInput(f"{where}: kind {ev.kind!r} is not one of {', '.join(KINDS)}")
    if ev.status and ev.status not in JOB_STATUSES:
        raise BadInput(f"{where}: status {ev.status!r} is not one of {', '.join(JOB_STATUSES)} (or empty)")
    if ev.busy_us < 0:
        raise BadInput(f"{where}: busy_us is negative ({ev.busy_us})")
    check_time(ev.busy_us, f"{where}: busy_us")
    check_time(ev.started_us, f"{where}: started_unix_us")
    check_time(ev.ended_us, f"{where}: ended_unix_us")
    if ev.ended_us and ev.ended_us < ev.started_us:
        raise BadInput(f"{where}: ended_unix_us {ev.ended_us} is before started_unix_us {ev.started_us}")
    if ev.ended_us and ev.busy_us > ev.ended_us - ev.started_us:
        raise BadInput(
            f"{where}: busy_us {ev.busy_us} exceeds the event's duration {ev.ended_us - ev.started_us}"
        )
    if ev.job_id:
        check_key(ev.job_id, f"{where}: job_id")
    for name in ("prompt_tokens", "output_tokens"):
        count = getattr(ev, name)
        if not 0 <= count <= MAX_TOKENS:
            raise BadInput(f"{where}: {name} is {count}; give the request's token count, 0 to {MAX_TOKENS}")


@dataclass(frozen=True)
class UsageResult:
    accepted: int
    duplicates: int
    unpriced: int


@dataclass(frozen=True)
class ReservationInfo:
    reservation_id: str
    path: str
    start_us: int
    end_us: int | None
    state: str
    trial_id: str
    cost_micros: int | None
    idle_micros: int | None
    currency: str | None
    price_version: str


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    path: str
    model: str
    team: str
    status: str
    met_quality: bool
    trial_id: str
    ended_us: int


@dataclass(frozen=True)
class CostLineInfo:
    basis: str
    amount_micros: int | None
    currency: str | None
    price_version: str
    method: str
    quantity_us: int


@dataclass(frozen=True)
class JobCostInfo:
    job: JobInfo
    total_micros: int
    currency: str
    lines: list[CostLineInfo] = field(default_factory=list)
    unpriced: bool = False
