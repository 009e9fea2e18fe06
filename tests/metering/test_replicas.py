"""Two metering replicas on one PostgreSQL ledger, writing at the same time.

Both are real servers, running as the runtime database role, sharing the audit key and the
head digest file as a deployment would. At once: the same usage batches go to both, every
line is reversed from both replicas with different keys, reservations are opened on a path
from both and closed on one while usage goes into them on the other, audit rows are
appended on both, and `audit verify` runs on both throughout. Afterwards conservation holds
to the micro-unit and nothing is doubled.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from sqlalchemy import func, select

from services.metering.metering_server import RunningMetering, start_metering
from services.metering.schema import AUDIT, LINES, RESERVATIONS
from switchyard.gen.switchyard.v1 import metering_pb2 as pb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as pb_grpc
from switchyard.grpcio import ServerOptions
from tests.metering.metering_helpers import HOUR, T0, event

pytestmark = pytest.mark.postgres

BATCHES, PER_BATCH, SEEDS, ROUNDS, AUDITS = 16, 40, 60, 8, 60
PER_HOUR = 3_600_000  # 1 micro-unit per millisecond: every idle share is a real amount
RES_LEN = HOUR


@pytest.fixture
async def replicas(
    pg_roles_db: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[list[RunningMetering]]:
    monkeypatch.setenv("SWITCHYARD_AUDIT_KEY", "replica-test-key-" + "0" * 32)
    monkeypatch.setenv("SWITCHYARD_AUDIT_ANCHOR", str(tmp_path / "audit-head.json"))
    monkeypatch.setenv("SWITCHYARD_AUDIT_ANCHOR_S", "0.1")
    running: list[RunningMetering] = []
    try:
        for _ in range(2):
            running.append(await start_metering(pg_roles_db["runtime"], ServerOptions(port=0)))
        yield running
    finally:
        for r in running:
            await r.stop(0.5)


async def outcome(call: Any) -> tuple[str, Any]:
    """'ok' and the reply, or the status code's name and the details."""
    try:
        return "ok", await call
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, exc.details()


async def _verify_all_along(
    both: tuple[Any, Any], stop_verifying: asyncio.Event, verdicts: list[pb.VerifyAuditResponse]
) -> None:
    while not stop_verifying.is_set():
        verdicts.extend(await asyncio.gather(*(s.VerifyAudit(pb.VerifyAuditRequest()) for s in both)))
        await asyncio.sleep(0.02)


async def _usage(both: tuple[Any, Any]) -> list[tuple[str, Any]]:
    out = []
    for n in range(BATCHES):
        start = T0 + 10 * HOUR + n * PER_BATCH * 1000
        evs = [
            event(f"u{n}-{i}", start + i * 1000, 300, path="usage@h1", job_id=f"u{n}-{i}")
            for i in range(PER_BATCH)
        ]
        req = pb.RecordUsageRequest(events=evs)
        out += await asyncio.gather(*(outcome(s.RecordUsage(req)) for s in both))
    return out


async def _reversals(both: tuple[Any, Any]) -> list[tuple[str, Any]]:
    out = []
    for i in range(SEEDS):
        calls = [
            outcome(
                s.ReverseUsage(
                    pb.ReverseUsageRequest(
                        idempotency_key=f"fix-{i}-{n}", reverses_key=f"seed-{i}", reason="race"
                    )
                )
            )
            for n, s in enumerate(both)
        ]
        out += await asyncio.gather(*calls)
    return out


async def _reservations(both: tuple[Any, Any]) -> list[dict[str, Any]]:
    rounds = []
    for r in range(ROUNDS):
        start = T0 + 100 * HOUR + r * 2 * RES_LEN
        opened = await asyncio.gather(
            *(
                outcome(
                    s.OpenReservation(
                        pb.OpenReservationRequest(
                            idempotency_key=f"res-{r}-{n}", path="res@h2", start_unix_us=start
                        )
                    )
                )
                for n, s in enumerate(both)
            )
        )
        winners = [reply for code, reply in opened if code == "ok"]
        rid = winners[0].reservation_id if winners else ""
        evs = [
            event(f"r{r}-{i}", start + i * 60_000_000, 20_000_000, path="res@h2", job_id=f"r{r}-{i}")
            for i in range(30)
        ]
        writer, closer = both[r % 2], both[(r + 1) % 2]
        first, rest = evs[:10], evs[10:]
        await writer.RecordUsage(pb.RecordUsageRequest(events=first))
        results = await asyncio.gather(
            *(outcome(writer.RecordUsage(pb.RecordUsageRequest(events=[ev]))) for ev in rest),
            outcome(
                writer.ReverseUsage(
                    pb.ReverseUsageRequest(idempotency_key=f"rfix-{r}", reverses_key=f"r{r}-0", reason="race")
                )
            ),
            outcome(
                closer.CloseReservation(
                    pb.CloseReservationRequest(reservation_id=rid, end_unix_us=start + RES_LEN)
                )
            ),
        )
        rounds.append({"opened": opened, "rid": rid, "results": results})
    return rounds


async def _audits(both: tuple[Any, Any]) -> list[tuple[str, Any]]:
    calls = [
        outcome(
            both[i % 2].AppendAudit(
                pb.AppendAuditRequest(action="test.append", resource=f"thing/{i}", outcome="ok")
            )
        )
        for i in range(AUDITS)
    ]
    return list(await asyncio.gather(*calls))


def _assert_ledger(replica: RunningMetering, res_out: list[dict[str, Any]]) -> None:
    """The ledger after the race: every key once, conservation per reservation, one audit row per write."""
    ledger = replica.ledger

    def facts(conn: Any) -> dict[str, Any]:
        lines = conn.execute(select(LINES)).all()
        res = conn.execute(select(RESERVATIONS).order_by(RESERVATIONS.c.start_us)).all()
        audit_actions = dict(
            conn.execute(select(AUDIT.c.action, func.count()).group_by(AUDIT.c.action)).all()
        )
        return {"lines": lines, "res": res, "audit": audit_actions}

    got = ledger.tx.read(facts)
    lines, res = got["lines"], got["res"]
    keys = [ln.idempotency_key for ln in lines]
    assert len(keys) == len(set(keys))
    usage_lines = [ln for ln in lines if ln.path == "usage@h1" and ln.basis == "busy"]
    assert len(usage_lines) == SEEDS + BATCHES * PER_BATCH
    reversed_targets = [ln.method for ln in lines if ln.basis == "reversal" and ln.path == "usage@h1"]
    assert sorted(reversed_targets) == sorted(f"reverses seed-{i}" for i in range(SEEDS))
    # Conservation: each reservation's lines sum to its reserved time x price, exactly, and
    # cover every reserved microsecond; reservations on the path never overlap.
    assert len(res) == ROUNDS and all(r.state == "closed" for r in res)
    for prev, nxt in itertools.pairwise(res):
        assert prev.end_us <= nxt.start_us
    for r in res:
        mine = [ln for ln in lines if ln.path == "res@h2" and r.start_us <= ln.at_us <= r.end_us]
        assert r.cost_micros == PER_HOUR * (r.end_us - r.start_us) // HOUR
        assert sum(ln.amount_micros for ln in mine) == r.cost_micros
        assert sum(ln.quantity_us for ln in mine) == r.end_us - r.start_us
    # The audit trail holds every audited write once.
    assert got["audit"].get("test.append") == AUDITS
    assert got["audit"].get("usage.reverse") == SEEDS + sum(
        1 for rnd in res_out if rnd["results"][-2][0] == "ok"
    )


async def test_two_replicas_conserve_cost_and_keep_one_audit_chain(replicas: list[RunningMetering]) -> None:
    async with (
        grpc.aio.insecure_channel(replicas[0].address) as ch_a,
        grpc.aio.insecure_channel(replicas[1].address) as ch_b,
    ):
        a, b = pb_grpc.MeteringStub(ch_a), pb_grpc.MeteringStub(ch_b)
        both = (a, b)
        await a.SetPrice(
            pb.SetPriceRequest(
                price=pb.Price(
                    price_key="std", micros_per_hour=PER_HOUR, currency="USD", effective_from_unix_us=T0
                )
            )
        )
        for path in ("usage@h1", "res@h2"):
            await b.RegisterPath(
                pb.RegisterPathRequest(
                    path_info=pb.PathInfo(path=path, backend="cpu", resource_class="c", price_key="std")
                )
            )
        seeds = [
            event(f"seed-{i}", T0 + i * 1000, 400, path="usage@h1", job_id=f"seed-{i}") for i in range(SEEDS)
        ]
        await a.RecordUsage(pb.RecordUsageRequest(events=seeds))

        stop_verifying = asyncio.Event()
        verdicts: list[pb.VerifyAuditResponse] = []

        verifier = asyncio.create_task(_verify_all_along(both, stop_verifying, verdicts))
        usage_out, reversal_out, res_out, audit_out = await asyncio.gather(
            _usage(both), _reversals(both), _reservations(both), _audits(both)
        )
        stop_verifying.set()
        await verifier
        assert verdicts and all(v.ok for v in verdicts), [v for v in verdicts if not v.ok][:3]

        # Usage: each batch went to both replicas; each event is stored once.
        assert all(code == "ok" for code, _ in usage_out), usage_out
        assert sum(r.accepted for _, r in usage_out) == BATCHES * PER_BATCH
        assert sum(r.duplicates for _, r in usage_out) == BATCHES * PER_BATCH
        # Reversals: each line reversed from both replicas with two keys; exactly one wins.
        codes = [code for code, _ in reversal_out]
        assert codes.count("ok") == SEEDS and codes.count("FAILED_PRECONDITION") == SEEDS, codes
        # Reservations: one opener per round; usage either made it in before the close or was refused.
        for rnd in res_out:
            assert sorted(code for code, _ in rnd["opened"]) == ["FAILED_PRECONDITION", "ok"], rnd["opened"]
            close_code, closed = rnd["results"][-1]
            assert close_code == "ok", closed
            assert {code for code, _ in rnd["results"][:-1]} <= {"ok", "FAILED_PRECONDITION"}
        assert all(code == "ok" for code, _ in audit_out)

        await asyncio.sleep(0.3)  # a digest round after the last write
        final = await asyncio.gather(*(s.VerifyAudit(pb.VerifyAuditRequest()) for s in both))
        assert all(v.ok for v in final), final

    _assert_ledger(replicas[0], res_out)
