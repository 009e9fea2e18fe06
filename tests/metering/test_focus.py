"""FOCUS 1.2 export of a real ledger, checked by focus-validator (PyPI) and by the 1.2 rules
the validator does not know.

focus-validator 1.0.0, the newest release, validates FOCUS up to 1.0; a few of its rules use
column names FOCUS renamed before 1.0 was final, and are overridden (tools/
focus-validator-overrides.yaml says which and why). It runs in its own environment
(`make setup-focus`, requirements/focus.txt), which this test builds when it is missing.
"""

from __future__ import annotations

import csv
import re
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from services.metering.metering_server import RunningMetering, start_metering
from switchyard.gen.switchyard.v1 import metering_pb2 as pb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as pb_grpc
from switchyard.grpcio import ServerOptions
from tests.conftest import IN_CI, ROOT
from tests.metering.metering_helpers import HOUR, T0, event, setup_path

OVERRIDES = ROOT / "tools" / "focus-validator-overrides.yaml"
MANDATORY = [
    "BilledCost",
    "BillingAccountId",
    "BillingAccountName",
    "BillingCurrency",
    "BillingPeriodEnd",
    "BillingPeriodStart",
    "ChargeCategory",
    "ChargeClass",
    "ChargeDescription",
    "ChargePeriodEnd",
    "ChargePeriodStart",
    "ContractedCost",
    "EffectiveCost",
    "InvoiceIssuerName",
    "ListCost",
    "PricingQuantity",
    "PricingUnit",
    "ProviderName",
    "PublisherName",
    "ServiceCategory",
    "ServiceName",
]
DATETIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
FOCUS_COLUMNS = set(MANDATORY) | set(
    [
        "AvailabilityZone",
        "ChargeFrequency",
        "CommitmentDiscountCategory",
        "CommitmentDiscountId",
        "CommitmentDiscountName",
        "CommitmentDiscountStatus",
        "CommitmentDiscountType",
        "ConsumedQuantity",
        "ConsumedUnit",
        "ContractedUnitPrice",
        "ListUnitPrice",
        "PricingCategory",
        "RegionId",
        "RegionName",
        "ResourceId",
        "ResourceName",
        "ResourceType",
        "SkuId",
        "SkuPriceId",
        "SubAccountId",
        "SubAccountName",
        "Tags",
    ]
)


@pytest.fixture(scope="module")
def focus_site() -> Path:
    """The site-packages of the focus-validator environment, built if missing."""
    built = subprocess.run(
        ["make", "-s", "setup-focus"], cwd=ROOT, capture_output=True, text=True, timeout=900, check=False
    )
    if built.returncode != 0:
        reason = f"cannot build the focus-validator environment: {built.stderr.strip()[-500:]}"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(f"NOTICE: {reason}")
    python = subprocess.run(
        ["make", "-s", "focus-python"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    site = subprocess.run(
        [
            python,
            "-c",
            "import focus_validator, pathlib; print(pathlib.Path(focus_validator.__file__).parents[1])",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return Path(site)


def validate(site: Path, data: Path, out: Path) -> ET.Element:
    """Run focus-validator on `data`; its JUnit report's root (it exits 0 even on failures)."""
    validator = site.parents[2] / "bin" / "focus-validator"
    # It reads its currency list from a path relative to the working directory.
    subprocess.run(
        [
            str(validator),
            "--data-file",
            str(data),
            "--validate-version",
            "1.0",
            "--override-file",
            str(OVERRIDES),
            "--output-type",
            "unittest",
            "--output-destination",
            str(out),
        ],
        cwd=site,
        check=True,
        capture_output=True,
        timeout=300,
    )
    return ET.parse(out).getroot()


def failed(report: ET.Element) -> list[str]:
    return sorted(
        str(case.get("name"))
        for case in report.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    )


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[RunningMetering, pb_grpc.MeteringAsyncStub]]:
    running = await start_metering(f"sqlite:///{tmp_path / 'ledger.db'}", ServerOptions(port=0))
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            yield running, pb_grpc.MeteringStub(channel)
    finally:
        await running.stop(0.5)


async def test_the_focus_export_of_a_real_ledger_passes_focus_validator(
    served: tuple[RunningMetering, pb_grpc.MeteringAsyncStub], focus_site: Path, tmp_path: Path
) -> None:
    _, stub = served
    await setup_path(stub, per_hour=1_000_003)
    # Usage before any price (unpriced), inside a reservation (idle shares), a reversal, a
    # preparation charge, a failed job, and usage crossing a month boundary.
    await stub.RecordUsage(pb.RecordUsageRequest(events=[event("unpriced", T0 - HOUR, 5_000_000)]))
    res = await stub.OpenReservation(
        pb.OpenReservationRequest(idempotency_key="r1", path="cpu-eager@h1", start_unix_us=T0, trial_id="t1")
    )
    events = [event(f"e{i}", T0 + i * 1_000_000, 1_500 + i, job_id=f"j{i}") for i in range(20)]
    events.append(event("bad", T0 + 40_000_000, 900, status="failed", met_quality=False))
    # a generation request (its tokens in x_PromptTokens / x_OutputTokens), later reversed
    events.append(
        event("gen", T0 + 45_000_000, 2_500, model="tiny-lm-gen", prompt_tokens=9, output_tokens=31)
    )
    await stub.RecordUsage(pb.RecordUsageRequest(events=events))
    await stub.ReverseUsage(pb.ReverseUsageRequest(idempotency_key="fix-1", reverses_key="e3", reason="test"))
    await stub.ReverseUsage(
        pb.ReverseUsageRequest(idempotency_key="fix-2", reverses_key="gen", reason="test")
    )
    await stub.CompleteJob(
        pb.CompleteJobRequest(
            job=pb.Job(
                job_id="prep", path="cpu-eager@h1", status="completed", met_quality=True,
                ended_unix_us=T0 + 60_000_000,
            ),
            prepare_us=7_000_000,
        )
    )  # fmt: skip
    await stub.CloseReservation(
        pb.CloseReservationRequest(reservation_id=res.reservation_id, end_unix_us=T0 + HOUR)
    )
    await stub.RecordUsage(
        pb.RecordUsageRequest(events=[event("month-end", T0 + 31 * 24 * HOUR - 1, 2_000_000)])
    )
    export = tmp_path / "focus.csv"
    export.write_bytes(b"".join([c.data async for c in stub.Export(pb.ExportRequest(format="focus"))]))

    report = validate(focus_site, export, tmp_path / "report.xml")
    assert int(report.get("tests", "0")) >= 120
    assert failed(report) == []
    skipped = len(OVERRIDES.read_text().split("overrides:")[1].split("- ")) - 1
    assert int(report.get("skipped", "-1")) == skipped  # only the overridden rules, none other

    with export.open() as f:
        rows = list(csv.DictReader(f))
    header = list(rows[0])
    assert set(MANDATORY) <= set(header)
    assert all(col in FOCUS_COLUMNS or col.startswith("x_") for col in header)  # custom columns: x_
    assert {r["x_CostBasis"] for r in rows} >= {"busy", "idle_share", "prepare", "reversal"}
    for r in rows:
        assert r["BilledCost"] != "" and r["BillingCurrency"] == "USD"
        for col in ("ChargePeriodStart", "ChargePeriodEnd", "BillingPeriodStart", "BillingPeriodEnd"):
            assert DATETIME.match(r[col]), (col, r[col])
        assert r["ChargePeriodStart"] < r["ChargePeriodEnd"]
        assert r["BillingPeriodStart"] <= r["ChargePeriodStart"] < r["BillingPeriodEnd"]
        assert r["ChargeClass"] == ("Correction" if r["x_CostBasis"] == "reversal" else "")
    unpriced = next(r for r in rows if r["x_JobId"] == "unpriced")
    assert (unpriced["BilledCost"], unpriced["x_Unpriced"]) == ("0.000000", "true")
    assert '"x_unpriced": "true"' in unpriced["Tags"]
    assert unpriced["BillingPeriodStart"] == "2025-12-01T00:00:00Z"
    gen = {r["x_CostBasis"]: r for r in rows if r["x_JobId"] == "gen"}
    assert (gen["busy"]["x_PromptTokens"], gen["busy"]["x_OutputTokens"]) == ("9", "31")
    assert (gen["reversal"]["x_PromptTokens"], gen["reversal"]["x_OutputTokens"]) == ("-9", "-31")
    assert {r["x_OutputTokens"] for r in rows if r["x_JobId"] not in ("gen",)} == {"0"}
    month_end = next(r for r in rows if r["x_JobId"] == "month-end")
    assert (month_end["BillingPeriodStart"], month_end["BillingPeriodEnd"]) == (
        "2026-01-01T00:00:00Z",
        "2026-02-01T00:00:00Z",
    )

    # The validator does find what is wrong: an empty BilledCost and a missing mandatory column.
    broken = tmp_path / "broken.csv"
    cols = [c for c in header if c != "BillingAccountId"]
    with broken.open("w", newline="") as f:
        writer = csv.DictWriter(f, cols, extrasaction="ignore")
        writer.writeheader()
        writer.writerows([dict(rows[0], BilledCost=""), *rows[1:]])
    bad = failed(validate(focus_site, broken, tmp_path / "broken.xml"))
    assert any(name.startswith("BilledCost_NotNull") for name in bad), bad
    assert any(name.startswith("BillingAccountId_Required") for name in bad), bad
