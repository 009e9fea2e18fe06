"""The finance and admin CLI against a real metering service (in a background thread)."""

from __future__ import annotations

import asyncio
import csv
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.cli import main
from services.metering.ledger import Ledger
from services.metering.metering_server import RunningMetering, start_metering
from services.metering.records import Actor, UsageEvent
from switchyard.grpcio import ServerOptions
from tests.metering.metering_helpers import HOUR, T0


class Background:
    """A metering server on its own event loop, so CLI commands (which run asyncio.run) can call it."""

    def __init__(self, db_url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.running: RunningMetering = asyncio.run_coroutine_threadsafe(
            start_metering(db_url, ServerOptions(port=0)), self.loop
        ).result(60)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.running.stop(0.5), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def served(db_url: str) -> Iterator[Background]:
    bg = Background(db_url)
    try:
        yield bg
    finally:
        bg.stop()


def cli(bg: Background, *args: str) -> int:
    return main([*args, "--metering", bg.running.address, "--as", "finance-bot"])


def seed(ledger: Ledger) -> None:
    events = [
        UsageEvent(
            f"e{i}",
            "cpu@h",
            model="mlp",
            team="search",
            status="completed",
            met_quality=True,
            busy_us=HOUR // 10,
            started_us=T0 + i * HOUR,
            ended_us=T0 + i * HOUR + HOUR // 10,
        )
        for i in range(30)
    ]
    events.append(UsageEvent("early", "cpu@h", busy_us=10, started_us=T0 - HOUR, ended_us=T0 - HOUR + 10))
    ledger.record_usage(events)


def test_finance_cli_end_to_end(
    served: Background, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli(served, "prices", "set", "cpu", "1.250000", "--currency", "USD", "--from", "2026-01-01") == 0
    assert "cpu@" in capsys.readouterr().out
    assert cli(served, "prices", "set", "cpu", "1.0000001") == 2  # beyond micro-units: refused, not rounded
    assert "more than 6 decimals" in capsys.readouterr().err
    served.running.ledger.register_path(Actor("test"), "cpu@h", "cpu", "c", "cpu", "h")
    seed(served.running.ledger)

    assert cli(served, "ledger", "report", "--by", "path,day", "--format", "json") == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 3  # the unpriced hour before the price, then two days
    unpriced = next(r for r in rows if r["unpriced_events"])
    assert unpriced["total_micros"] == 0 and unpriced["day"] == "2025-12-31"
    priced = [r for r in rows if not r["unpriced_events"]]
    assert sum(r["total_micros"] for r in priced) == 30 * 125_000 and priced[0]["jobs_completed"] == 24
    assert (
        cli(served, "ledger", "report", "--by", "path", "--since", "2026-01-01", "--until", "2026-01-02") == 0
    )
    table = capsys.readouterr().out
    assert "cpu@h" in table and "3.000000" in table and "0.125000" in table  # 24 jobs x 0.125
    assert cli(served, "ledger", "report", "--by", "colour") == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err

    focus = tmp_path / "focus.csv"
    assert cli(served, "ledger", "export", "--format", "focus", "-o", str(focus)) == 0
    with focus.open() as fh:
        exported = list(csv.DictReader(fh))
    assert len(exported) == 31 and {r["ServiceCategory"] for r in exported} == {"AI and Machine Learning"}
    assert sorted(r["BilledCost"] for r in exported)[:2] == ["0.000000", "0.125000"]
    assert [r["x_Unpriced"] for r in exported].count("true") == 1  # billed 0, flagged unpriced
    page = tmp_path / "report.html"
    assert cli(served, "ledger", "html", "-o", str(page)) == 0
    html = page.read_text()
    assert "<svg" in html and "cpu@h" in html and "unpriced" in html and "<script" not in html

    assert cli(served, "principals", "create", "carol", "--team", "search") == 0
    assert cli(served, "roles", "grant", "carol", "ledger:read", "--scope", "team:search") == 0
    assert cli(served, "keys", "create", "carol") == 0
    out = capsys.readouterr().out
    key = out.split("key (shown once, store it now): ")[1].split()[0]
    assert served.running.ledger.access.authenticate(key).principal.name == "carol"
    assert cli(served, "keys", "revoke", key.split(".")[0]) == 0
    assert cli(served, "roles", "revoke", "carol", "ledger:read", "--scope", "team:search") == 0
    assert cli(served, "roles", "revoke", "carol", "ledger:read", "--scope", "team:search") == 1
    assert cli(served, "ledger", "reverse", "e3", "--reason", "customer credit") == 0
    assert "reversal reversal:e3 recorded: -0.125000 USD" in capsys.readouterr().out
    assert cli(served, "ledger", "reverse", "nope", "--reason", "x") == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    assert cli(served, "audit", "verify") == 0
    assert "audit chain OK" in capsys.readouterr().out
    assert cli(served, "audit", "query", "--action", "price.set") == 0
    assert "finance-bot price.set price/cpu" in capsys.readouterr().out


def test_metering_serve_command_serves_and_drains_on_sigterm(db_url: str) -> None:
    """`switchyard metering serve` as an operator runs it; PostgreSQL comes from SWITCHYARD_DATABASE_URL."""
    import os
    import signal
    import subprocess
    import sys

    import grpc

    from switchyard.gen.switchyard.v1 import metering_pb2 as pb
    from switchyard.gen.switchyard.v1 import metering_pb2_grpc as pb_grpc

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root))
    args = [sys.executable, "-m", "clients.cli", "metering", "serve", "--port", "0"]
    if db_url.startswith("sqlite"):
        args += ["--db", db_url]
    else:
        env["SWITCHYARD_DATABASE_URL"] = db_url
    proc = subprocess.Popen(
        args, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        # Other announcements (the metrics endpoint) may come first; the address line is the one.
        line = ""
        for _ in range(5):
            line = proc.stdout.readline()
            if line.startswith("metering serving on ") or not line:
                break
        assert line.startswith("metering serving on "), line
        address = line.split()[-1]
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.MeteringStub(channel)
            price = stub.SetPrice(
                pb.SetPriceRequest(price=pb.Price(price_key="k", micros_per_hour=5, currency="EUR")),
                timeout=30,
            )
            assert price.version.startswith("k@")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
