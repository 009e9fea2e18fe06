"""Metering per token through the real gRPC service, on SQLite and PostgreSQL.

Generation usage carries prompt and output tokens; the ledger keeps them on the usage line
(a reversal negates them), the report gives cost per completed generation job and per
million output and prompt tokens per path, model and team (exact: checked against the
journal's own lines with fractions), and both exports carry the token columns.
"""

from __future__ import annotations

import csv
import json
from fractions import Fraction
from pathlib import Path
from typing import Any

import grpc
import pytest
from sqlalchemy import select

from services.metering.metering_server import RunningMetering
from services.metering.money import per_million_tokens_text, round_half_up
from services.metering.records import Actor, UsageEvent
from services.metering.schema import LINES
from switchyard.gen.switchyard.v1 import metering_pb2 as pb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as pb_grpc
from tests.metering.metering_helpers import HOUR, T0, event, expect_status, setup_path
from tests.metering.test_ledger_cli import Background, cli

GEN = "tiny-lm-gen"
# key: (start offset s, busy us, team, prompt tokens, output tokens, status)
USAGE = {
    "g1": (1, 1_000_000, "search", 12, 40, "completed"),
    "g2": (3, 700_001, "search", 7, 3, "cancelled"),  # the client left after 3 tokens
    "g3": (5, 333_333, "ads", 5, 20, "completed"),
    "g4": (7, 250_000, "search", 4, 4, "completed"),  # reversed below
}


def gen_event(key: str) -> pb.UsageEvent:
    offset, busy, team, prompt, output, status = USAGE[key]
    return event(
        key, T0 + offset * 1_000_000, busy, model=GEN, team=team, status=status,
        met_quality=status == "completed", prompt_tokens=prompt, output_tokens=output,
    )  # fmt: skip


async def record_scenario(stub: pb_grpc.MeteringAsyncStub) -> None:
    """Generation and non-generation jobs inside a reservation (so idle shares go to both),
    one generation line reversed before the close."""
    await setup_path(stub, per_hour=1_000_003)  # awkward: nothing divides evenly
    res = await stub.OpenReservation(
        pb.OpenReservationRequest(idempotency_key="r1", path="cpu-eager@h1", start_unix_us=T0)
    )
    events = [gen_event(k) for k in USAGE]
    events.append(event("m1", T0 + 9_000_000, 500_000, model="mlp", team="search"))
    resp = await stub.RecordUsage(pb.RecordUsageRequest(events=events))
    assert resp.accepted == 5
    await stub.ReverseUsage(pb.ReverseUsageRequest(idempotency_key="fix-g4", reverses_key="g4", reason="t"))
    await stub.CloseReservation(
        pb.CloseReservationRequest(reservation_id=res.reservation_id, end_unix_us=T0 + HOUR)
    )


def journal(metering: RunningMetering) -> list[Any]:
    return list(metering.ledger.tx.read(lambda c: c.execute(select(LINES)).all()))


async def test_tokens_are_stored_reversed_and_reported_exactly(
    metering: RunningMetering, stub: pb_grpc.MeteringAsyncStub
) -> None:
    await record_scenario(stub)
    lines = journal(metering)
    by_key = {r.idempotency_key: r for r in lines}
    assert (by_key["g1"].prompt_tokens, by_key["g1"].output_tokens) == (12, 40)
    assert (by_key["fix-g4"].prompt_tokens, by_key["fix-g4"].output_tokens) == (-4, -4)
    assert (by_key["m1"].prompt_tokens, by_key["m1"].output_tokens) == (0, 0)
    assert all(r.prompt_tokens == r.output_tokens == 0 for r in lines if r.basis in ("idle", "idle_share"))
    generation_jobs = {"g1", "g2", "g3", "g4"}
    assert {r.job_id for r in lines if r.basis == "idle_share"} >= {"g1", "m1"}  # shares go to both kinds

    report = await stub.CostReport(pb.CostReportRequest(group_by=["path", "model", "team"]))
    rows = {(r.group["model"], r.group["team"]): r for r in report.rows}
    assert set(rows) == {(GEN, "search"), (GEN, "ads"), ("mlp", "search")}  # idle: all shared to jobs
    for (model, team), row in rows.items():
        mine = [r for r in lines if (r.model, r.team) == (model, team)]
        expected_cost = sum(r.amount_micros for r in mine if r.job_id in generation_jobs)
        keys = [k for k, u in USAGE.items() if u[2] == team and model == GEN]
        completed = sum(1 for k in keys if USAGE[k][5] == "completed")
        prompt = sum(USAGE[k][3] for k in keys if k != "g4")  # g4's tokens are reversed
        output = sum(USAGE[k][4] for k in keys if k != "g4")
        assert (row.prompt_tokens, row.output_tokens) == (prompt, output), (model, team)
        assert row.generation_micros == expected_cost, (model, team)
        assert row.generation_jobs_completed == completed
        assert row.generation_jobs_total == len(keys)
        per_job = round_half_up(Fraction(expected_cost, completed)) if completed else 0
        assert row.cost_per_completed_generation_job_micros == per_job
        per_out = round_half_up(Fraction(expected_cost * 10**6, output)) if output else 0
        per_prompt = round_half_up(Fraction(expected_cost * 10**6, prompt)) if prompt else 0
        assert row.cost_per_million_output_tokens_micros == per_out
        assert row.cost_per_million_prompt_tokens_micros == per_prompt
    search = rows[GEN, "search"]
    # g1, g2 and g4 (completed, then corrected: still a completed job) on the search team
    assert (search.generation_jobs_completed, search.generation_jobs_total) == (2, 3)
    assert search.generation_micros > 0 and search.cost_per_million_output_tokens_micros > 0
    mlp = rows["mlp", "search"]
    assert (mlp.prompt_tokens, mlp.output_tokens, mlp.generation_micros, mlp.generation_jobs_total) == (
        0,
    ) * 4
    assert mlp.jobs_completed == 1 and mlp.total_micros > 0  # its cost stays out of generation's

    # The generation cost of the path is every generation job's lines, idle shares included.
    whole = await stub.CostReport(pb.CostReportRequest(group_by=["path"]))
    (path_row,) = whole.rows
    assert path_row.generation_micros == sum(r.amount_micros for r in lines if r.job_id in generation_jobs)
    assert (path_row.prompt_tokens, path_row.output_tokens) == (12 + 7 + 5, 40 + 3 + 20)
    assert path_row.total_micros == sum(r.amount_micros for r in lines)  # conservation is unchanged


async def test_exports_carry_the_tokens(stub: pb_grpc.MeteringAsyncStub) -> None:
    await record_scenario(stub)
    focus = b"".join([c.data async for c in stub.Export(pb.ExportRequest(format="focus"))]).decode()
    rows = {r["x_JobId"] + "/" + r["x_CostBasis"]: r for r in csv.DictReader(focus.splitlines())}
    assert (rows["g1/busy"]["x_PromptTokens"], rows["g1/busy"]["x_OutputTokens"]) == ("12", "40")
    assert (rows["g4/reversal"]["x_PromptTokens"], rows["g4/reversal"]["x_OutputTokens"]) == ("-4", "-4")
    assert (rows["m1/busy"]["x_PromptTokens"], rows["m1/busy"]["x_OutputTokens"]) == ("0", "0")
    # The quantity the line is priced in stays the hours; the tokens ride beside it.
    assert rows["g1/busy"]["ConsumedUnit"] == rows["g1/busy"]["PricingUnit"] == "Hours"
    flat = b"".join([c.data async for c in stub.Export(pb.ExportRequest(format="csv"))]).decode()
    plain = {r["idempotency_key"]: r for r in csv.DictReader(flat.splitlines())}
    assert (plain["g2"]["prompt_tokens"], plain["g2"]["output_tokens"]) == ("7", "3")


async def test_token_counts_are_part_of_the_event_and_checked(
    metering: RunningMetering, stub: pb_grpc.MeteringAsyncStub
) -> None:
    await setup_path(stub)
    first = await stub.RecordUsage(pb.RecordUsageRequest(events=[gen_event("g1")]))
    again = await stub.RecordUsage(pb.RecordUsageRequest(events=[gen_event("g1")]))
    assert (first.accepted, again.duplicates) == (1, 1)
    other = gen_event("g1")
    other.output_tokens = 41  # the same request with another count: not the same event
    await expect_status(
        stub.RecordUsage(pb.RecordUsageRequest(events=[other])), grpc.StatusCode.ALREADY_EXISTS, "g1"
    )
    bad = gen_event("g2")
    bad.prompt_tokens = -1
    await expect_status(
        stub.RecordUsage(pb.RecordUsageRequest(events=[bad])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "prompt_tokens",
    )
    assert [r.idempotency_key for r in journal(metering)] == ["g1"]


def test_an_event_without_tokens_keeps_the_digest_stored_before_tokens_were_metered() -> None:
    """A retry of usage recorded before migration 0005 must stay a duplicate, not a conflict.
    The digest below is what the ledger's code before this change computed for this event."""
    ev = UsageEvent(
        "req-1", "cpu@h", "tiny-lm-gen", "1", "search", "p1", "", "request", "completed", True,
        1500, 10, 2000, "", "primary", (("a", "b"),), "",
    )  # fmt: skip
    assert ev.content_hash() == "5fbd5d03cc6b724a034bb0095af12790e6ef9d9f89a7056b173f023a85360140"
    assert ev._replace(output_tokens=1).content_hash() != ev.content_hash()


def test_per_million_text_is_exact() -> None:
    assert per_million_tokens_text(5, 2, "USD") == "2.500000 USD per 1M tokens"
    assert per_million_tokens_text(1, 7, "USD") == (
        "0.142857 USD per 1M tokens (exactly 1000000/7 micro-USD per 1M tokens)"
    )


def test_finance_cli_shows_generation_costs(
    db_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    served = Background(db_url)
    try:
        ledger = served.running.ledger
        ledger.set_price(Actor("test"), "cpu", 1_000_003, "USD", T0)
        ledger.register_path(Actor("test"), "cpu@h", "cpu", "c", "cpu", "h")
        ledger.record_usage(
            [
                UsageEvent(f"g{i}", "cpu@h", GEN, team="search", status="completed", met_quality=True,
                           busy_us=1_000 + i, started_us=T0 + i, ended_us=T0 + i + 1_000 + i,
                           prompt_tokens=7, output_tokens=3 * i + 1)
                for i in range(3)
            ]
            + [UsageEvent("m", "cpu@h", "mlp", team="search", status="completed", met_quality=True,
                          busy_us=5_000, started_us=T0, ended_us=T0 + 5_000)]
        )  # fmt: skip
        assert cli(served, "ledger", "report", "--by", "model", "--format", "json") == 0
        rows = {r["model"]: r for r in json.loads(capsys.readouterr().out)}
        gen = rows[GEN]
        assert (gen["prompt_tokens"], gen["output_tokens"], gen["generation_jobs_completed"]) == (21, 12, 3)
        assert rows["mlp"]["generation_micros"] == 0 and rows["mlp"]["total_micros"] > 0
        assert cli(served, "ledger", "report", "--by", "model") == 0
        table = capsys.readouterr().out
        assert "per_1M_output" in table.splitlines()[0]
        line = next(row for row in table.splitlines() if row.startswith(GEN))
        cost = gen["generation_micros"]
        assert per_million_tokens_text(cost, 12, "USD") in line
        assert per_million_tokens_text(cost, 21, "USD") in line
        page = tmp_path / "ledger.html"
        assert cli(served, "ledger", "html", "-o", str(page)) == 0
        html = page.read_text()
        assert "Generation by path" in html and per_million_tokens_text(cost, 12, "USD") in html
    finally:
        served.stop()


async def test_the_bi_view_agrees_with_the_report(
    metering: RunningMetering, stub: pb_grpc.MeteringAsyncStub
) -> None:
    """v_generation_cost (migration 0006) gives what CostReport gives per path, model, team and
    day, on both databases; groups without generation are not rows, and NULL is "no divisor"."""
    await record_scenario(stub)
    day2 = T0 + 26 * HOUR  # the next day, outside the reservation, and a cost over many tokens
    big = event("g5", day2, 3_000_000_007, model=GEN, team="ads", prompt_tokens=3, output_tokens=7)
    await stub.RecordUsage(pb.RecordUsageRequest(events=[big]))
    report = await stub.CostReport(pb.CostReportRequest(group_by=["path", "model", "team", "day"]))
    expected = {
        (r.group["path"], r.group["model"], r.group["team"], r.group["day"]): (
            r.generation_micros, r.prompt_tokens, r.output_tokens, r.generation_jobs_completed,
            r.cost_per_completed_generation_job_micros if r.generation_jobs_completed else None,
            r.cost_per_million_output_tokens_micros if r.output_tokens > 0 else None,
            r.cost_per_million_prompt_tokens_micros if r.prompt_tokens > 0 else None,
        )
        for r in report.rows
        if r.prompt_tokens or r.output_tokens or r.generation_micros
    }  # fmt: skip
    assert len(expected) == 3  # search and ads on day 1, ads on day 2 (mlp has no generation)

    def view(conn: Any) -> list[Any]:
        from sqlalchemy import text

        return list(conn.execute(text("SELECT * FROM v_generation_cost")).mappings())

    rows = metering.ledger.tx.read(view)
    got = {
        (r["path"], r["model"], r["team"], r["day"]): (
            r["generation_micros"], r["prompt_tokens"], r["output_tokens"], r["generation_jobs_completed"],
            r["cost_per_completed_generation_job_micros"], r["cost_per_million_output_tokens_micros"],
            r["cost_per_million_prompt_tokens_micros"],
        )
        for r in rows
    }  # fmt: skip
    assert got == expected
    ads2 = got["cpu-eager@h1", GEN, "ads", "2026-01-02"]
    assert ads2[5] == round_half_up(Fraction(ads2[0] * 10**6, 7))  # exact, rounded half up once
