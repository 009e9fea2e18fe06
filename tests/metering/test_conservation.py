"""Property: whatever the reservations, prices, jobs, failures and corrections, cost is conserved exactly.

For each generated scenario (price changes inside the reservation, jobs with several usage
events, failed and cancelled jobs, preparation charges, reversed usage lines, busy time that
may even exceed the reservation), the lines inside a closed reservation sum to reserved time x price computed
independently with exact fractions and rounded once; idle shares sum to the idle line;
idle time is shared out completely; and the cost report agrees to the micro-unit. Usage
events may carry generation tokens: the report's tokens are net of the reversals, and the
generation cost (every line of a job with tokens) per job and per million tokens is exact.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from services.metering.ledger import Ledger
from services.metering.money import round_half_up
from services.metering.records import Actor, JobInfo, UsageEvent
from services.metering.schema import LINES
from tests.metering.metering_helpers import T0

HOUR = 3_600_000_000
ACTOR = Actor("prop", "test")

job_st = st.tuples(
    st.lists(st.integers(0, 2 * HOUR), min_size=1, max_size=4),  # busy time of each usage event
    st.sampled_from([("completed", True), ("completed", False), ("failed", False), ("cancelled", False)]),
)


@dataclass(frozen=True)
class Scenario:
    length: int  # reserved microseconds
    prices: list[tuple[float, int]]  # (where in the reservation it takes effect, micros per hour)
    jobs: list[tuple[list[int], tuple[str, bool]]]  # (busy time per usage event, outcome)
    prepare: list[int]  # preparation charges (each its own completed job)
    corrections: set[int]  # jobs whose first usage line is reversed before the close
    early: list[int]  # busy time of usage recorded before the reservation was opened (back-dated)
    tokens: list[tuple[int, int]]  # (prompt, output) tokens, dealt to the usage events in turn


scenario_st = st.builds(
    Scenario,
    length=st.integers(1, 10 * HOUR),
    prices=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 10**10)), min_size=1, max_size=3),
    jobs=st.lists(job_st, max_size=6),
    prepare=st.lists(st.integers(1, HOUR), max_size=2),
    corrections=st.sets(st.integers(0, 5), max_size=3),
    early=st.lists(st.integers(0, HOUR), max_size=2),
    tokens=st.lists(st.tuples(st.integers(0, 5_000), st.integers(0, 5_000)), max_size=4),
)


@pytest.fixture
def ledger(db_url: str) -> Iterator[Ledger]:
    led = Ledger.open(db_url)
    try:
        yield led
    finally:
        led.close()


def exact_total(length: int, prices: list[tuple[int, int]]) -> int:
    """Reserved time x price by exact fractions: the reference the ledger must meet."""
    total = Fraction(0)
    for i, (start, per_hour) in enumerate(prices):
        stop = prices[i + 1][0] if i + 1 < len(prices) else length
        total += Fraction((stop - start) * per_hour, HOUR)
    whole = total.numerator // total.denominator
    return whole + (1 if total - whole >= Fraction(1, 2) else 0)


def _job_events(tag: str, path: str, sc: Scenario) -> list[UsageEvent]:
    """The scenario's jobs as usage events inside the reservation; the last of a job ends it."""
    events = []
    dealt = iter(sc.tokens * 24)
    for j, (busies, (status, quality)) in enumerate(sc.jobs):
        for n, busy in enumerate(busies):
            start = T0 + (j * 7919 + n * 104729) % sc.length
            last = n == len(busies) - 1
            prompt, output = next(dealt, (0, 0))
            events.append(
                UsageEvent(
                    f"{tag}-{j}-{n}",
                    path,
                    model="m",
                    team="t",
                    job_id=f"{tag}-job{j}",
                    kind="trial",
                    status=status if last else "",
                    met_quality=quality if last else False,
                    busy_us=busy,
                    started_us=start,
                    ended_us=start + busy,
                    prompt_tokens=prompt,
                    output_tokens=output,
                )
            )
    return events


def run_scenario(ledger: Ledger, sc: Scenario) -> None:
    tag = uuid.uuid4().hex[:10]
    key, path = f"price-{tag}", f"path-{tag}"
    length = sc.length
    # Price changes at fractions of the reservation; the first is in force from its start.
    starts = sorted({0, *(int(f * length) for f, _ in sc.prices[1:])})
    values = [v for _, v in sc.prices][: len(starts)]
    prices = list(zip(starts, values, strict=False))
    for offset, per_hour in prices:
        ledger.set_price(ACTOR, key, per_hour, "EUR", T0 + offset)
    ledger.register_path(ACTOR, path, "cpu", "cpu-16", key, "h")
    early = [
        UsageEvent(
            f"{tag}-early{k}",
            path,
            busy_us=b,
            started_us=T0 + k * 31 % length,
            ended_us=T0 + k * 31 % length + b,
        )
        for k, b in enumerate(sc.early)
    ]
    if early:
        ledger.record_usage(early)
    res = ledger.open_reservation(ACTOR, f"res-{tag}", path, T0, "")
    events = _job_events(tag, path, sc)
    if events:
        ledger.record_usage(events)
    for j in sorted(sc.corrections):
        if j < len(sc.jobs):
            ledger.reverse_usage(ACTOR, f"{tag}-fix{j}", f"{tag}-{j}-0", "test correction")
    for p, prep in enumerate(sc.prepare):
        ledger.complete_job(JobInfo(f"{tag}-prep{p}", path, "m", "t", "completed", True, "", T0 + prep), prep)
    closed = ledger.close_reservation(ACTOR, res.reservation_id, T0 + length)

    expected = exact_total(length, prices)
    assert closed.cost_micros == expected
    lines = ledger.tx.read(
        lambda c: c.execute(select(LINES).where(LINES.c.path == path)).all()  # all inside the reservation
    )
    assert sum(r.amount_micros for r in lines) == expected  # jobs + idle = reserved time x price
    idle_lines = [r for r in lines if r.basis in ("idle", "idle_share")]
    assert sum(r.amount_micros for r in idle_lines) == closed.idle_micros
    assert sum(r.quantity_us for r in lines) == length  # every reserved microsecond is on a line
    net: dict[str, int] = {}
    for r in lines:
        if r.basis in ("busy", "reversal"):
            net[r.job_id] = net.get(r.job_id, 0) + r.quantity_us
    busy_jobs = {job for job, us in net.items() if us > 0}
    assert {r.job_id for r in idle_lines if r.basis == "idle_share"} == busy_jobs
    report = ledger.cost_report(["path"], T0, 0)
    row = next(r for r in report if r.group["path"] == path)
    assert row.total_micros == expected and row.unpriced_events == 0
    completed = sum(1 for _, (s, q) in sc.jobs if s == "completed" and q) + len(sc.prepare)
    assert row.jobs_completed == completed

    reversed_keys = {f"{tag}-{j}-0" for j in sc.corrections if j < len(sc.jobs)}
    kept = [e for e in events if e.idempotency_key not in reversed_keys]
    assert row.prompt_tokens == sum(e.prompt_tokens for e in kept)
    assert row.output_tokens == sum(e.output_tokens for e in kept)
    generating = {e.job_id for e in events if e.prompt_tokens or e.output_tokens}
    cost = sum(r.amount_micros for r in lines if r.job_id in generating)
    assert row.generation_micros == cost
    done = [j for j, (_, (s, q)) in enumerate(sc.jobs) if s == "completed" and q]
    gen_done = sum(1 for j in done if f"{tag}-job{j}" in generating)
    assert row.generation_jobs_completed == gen_done
    assert row.cost_per_completed_generation_job_micros == (
        round_half_up(Fraction(cost, gen_done)) if gen_done else 0
    )
    for tokens, figure in (
        (row.output_tokens, row.cost_per_million_output_tokens_micros),
        (row.prompt_tokens, row.cost_per_million_prompt_tokens_micros),
    ):
        assert figure == (round_half_up(Fraction(cost * 10**6, tokens)) if tokens else 0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sc=scenario_st)
def test_cost_is_conserved_exactly(ledger: Ledger, sc: Scenario) -> None:
    run_scenario(ledger, sc)
