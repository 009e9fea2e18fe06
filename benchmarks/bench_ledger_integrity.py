"""The cost of the ledger's integrity checks on ingest, on the routers' reads of limits, and of
generation's limit check per request, each against a baseline measured in the same run.

Ingest: usage events/s through an in-process metering service (SQLite file, gRPC RecordUsage
batches) in five configurations, run in every round in a rotated order, `rounds` rounds:
  - plain: line MACs on (as shipped), no witness, the anchor every 10 s (the default);
  - plain (A/A): the same again, so the ratios below can be read against the run's own noise;
  - no line MACs: as plain, but `rowmac.line_signer` swapped, in this process only, for one
    that returns a constant 64-character string: the same code path and row size, without the
    HMAC-SHA256 over each line's fields;
  - witnessed: line MACs on, a witness process (services/witness) countersigning the head and
    the anchor written every 0.05 s (200 times the default rate, to make its cost visible);
  - witnessed, no line MACs.
The line MACs' own time is also taken apart: `rowmac.line_signer` over as many line tuples as
the run ingests. Authentication: `access.authenticate` and the MAC checks inside it
(`rowmac.key_ok` + `rowmac.binding_ok` for one key and its bindings). Limits: the in-force
read the routers poll (`limit_changes.latest`, MAC checked per row) against the same query
without the check (`route_changes.newest_per`), for `--principals` principals. Generation:
the router's per-request limit check (`Admission.principal_slot`: a token from the principal's
bucket and an in-flight slot, what `generate` takes for each of a completion's `n` choices)
against an empty `with` block.

Usage: SWITCHYARD_SECURITY_INSECURE=true python benchmarks/bench_ledger_integrity.py
       [--events 5000] [--batch 500] [--rounds 3]
Writes out/bench/ledger_integrity.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("SWITCHYARD_SECURITY_INSECURE", "true")
os.environ.setdefault("SWITCHYARD_AUDIT_KEY", "b" * 48)

from benchmarks.bench_ledger import PATH, T0, make_batches, send_all  # noqa: E402
from benchmarks.common import write_report  # noqa: E402
from services.metering import access, limit_changes, route_changes, rowmac  # noqa: E402
from services.metering.ledger import Ledger  # noqa: E402
from services.metering.metering_server import start_metering  # noqa: E402
from services.metering.records import Actor  # noqa: E402
from services.metering.schema import BINDINGS, KEYS, LIMIT_CHANGES  # noqa: E402
from services.router.admission import Admission, Limit  # noqa: E402
from services.router.auth import Identity  # noqa: E402
from switchyard.gen.switchyard.v1 import metering_pb2 as pb  # noqa: E402
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as pb_grpc  # noqa: E402
from switchyard.grpcio import ServerOptions  # noqa: E402
from tests.metering.metering_helpers import price_paths  # noqa: E402


def start_witness(folder: Path) -> tuple[subprocess.Popen[str], str, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.witness", "--dir", str(folder), "--port", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    words = proc.stdout.readline().split()
    return proc, f"http://{words[3]}", words[5]


@contextlib.contextmanager
def line_macs(on: bool) -> Iterator[None]:
    """Line MACs as shipped, or (off) a constant in their place: this process only."""
    real = rowmac.line_signer
    if not on:
        rowmac.line_signer = lambda conn: lambda values: "0" * 64
    try:
        yield
    finally:
        rowmac.line_signer = real


async def ingest(
    folder: Path, events: int, batch: int, witness: tuple[str, str] | None, macs: bool = True
) -> dict[str, Any]:
    name = uuid.uuid4().hex[:6]
    os.environ["SWITCHYARD_AUDIT_ANCHOR"] = str(folder / f"anchor-{name}" / "head.json")
    os.environ["SWITCHYARD_AUDIT_ANCHOR_S"] = "0.05" if witness else "10"
    os.environ["SWITCHYARD_AUDIT_LOG"] = f"bench-{name}"  # one log per ledger at the witness
    for var in ("SWITCHYARD_AUDIT_WITNESS", "SWITCHYARD_AUDIT_WITNESS_KEY"):
        os.environ.pop(var, None)
    if witness:
        os.environ["SWITCHYARD_AUDIT_WITNESS"], os.environ["SWITCHYARD_AUDIT_WITNESS_KEY"] = witness
    running = await start_metering(f"sqlite:///{folder / f'{name}.db'}", ServerOptions(port=0))
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = pb_grpc.MeteringStub(channel)
            actor = pb.Actor(principal="bench", source="benchmarks/bench_ledger_integrity.py")
            await price_paths(
                stub, "bench", [PATH], per_hour=7200, resource_class="", since_us=T0, actor=actor
            )
            batches = make_batches(f"ev-{name}", events, batch)
            with line_macs(macs):
                t0 = time.perf_counter()
                accepted, _ = await send_all(stub, batches, 2)
                seconds = time.perf_counter() - t0
            verdict = await stub.VerifyAudit(pb.VerifyAuditRequest())
    finally:
        await running.stop(0.5)
    # without line MACs verify names the lines (problem `row`); the chain itself must hold
    assert accepted == events and (verdict.ok or (not macs and verdict.problem == "row")), verdict
    return {"events": events, "seconds": seconds, "events_per_s": events / seconds}


def sign_cost(folder: Path, n: int) -> dict[str, float]:
    """`rowmac.line_signer` alone over `n` line tuples shaped as the hot path's."""
    led = Ledger.open(f"sqlite:///{folder / 'sign.db'}", anchor_path=None)
    try:

        def run(conn: Any) -> float:
            sign = rowmac.line_signer(conn)
            lines = [
                (f"ev-{i}", "0" * 64, "busy", T0 + i, T0 + i + 1800, 1500, 3, "USD", f"bench@{T0}", "busy",
                 PATH, None, f"ev-{i}", "mlp", "search", "", "primary", "{}", T0, 0, 0)
                for i in range(n)
            ]  # fmt: skip
            t0 = time.perf_counter()
            for line in lines:
                sign(line)
            return time.perf_counter() - t0

        seconds = led.tx.read(run)
    finally:
        led.close()
    return {"lines": n, "seconds": seconds, "us_per_line": seconds / n * 1e6}


def auth_costs(folder: Path, n: int) -> dict[str, float]:
    led = Ledger.open(f"sqlite:///{folder / 'auth.db'}", anchor_path=None)
    try:
        actor = Actor("bench", "bench")
        led.access.create_principal(actor, "alice", "user", "")
        for scope in ("model:a", "model:b", "*"):
            led.access.grant_role(actor, "alice", "infer", scope)
        key = led.access.create_key(actor, "alice", 0).key
        t0 = time.perf_counter()
        for _ in range(n):
            led.access.authenticate(key)
        auth_us = (time.perf_counter() - t0) / n * 1e6

        def macs(conn: Any) -> float:
            krow = conn.execute(KEYS.select()).first()
            brows = conn.execute(BINDINGS.select()).all()
            t = time.perf_counter()
            for _ in range(n):
                rowmac.key_ok(conn, krow)
                for b in brows:
                    rowmac.binding_ok(conn, b)
            return (time.perf_counter() - t) / n * 1e6

        mac_us = led.tx.read(macs)
        assert access.AUTH_FAILED
    finally:
        led.close()
    return {"authenticate_us": auth_us, "row_macs_us": mac_us, "mac_share": mac_us / auth_us}


CONFIGS: dict[str, tuple[bool, bool]] = {  # name -> (line MACs, witness)
    "plain": (True, False),
    "plain_again": (True, False),
    "no_line_macs": (False, False),
    "witnessed": (True, True),
    "witnessed_no_line_macs": (False, True),
}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rates = [r["events_per_s"] for r in runs]
    return {"runs": runs, "best_events_per_s": max(rates), "median_events_per_s": statistics.median(rates)}


async def ingest_rounds(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    proc, url, public = start_witness(folder / "witness")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    try:
        names = list(CONFIGS)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:  # rotated each round
                macs, witnessed = CONFIGS[name]
                witness = (url, public) if witnessed else None
                runs[name].append(await ingest(folder, args.events, args.batch, witness, macs))
    finally:
        proc.terminate()
        proc.wait(10)
    out = {name: summary(r) for name, r in runs.items()}

    def ratio(a: str, b: str) -> dict[str, float]:
        return {
            "best": out[a]["best_events_per_s"] / out[b]["best_events_per_s"],
            "median": out[a]["median_events_per_s"] / out[b]["median_events_per_s"],
        }

    out["ratios"] = {
        "a_a_plain_again_over_plain": ratio("plain_again", "plain"),
        "line_macs_on_over_off": ratio("plain", "no_line_macs"),
        "line_macs_on_over_off_witnessed": ratio("witnessed", "witnessed_no_line_macs"),
        "witnessed_over_plain": ratio("witnessed", "plain"),
        "both_over_neither": ratio("witnessed", "no_line_macs"),
    }
    return out


def per_call_ns(fn: Callable[[], Any], n: int, repeats: int = 5) -> float:
    """The best of `repeats` loops of `n` calls, in ns per call."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / n)
    return best


def limit_reads(folder: Path, principals: int, n: int) -> dict[str, Any]:
    """The routers' poll of a fleet's limits, with the MAC check and without it."""
    led = Ledger.open(f"sqlite:///{folder / 'limits.db'}", anchor_path=None)
    try:
        actor = Actor("bench", "bench")
        for i in range(principals):
            led.save_limit_change(actor, "prod", limit_changes.PrincipalLimit(f"p{i}", 5.0, 10, 4, False))
        key = LIMIT_CHANGES.c.principal_id

        def checked() -> None:
            assert len(led.tx.read(lambda conn: limit_changes.latest(conn, "prod"))) == principals

        def unchecked() -> None:
            assert (
                len(led.tx.read(lambda conn: route_changes.newest_per(conn, LIMIT_CHANGES, key, "prod")))
                == principals
            )

        order = [per_call_ns(f, n, 3) for f in (unchecked, checked, unchecked, checked)]
    finally:
        led.close()
    plain, macs = min(order[0], order[2]), min(order[1], order[3])
    return {
        "principals": principals,
        "unchecked_us": plain / 1e3,
        "checked_us": macs / 1e3,
        "ratio": macs / plain,
    }


def generation_limit_check(n: int) -> dict[str, Any]:
    """`Admission.principal_slot` per request (what `generate` takes per choice) vs an empty
    `with` block, for the default (no limit), a rate limit never reached, and rate + in-flight."""
    who = Identity("p-bench", "bench", "t", "sk_bench", (("infer", "*"),))
    out: dict[str, Any] = {}
    empty = contextlib.nullcontext()

    def baseline() -> None:
        with empty:
            pass

    limits = {
        "unlimited": Limit(),
        "rate": Limit(1e9, 1 << 30, 0),
        "rate_and_in_flight": Limit(1e9, 1 << 30, 64),
    }
    for name, limit in limits.items():
        admission = Admission(None, None, Limit())
        admission.limits.set(who.principal_id, limit)

        def slot(admission: Admission = admission) -> None:
            with admission.principal_slot(who):
                pass

        base, taken = per_call_ns(baseline, n), per_call_ns(slot, n)
        out[name] = {"ns_per_request": taken, "empty_with_ns": base, "added_ns": taken - base}
    out["n16_completion_us"] = out["rate_and_in_flight"]["ns_per_request"] * 16 / 1e3  # one request, n=16
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="bench-integrity-"))
    ingest_report = await ingest_rounds(folder, args)
    signing = sign_cost(folder, args.events)
    best = ingest_report["plain"]["best_events_per_s"]
    signing["share_of_plain_ingest"] = signing["us_per_line"] * 1e-6 * best
    return {
        "ingest": ingest_report,
        "line_signing": signing,
        "authenticate": auth_costs(folder, args.auth_calls),
        "limit_reads": limit_reads(folder, args.principals, 200),
        "generation_limit_check": generation_limit_check(args.checks),
        "config": {
            "database": "sqlite (file, WAL)",
            "metering": "in-process, gRPC on 127.0.0.1",
            "inflight": 2,
        },
        "args": vars(args),
        "host": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--auth-calls", type=int, default=2000)
    parser.add_argument("--principals", type=int, default=100)
    parser.add_argument("--checks", type=int, default=200_000)
    report = asyncio.run(main_async(parser.parse_args()))
    print(json.dumps(report["ingest"]["ratios"], indent=1))
    print(json.dumps({k: report[k] for k in ("line_signing", "authenticate", "limit_reads")}, indent=1))
    print(json.dumps(report["generation_limit_check"], indent=1))
    write_report("ledger_integrity", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
