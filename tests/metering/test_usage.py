"""RecordUsage through the real gRPC service: idempotency, concurrency, pricing, reservations."""

from __future__ import annotations

import asyncio
import csv

import grpc

from services.metering.metering_server import RunningMetering, start_metering
from switchyard.gen.switchyard.v1 import metering_pb2 as pb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as pb_grpc
from switchyard.grpcio import ServerOptions
from tests.metering.metering_helpers import HOUR, T0, event, expect_status, setup_path


def count_lines(metering: RunningMetering) -> int:
    from sqlalchemy import func, select

    from services.metering.schema import LINES

    return int(
        metering.ledger.tx.read(lambda c: c.execute(select(func.count()).select_from(LINES)).scalar()) or 0
    )


async def test_same_batch_twice_and_concurrently_is_stored_once(
    metering: RunningMetering, stub: pb_grpc.MeteringAsyncStub, db_url: str
) -> None:
    await setup_path(stub)
    batch = pb.RecordUsageRequest(events=[event(f"req-{i}", T0 + i * 1000, 500) for i in range(300)])
    first = await stub.RecordUsage(batch)
    assert (first.accepted, first.duplicates) == (300, 0)
    again = await stub.RecordUsage(batch)
    assert (again.accepted, again.duplicates) == (0, 300)
    # A second batch sent at once by six writers: three on this server, three on a second
    # server process-equivalent sharing the same database.
    other = await start_metering(db_url, ServerOptions(port=0))
    try:
        batch2 = pb.RecordUsageRequest(
            events=[event(f"req2-{i}", T0 + HOUR + i * 1000, 700) for i in range(400)]
        )
        async with grpc.aio.insecure_channel(other.address) as ch2:
            stub2 = pb_grpc.MeteringStub(ch2)
            results = await asyncio.gather(*(s.RecordUsage(batch2) for s in (stub, stub2) * 3))
    finally:
        await other.stop(0.5)
    assert sum(r.accepted for r in results) == 400
    assert sum(r.duplicates for r in results) == 400 * 5
    assert count_lines(metering) == 700
    cost = await stub.GetJobCost(pb.GetJobCostRequest(job_id="req2-7"))
    assert [ln.basis for ln in cost.lines] == ["busy"]


async def test_same_key_other_content_rejects_the_whole_batch(
    metering: RunningMetering, stub: pb_grpc.MeteringAsyncStub
) -> None:
    await setup_path(stub)
    await stub.RecordUsage(pb.RecordUsageRequest(events=[event("a", T0, 100)]))
    mixed = [event("b", T0 + 10, 100), event("a", T0, 999)]
    await expect_status(
        stub.RecordUsage(pb.RecordUsageRequest(events=mixed)), grpc.StatusCode.ALREADY_EXISTS, "a"
    )
    assert count_lines(metering) == 1  # "b" was not half-written
    inside = [event("c", T0, 1), event("c", T0, 2)]
    await expect_status(
        stub.RecordUsage(pb.RecordUsageRequest(events=inside)), grpc.StatusCode.ALREADY_EXISTS
    )
    ok = await stub.RecordUsage(pb.RecordUsageRequest(events=[event("b", T0 + 10, 100)]))
    assert ok.accepted == 1


async def test_busy_time_is_charged_at_the_dated_price_in_force(stub: pb_grpc.MeteringAsyncStub) -> None:
    await setup_path(stub, per_hour=3_600_000)  # 1 micro-unit per busy millisecond
    await stub.SetPrice(
        pb.SetPriceRequest(
            price=pb.Price(
                price_key="cpu-std",
                micros_per_hour=7_200_000,
                currency="USD",
                effective_from_unix_us=T0 + HOUR,
            )
        )
    )
    await stub.RecordUsage(
        pb.RecordUsageRequest(
            events=[event("early", T0 + 5, 1_000_000), event("late", T0 + HOUR + 5, 1_000_000)]
        )
    )
    early = await stub.GetJobCost(pb.GetJobCostRequest(job_id="early"))
    late = await stub.GetJobCost(pb.GetJobCostRequest(job_id="late"))
    assert (early.total_micros, early.lines[0].price_version) == (1000, f"cpu-std@{T0}")
    assert (late.total_micros, late.lines[0].price_version) == (2000, f"cpu-std@{T0 + HOUR}")


async def test_usage_without_a_price_is_unpriced_never_zero(stub: pb_grpc.MeteringAsyncStub) -> None:
    await setup_path(stub)
    resp = await stub.RecordUsage(pb.RecordUsageRequest(events=[event("before-price", T0 - HOUR, 5_000_000)]))
    assert resp.unpriced == 1
    cost = await stub.GetJobCost(pb.GetJobCostRequest(job_id="before-price"))
    assert cost.unpriced and cost.lines[0].basis == "unpriced"
    report = await stub.CostReport(pb.CostReportRequest(group_by=["path"]))
    assert report.rows[0].unpriced_events == 1
    chunks = [c.data async for c in stub.Export(pb.ExportRequest(format="focus"))]
    rows = list(csv.DictReader(b"".join(chunks).decode().splitlines()))
    # FOCUS has no empty cost: billed 0, and flagged unpriced (reports never sum it as 0)
    assert (rows[0]["BilledCost"], rows[0]["x_Unpriced"]) == ("0.000000", "true")


async def test_reservation_idle_is_shared_by_busy_time_and_conserved(stub: pb_grpc.MeteringAsyncStub) -> None:
    await setup_path(stub, per_hour=1_000_003)  # awkward price: shares do not divide evenly
    res = await stub.OpenReservation(
        pb.OpenReservationRequest(idempotency_key="res-1", path="cpu-eager@h1", start_unix_us=T0)
    )
    busy = {"j1": 1_000_001, "j2": 2_000_003, "j3": 333_333}
    events = [event(k, T0 + 10_000_000 * i, b) for i, (k, b) in enumerate(busy.items())]
    events.append(event("j3-fail", T0 + 50_000_000, 10_000, status="failed", met_quality=False))
    await stub.RecordUsage(pb.RecordUsageRequest(events=events))
    done = await stub.CompleteJob(
        pb.CompleteJobRequest(
            job=pb.Job(
                job_id="prep-1",
                path="cpu-eager@h1",
                status="completed",
                met_quality=True,
                ended_unix_us=T0 + 60_000_000,
            ),
            prepare_us=7_000_000,
        )
    )
    assert done.status == "completed"
    closed = await stub.CloseReservation(
        pb.CloseReservationRequest(reservation_id=res.reservation_id, end_unix_us=T0 + HOUR)
    )
    assert closed.state == "closed" and closed.cost_micros == 1_000_003
    total = 0
    for job in [*busy, "j3-fail", "prep-1"]:
        cost = await stub.GetJobCost(pb.GetJobCostRequest(job_id=job))
        total += cost.total_micros
        shares = [ln for ln in cost.lines if ln.basis == "idle_share"]
        if job in busy:
            assert shares and shares[0].method == "busy_time_proportional/largest_remainder"
    assert total == closed.cost_micros  # busy + preparation + idle shares = reserved time x price
    # j2 worked twice as long as j1, so carries twice the idle (to rounding of one micro-unit).
    j1 = await stub.GetJobCost(pb.GetJobCostRequest(job_id="j1"))
    j2 = await stub.GetJobCost(pb.GetJobCostRequest(job_id="j2"))
    idle1, idle2 = (sum(ln.amount_micros for ln in c.lines if ln.basis == "idle_share") for c in (j1, j2))
    assert abs(idle2 - 2 * idle1) <= 2
    report = await stub.CostReport(pb.CostReportRequest(group_by=["path"]))
    row = report.rows[0]
    assert row.total_micros == closed.cost_micros and row.jobs_completed == 4 and row.jobs_failed == 1
    assert row.cost_per_completed_job_micros == round(closed.cost_micros / 4)
    # Usage inside the closed reservation is refused; after it, it is charged busy time only.
    late = pb.RecordUsageRequest(events=[event("late", T0 + 100, 10)])
    await expect_status(stub.RecordUsage(late), grpc.StatusCode.FAILED_PRECONDITION, "closed")
    after = await stub.RecordUsage(pb.RecordUsageRequest(events=[event("after", T0 + 2 * HOUR, 10)]))
    assert after.accepted == 1


async def test_setting_the_price_already_in_force_is_a_no_op(stub: pb_grpc.MeteringAsyncStub) -> None:
    """A re-run that sets the same price again (e.g. `switchyard up` twice) must not fail or fork versions."""
    await setup_path(stub)
    await stub.RecordUsage(pb.RecordUsageRequest(events=[event("x", T0 + HOUR, 10)]))
    again = pb.SetPriceRequest(
        price=pb.Price(
            price_key="cpu-std", micros_per_hour=3_600_000, currency="USD", effective_from_unix_us=T0 + 5
        )
    )
    assert (await stub.SetPrice(again)).version == f"cpu-std@{T0}"
    again.price.micros_per_hour = 1
    await expect_status(stub.SetPrice(again), grpc.StatusCode.FAILED_PRECONDITION, "already charged")


async def test_a_correction_is_a_reversal_row_and_conservation_still_holds(
    stub: pb_grpc.MeteringAsyncStub,
) -> None:
    await setup_path(stub, per_hour=3_600_000)
    res = await stub.OpenReservation(
        pb.OpenReservationRequest(idempotency_key="r", path="cpu-eager@h1", start_unix_us=T0)
    )
    await stub.RecordUsage(
        pb.RecordUsageRequest(events=[event("ok", T0, 1_000_000), event("wrong", T0 + 5, 2_000_000)])
    )
    rev = pb.ReverseUsageRequest(
        idempotency_key="fix-1", reverses_key="wrong", reason="double-reported by a retry"
    )
    first = await stub.ReverseUsage(rev)
    assert (first.amount_micros, first.duplicate) == (-2000, False)
    assert (await stub.ReverseUsage(rev)).duplicate
    rev2 = pb.ReverseUsageRequest(idempotency_key="fix-2", reverses_key="wrong")
    await expect_status(stub.ReverseUsage(rev2), grpc.StatusCode.FAILED_PRECONDITION, "already reversed")
    closed = await stub.CloseReservation(
        pb.CloseReservationRequest(reservation_id=res.reservation_id, end_unix_us=T0 + HOUR)
    )
    wrong = await stub.GetJobCost(pb.GetJobCostRequest(job_id="wrong"))
    assert [ln.basis for ln in wrong.lines] == ["busy", "reversal"] and wrong.total_micros == 0
    ok = await stub.GetJobCost(pb.GetJobCostRequest(job_id="ok"))
    assert ok.total_micros == closed.cost_micros  # the only job left carries all the idle time
    rev3 = pb.ReverseUsageRequest(idempotency_key="fix-3", reverses_key="ok")
    await expect_status(stub.ReverseUsage(rev3), grpc.StatusCode.FAILED_PRECONDITION, "final")
    audit = (await stub.QueryAudit(pb.QueryAuditRequest(action="usage.reverse"))).records
    assert len(audit) == 1 and "double-reported" in audit[0].detail_json


async def test_usage_recorded_before_a_reservation_opened_is_not_paid_twice(
    stub: pb_grpc.MeteringAsyncStub,
) -> None:
    """Traffic that arrived before the reservation was opened (back-dated to before it) counts
    against the reserved total once: busy line + the rest as idle = reserved time x price."""
    await setup_path(stub, per_hour=3_600_000)
    await stub.RecordUsage(pb.RecordUsageRequest(events=[event("early", T0 + 1000, 600_000)]))
    res = await stub.OpenReservation(
        pb.OpenReservationRequest(idempotency_key="r", path="cpu-eager@h1", start_unix_us=T0)
    )
    await stub.RecordUsage(pb.RecordUsageRequest(events=[event("inside", T0 + 2_000_000, 400_000)]))
    closed = await stub.CloseReservation(
        pb.CloseReservationRequest(reservation_id=res.reservation_id, end_unix_us=T0 + 10_000_000)
    )
    report = (await stub.CostReport(pb.CostReportRequest(group_by=["path"]))).rows[0]
    assert closed.cost_micros == 10_000 and report.total_micros == 10_000
    assert report.busy_micros == 1_000 and report.idle_micros == 9_000
    late = pb.ReverseUsageRequest(idempotency_key="fix", reverses_key="early")
    await expect_status(stub.ReverseUsage(late), grpc.StatusCode.FAILED_PRECONDITION, "final")


async def test_overlapping_batches_in_opposite_orders_from_two_servers(
    metering: RunningMetering, stub: pb_grpc.MeteringAsyncStub, db_url: str
) -> None:
    """Writers that share keys in opposite orders neither deadlock nor store anything twice."""
    await setup_path(stub)
    forward = [event(f"k{i:04d}", T0 + i, 5) for i in range(0, 600)]
    backward = [event(f"k{i:04d}", T0 + i, 5) for i in reversed(range(300, 900))]
    other = await start_metering(db_url, ServerOptions(port=0))
    try:
        async with grpc.aio.insecure_channel(other.address) as ch2:
            stub2 = pb_grpc.MeteringStub(ch2)
            results = await asyncio.gather(
                *(
                    s.RecordUsage(pb.RecordUsageRequest(events=batch))
                    for s, batch in ((stub, forward), (stub2, backward), (stub2, forward), (stub, backward))
                )
            )
    finally:
        await other.stop(0.5)
    assert sum(r.accepted for r in results) == 900
    assert sum(r.accepted + r.duplicates for r in results) == 4 * 600
    assert count_lines(metering) == 900


async def test_costs_at_an_example_price_are_marked_until_finance_prices_the_key(
    stub: pb_grpc.MeteringAsyncStub,
) -> None:
    """`switchyard up`'s example book: a cost charged at it is marked in the cost report, line
    for line (idle lines over several versions included); finance's price at the same rate is
    a new version (not the example's no-op), and what it charges is not marked."""
    example = pb.Price(
        price_key="cpu-std",
        micros_per_hour=3_600_000,
        currency="USD",
        effective_from_unix_us=T0,
        example=True,
    )
    assert (await stub.SetPrice(pb.SetPriceRequest(price=example))).example
    assert (
        await stub.SetPrice(pb.SetPriceRequest(price=example))
    ).version == f"cpu-std@{T0}"  # again: a no-op
    example.example = False  # finance's price, at the same time: not the example's, so a conflict
    await expect_status(
        stub.SetPrice(pb.SetPriceRequest(price=example)), grpc.StatusCode.ALREADY_EXISTS, "(example)"
    )
    info = pb.PathInfo(path="cpu-eager@h1", backend="cpu", resource_class="cpu-16", price_key="cpu-std")
    await stub.RegisterPath(pb.RegisterPathRequest(path_info=info))
    finance = pb.Price(
        price_key="cpu-std", micros_per_hour=3_600_000, currency="USD", effective_from_unix_us=T0 + HOUR
    )
    set_by_finance = await stub.SetPrice(pb.SetPriceRequest(price=finance))
    assert (set_by_finance.version, set_by_finance.example) == (f"cpu-std@{T0 + HOUR}", False)
    res = await stub.OpenReservation(
        pb.OpenReservationRequest(idempotency_key="res-x", path="cpu-eager@h1", start_unix_us=T0)
    )
    events = [event("at-example", T0 + 5, 1_000_000), event("at-finance", T0 + HOUR + 5, 1_000_000)]
    await stub.RecordUsage(pb.RecordUsageRequest(events=events))
    await stub.CloseReservation(
        pb.CloseReservationRequest(reservation_id=res.reservation_id, end_unix_us=T0 + 2 * HOUR)
    )
    lines = [
        ln
        for job in ("at-example", "at-finance")
        for ln in (await stub.GetJobCost(pb.GetJobCostRequest(job_id=job))).lines
    ]
    marked = [ln for ln in lines if f"cpu-std@{T0}" in ln.price_version.split(",")]
    # at-example's busy line, and both jobs' idle shares (the reservation spans both versions)
    assert sorted(ln.basis for ln in marked) == ["busy", "idle_share", "idle_share"], lines
    finance_busy = [ln for ln in lines if ln.basis == "busy" and ln not in marked]
    assert [ln.price_version for ln in finance_busy] == [f"cpu-std@{T0 + HOUR}"]
    row = (await stub.CostReport(pb.CostReportRequest(group_by=["path"]))).rows[0]
    assert row.example_priced_lines == len(marked)
