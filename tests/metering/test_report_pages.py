"""Report pages in headless Chromium, from a real ledger where a job costs under a micro-unit.

Path `cheap@h1` holds a reservation of 10 s at 10 micro-units a second shared by 400 tiny
jobs: 1/4 micro-unit a job, which rounded per job reads 0.000000. Path `dear@h2` costs
0.01 USD a job. The finance page (`switchyard ledger html`, the real CLI against the real
service) and the trial report's cost chart must show both, per 1,000 jobs, with data on
screen, and the tables must give the exact figure.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.metering.metering_server import RunningMetering, start_metering
from switchyard.gen.switchyard.v1 import metering_pb2 as pb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as pb_grpc
from switchyard.grpcio import ServerOptions
from tests.conftest import ROOT
from tests.metering.metering_helpers import T0, event, price_paths
from tests.report_pages import check_charts, chromium
from workflows.report import render

SECOND = 1_000_000


@pytest.fixture
async def ledger(tmp_path: Path) -> AsyncIterator[RunningMetering]:
    running = await start_metering(f"sqlite:///{tmp_path / 'ledger.db'}", ServerOptions(port=0))
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = pb_grpc.MeteringStub(channel)
            for key, per_hour, path in (
                ("cheap", 36_000, "cheap@h1"),
                ("dear", 3_600_000_000, "dear@h2"),
            ):
                await price_paths(stub, key, [path], per_hour=per_hour, resource_class="c")
            res = await stub.OpenReservation(
                pb.OpenReservationRequest(idempotency_key="r", path="cheap@h1", start_unix_us=T0)
            )
            tiny = [event(f"c{i}", T0 + i * 20_000, 1, path="cheap@h1") for i in range(400)]
            await stub.RecordUsage(pb.RecordUsageRequest(events=tiny))
            await stub.CloseReservation(
                pb.CloseReservationRequest(reservation_id=res.reservation_id, end_unix_us=T0 + 10 * SECOND)
            )
            dear = [event(f"d{i}", T0 + i * SECOND, 10_000, path="dear@h2") for i in range(10)]
            await stub.RecordUsage(pb.RecordUsageRequest(events=dear))
        yield running
    finally:
        await running.stop(0.5)


async def cli(running: RunningMetering, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "clients.cli",
        *args,
        "--metering",
        running.address,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def test_the_finance_page_shows_sub_micro_costs_per_1000_jobs(
    ledger: RunningMetering, tmp_path: Path
) -> None:
    chromium()
    page = tmp_path / "finance.html"
    await cli(ledger, "ledger", "html", "-o", str(page))
    html = page.read_text()
    assert "0.000250 USD per 1,000 jobs (exactly 1/4 micro-USD per job)" in html  # the table
    assert "0.010000 USD per job" in html  # each row at its own scale, named
    assert "per job</td>" in html and "0.000000 USD" not in html
    marks = await asyncio.to_thread(check_charts, html, tmp_path / "finance", 2)
    assert len(marks) == 2
    table = await cli(ledger, "ledger", "report", "--by", "path")
    assert "0.000250 per 1,000 jobs (exactly 1/4 micro-units per job)" in table


async def test_the_trial_cost_chart_shows_sub_micro_costs(ledger: RunningMetering, tmp_path: Path) -> None:
    chromium()
    rows = ledger.ledger.cost_report(["path"], 0, 0)
    report: dict[str, Any] = {
        "reference": "dear@h2",
        "paths": {
            r.group["path"]: {
                "economics": {
                    "total_micros": r.total_micros,
                    "jobs_completed": r.jobs_completed,
                    "currency": r.currency,
                    "cost_per_completed_job_micros": r.cost_per_completed_job_micros,
                }
            }
            for r in rows
        },
    }
    assert report["paths"]["cheap@h1"]["economics"]["cost_per_completed_job_micros"] == 0  # rounded per job
    cost = next(svg for svg in render._charts(report) if "Cost per completed job" in svg)
    assert "per 1,000 jobs" in cost and "no data" not in cost and cost.count("data-value=") == 2
    assert 'data-value="0.00025"' in cost and 'data-value="10"' in cost  # USD per 1,000 jobs
    await asyncio.to_thread(
        check_charts, f"<!DOCTYPE html><html><body>{cost}</body></html>", tmp_path / "trial"
    )


def test_trial_details_are_html_not_raw_markdown() -> None:
    text = "# Trial t: m\n\nStatus **completed**.\n\n## cpu\n\n- prepare: 1 s\n  - tolerance: <b>x</b>\n"
    out = render._details_html(text)
    assert "<h1>Trial t: m</h1>" in out and "<strong>completed</strong>" in out and "<li>prepare: 1 s" in out
    assert "<b>" not in out and "&lt;b&gt;" in out  # text from a report is never taken as HTML
