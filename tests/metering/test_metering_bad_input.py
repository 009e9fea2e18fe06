"""Every bad input from the issue gets its precise status and a message, and nothing is half-written."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import grpc
import pytest
from sqlalchemy import func, select

from services.metering.metering_server import RunningMetering
from services.metering.schema import AUDIT, JOBS, LINES, RESERVATIONS
from switchyard.gen.switchyard.v1 import metering_pb2 as pb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as pb_grpc
from tests.metering.metering_helpers import HOUR, T0, event, expect_status, setup_path

if TYPE_CHECKING:
    Stub = pb_grpc.MeteringAsyncStub
INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
EXISTS, PRECONDITION = grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION


def good(i: int) -> pb.UsageEvent:
    return event(f"good-{i}", T0 + i, 10)


def usage(*bad: pb.UsageEvent) -> Callable[[Stub], Awaitable[object]]:
    """A batch of valid events with the bad one(s) last: all or nothing."""
    return lambda s: s.RecordUsage(pb.RecordUsageRequest(events=[good(1), good(2), *bad]))


CASES: list[tuple[str, Callable[[Stub], Awaitable[object]], grpc.StatusCode, str]] = [
    ("negative busy time", usage(event("neg", T0, -5)), INVALID, "busy_us is negative"),
    (
        "reversed event times",
        usage(
            pb.UsageEvent(
                idempotency_key="rev", path="cpu-eager@h1", started_unix_us=T0 + 10, ended_unix_us=T0
            )
        ),
        INVALID,
        "before started_unix_us",
    ),
    ("negative start", usage(event("neg-start", -1, 0)), INVALID, "negative"),
    ("busy longer than the event", usage(event("long", T0, 10, ended_unix_us=T0 + 5)), INVALID, "exceeds"),
    ("empty key", usage(event("", T0, 1)), INVALID, "idempotency_key is empty"),
    ("unknown kind", usage(event("k", T0, 1, kind="nap")), INVALID, "kind"),
    ("unknown status", usage(event("s", T0, 1, status="done")), INVALID, "status"),
    ("unknown path", usage(event("p", T0, 1, path="tpu-v9@nowhere")), NOT_FOUND, "unknown path"),
    ("duplicate key, other content", usage(event("good-1", T0 + 1, 11)), EXISTS, "good-1"),
    (
        "money that would overflow",
        lambda s: s.RecordUsage(
            pb.RecordUsageRequest(
                events=[good(1), event("huge", T0 + HOUR, 4_000_000_000_000_000, path="gold@h1")]
            )
        ),
        INVALID,
        "64-bit",
    ),
    (
        "unknown reservation",
        usage(event("r", T0, 1, reservation_id="r_nope")),
        NOT_FOUND,
        "no reservation",
    ),
    (
        "path re-registered differently",
        lambda s: s.RegisterPath(
            pb.RegisterPathRequest(
                path_info=pb.PathInfo(path="cpu-eager@h1", backend="xla", price_key="cpu-std")
            )
        ),
        EXISTS,
        "immutable",
    ),
    (
        "a request without the path it registers (an old client's)",
        lambda s: s.RegisterPath(pb.RegisterPathRequest()),
        INVALID,
        "RegisterPathRequest.path_info is required",
    ),
    (
        "a request without the price it sets (an old client's)",
        lambda s: s.SetPrice(pb.SetPriceRequest()),
        INVALID,
        "SetPriceRequest.price is required",
    ),
    (
        "negative price",
        lambda s: s.SetPrice(
            pb.SetPriceRequest(price=pb.Price(price_key="p", micros_per_hour=-1, currency="USD"))
        ),
        INVALID,
        "negative",
    ),
    (
        "bad currency",
        lambda s: s.SetPrice(
            pb.SetPriceRequest(price=pb.Price(price_key="p", micros_per_hour=1, currency="dollars"))
        ),
        INVALID,
        "ISO 4217",
    ),
    (
        "retroactive price",
        lambda s: s.SetPrice(
            pb.SetPriceRequest(
                price=pb.Price(
                    price_key="cpu-std", micros_per_hour=9, currency="USD", effective_from_unix_us=T0 + 1
                )
            )
        ),
        PRECONDITION,
        "already charged",
    ),
    (
        "reservation on unknown path",
        lambda s: s.OpenReservation(
            pb.OpenReservationRequest(idempotency_key="r", path="nope", start_unix_us=T0)
        ),
        NOT_FOUND,
        "unknown path",
    ),
    (
        "overlapping reservation",
        lambda s: s.OpenReservation(
            pb.OpenReservationRequest(idempotency_key="r2", path="cpu-eager@h1", start_unix_us=T0 + 2 * HOUR)
        ),
        PRECONDITION,
        "already reserved",
    ),
    (
        "unknown reservation to close",
        lambda s: s.CloseReservation(pb.CloseReservationRequest(reservation_id="r_nope", end_unix_us=T0)),
        NOT_FOUND,
        "unknown reservation",
    ),
    (
        "reversed report window",
        lambda s: s.CostReport(pb.CostReportRequest(since_unix_us=T0 + 10, until_unix_us=T0)),
        INVALID,
        "reversed",
    ),
    (
        "malformed report filter",
        lambda s: s.CostReport(pb.CostReportRequest(group_by=["path", "colour"])),
        INVALID,
        "cannot group by 'colour'",
    ),
    ("unknown job", lambda s: s.GetJobCost(pb.GetJobCostRequest(job_id="nope")), NOT_FOUND, "unknown job"),
    (
        "job outcome changed",
        lambda s: s.CompleteJob(pb.CompleteJobRequest(job=pb.Job(job_id="done-1", status="failed"))),
        PRECONDITION,
        "already ended",
    ),
    (
        "a request without the job that ended (an old client's)",
        lambda s: s.CompleteJob(pb.CompleteJobRequest(prepare_us=5)),
        INVALID,
        "CompleteJobRequest.job is required",
    ),
    (
        "unknown trial",
        lambda s: s.GetTrialReport(pb.GetTrialReportRequest(trial_id="t0")),
        NOT_FOUND,
        "unknown trial",
    ),
    (
        "bad verdict",
        lambda s: s.RecordTrial(
            pb.RecordTrialRequest(trial_id="t1", status="completed", verdicts={"cpu": "MAYBE"})
        ),
        INVALID,
        "verdict",
    ),
    (
        "unknown principal",
        lambda s: s.CreateKey(pb.CreateKeyRequest(principal="ghost")),
        NOT_FOUND,
        "unknown principal",
    ),
    ("unknown role", lambda s: s.GrantRole(pb.RoleRequest(principal="ann", role="root")), INVALID, "role"),
    (
        "malformed scope",
        lambda s: s.GrantRole(pb.RoleRequest(principal="ann", role="infer", scope="galaxy")),
        INVALID,
        "scope",
    ),
    (
        "duplicate principal",
        lambda s: s.CreatePrincipal(pb.CreatePrincipalRequest(name="ann")),
        EXISTS,
        "exists",
    ),
    ("unknown key", lambda s: s.RevokeKey(pb.RevokeKeyRequest(key_id="sk_nope")), NOT_FOUND, "unknown key"),
    (
        "bad export format",
        lambda s: _drain(s.Export(pb.ExportRequest(format="xlsx"))),
        INVALID,
        "csv or focus",
    ),
]


async def _drain(stream: object) -> None:
    async for _ in stream:  # type: ignore[attr-defined]
        pass


def counts(metering: RunningMetering) -> tuple[int, ...]:
    def run(conn: object) -> tuple[int, ...]:
        return tuple(
            int(conn.execute(select(func.count()).select_from(t)).scalar() or 0)  # type: ignore[attr-defined]
            for t in (LINES, JOBS, RESERVATIONS, AUDIT)
        )

    return metering.ledger.tx.read(run)


async def test_bad_input_statuses_and_nothing_half_written(
    metering: RunningMetering, stub: pb_grpc.MeteringAsyncStub
) -> None:
    await setup_path(stub)
    await setup_path(stub, path="gold@h1", key="gold", per_hour=2**62)
    await stub.RecordUsage(pb.RecordUsageRequest(events=[good(1), event("done-1", T0 + 50, 10)]))
    await stub.OpenReservation(
        pb.OpenReservationRequest(idempotency_key="r1", path="cpu-eager@h1", start_unix_us=T0 + HOUR)
    )
    await stub.CreatePrincipal(pb.CreatePrincipalRequest(name="ann"))
    before = counts(metering)
    for name, call, code, fragment in CASES:
        details = await expect_status(call(stub), code, fragment)
        assert "Traceback" not in details, name
        assert counts(metering) == before, f"{name}: something was written"
    # The server still serves, and the valid events of a rejected batch go in when sent alone.
    resp = await stub.RecordUsage(pb.RecordUsageRequest(events=[good(1), good(2)]))
    assert (resp.accepted, resp.duplicates) == (1, 1)


@pytest.mark.parametrize("format_", ["csv", "focus"])
async def test_exports_stream_every_line_once(stub: pb_grpc.MeteringAsyncStub, format_: str) -> None:
    await setup_path(stub)
    events = [event(f"e{i}", T0 + i * 10, 1000 + i, tags={"customer": "acme"}) for i in range(2000)]
    await stub.RecordUsage(pb.RecordUsageRequest(events=events))
    chunks = [c.data async for c in stub.Export(pb.ExportRequest(format=format_))]
    assert len(chunks) > 1  # streamed, not one message
    lines = b"".join(chunks).decode().splitlines()
    assert len(lines) == 2001
    header = lines[0].split(",")
    if format_ == "focus":
        for col in (
            "BilledCost",
            "EffectiveCost",
            "ListCost",
            "ChargePeriodStart",
            "ChargePeriodEnd",
            "ConsumedQuantity",
            "ConsumedUnit",
            "PricingQuantity",
            "PricingUnit",
            "ResourceId",
            "ServiceName",
            "ServiceCategory",
            "Tags",
            "x_JobId",
            "x_TrialId",
        ):
            assert col in header
        assert "AI and Machine Learning" in lines[1] and "acme" in lines[1]
    else:
        assert header[:3] == ["id", "idempotency_key", "basis"]
    narrow = pb.ExportRequest(format=format_, since_unix_us=T0 + 10_000, until_unix_us=T0 + 10_100)
    window = [c.data async for c in stub.Export(narrow)]
    assert len(b"".join(window).decode().splitlines()) == 1 + 10
