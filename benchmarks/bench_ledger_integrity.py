"""The cost of the ledger's integrity checks on ingest and on authentication, same run.

Ingest: usage events/s through an in-process metering service (SQLite file, gRPC RecordUsage
batches) in two configurations, interleaved `rounds` times, best of each compared:
  - plain: no witness, the anchor every 10 s (the default);
  - witnessed: a witness process (services/witness) countersigning the head and the anchor
    written every 0.05 s (200 times the default rate, to make its cost visible).
Row MACs are not on the ingest path (ledger lines carry no MAC yet); they are checked when a
key authenticates, so the run also times `access.authenticate` and the MAC checks inside it
(`rowmac.key_ok` + `rowmac.binding_ok` for one key and its bindings).

Usage: SWITCHYARD_SECURITY_INSECURE=true python benchmarks/bench_ledger_integrity.py
       [--events 5000] [--batch 500] [--rounds 2]
Writes out/bench/ledger_integrity.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("SWITCHYARD_SECURITY_INSECURE", "true")
os.environ.setdefault("SWITCHYARD_AUDIT_KEY", "b" * 48)

from benchmarks.bench_ledger import PATH, T0, make_batches, send_all  # noqa: E402
from benchmarks.common import write_report  # noqa: E402
from services.metering import access, rowmac  # noqa: E402
from services.metering.ledger import Ledger  # noqa: E402
from services.metering.metering_server import start_metering  # noqa: E402
from services.metering.records import Actor  # noqa: E402
from services.metering.schema import BINDINGS, KEYS  # noqa: E402
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


async def ingest(folder: Path, events: int, batch: int, witness: tuple[str, str] | None) -> dict[str, Any]:
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
            t0 = time.perf_counter()
            accepted, _ = await send_all(stub, batches, 2)
            seconds = time.perf_counter() - t0
            verdict = await stub.VerifyAudit(pb.VerifyAuditRequest())
    finally:
        await running.stop(0.5)
    assert accepted == events and verdict.ok, (accepted, verdict)
    return {"events": events, "seconds": seconds, "events_per_s": events / seconds}


def auth_costs(folder: Path, n: int) -> dict[str, float]:
    led = Ledger.open(f"sqlite:///{folder / 'auth.db'}", anchor_path=None)
    try:
        actor = Actor("bench", "bench")
        led.create_principal(actor, "alice", "user", "")
        for scope in ("model:a", "model:b", "*"):
            led.grant_role(actor, "alice", "infer", scope)
        key = led.create_key(actor, "alice", 0).key
        t0 = time.perf_counter()
        for _ in range(n):
            led.authenticate(key)
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

        mac_us = led.read(macs)
        assert access.AUTH_FAILED
    finally:
        led.close()
    return {"authenticate_us": auth_us, "row_macs_us": mac_us, "mac_share": mac_us / auth_us}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="bench-integrity-"))
    proc, url, public = start_witness(folder / "witness")
    try:
        plain, witnessed = [], []
        for _ in range(args.rounds):
            plain.append(await ingest(folder, args.events, args.batch, None))
            witnessed.append(await ingest(folder, args.events, args.batch, (url, public)))
    finally:
        proc.terminate()
        proc.wait(10)
    best_plain = max(r["events_per_s"] for r in plain)
    best_witnessed = max(r["events_per_s"] for r in witnessed)
    return {
        "ingest": {
            "plain": plain,
            "witnessed_anchor_every_0.05s": witnessed,
            "ratio_witnessed_over_plain": best_witnessed / best_plain,
        },
        "authenticate": auth_costs(folder, args.auth_calls),
        "args": vars(args),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--auth-calls", type=int, default=2000)
    report = asyncio.run(main_async(parser.parse_args()))
    print(report["ingest"]["ratio_witnessed_over_plain"], report["authenticate"])
    write_report("ledger_integrity", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
