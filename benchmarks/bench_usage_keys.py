"""Ledger work per router-sized usage batch: random (UUIDv4) versus time-ordered (UUIDv7) keys.

The router sends usage to metering every `usage_flush_s` in small batches, and each batch's
cost lands on the requests being served beside it. A request id becomes the event's
idempotency key and job id, both unique indexes: this measures what the key's shape costs.

For each database (a SQLite file in WAL mode, synchronous=FULL; PostgreSQL at 127.0.0.1:5432
when reachable, in uniquely named databases dropped afterwards) two ledgers are filled with
`--prefill` events, one with each key kind (a ledger that has been running a while, with the
keys it always had). Then batches of `--batch` events, stored as the metering service stores
them (`Ledger.record_usage`, one transaction each), alternate between the two ledgers in
rounds, so the machine's drifting load hits both alike. Prints the median wall and CPU time
per batch and the ratio time-ordered / random, and writes out/bench/usage_keys.json.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_usage_keys.py [--batch 25] [--batches 400]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import postgres_databases, request_usage, write_report  # noqa: E402
from services.metering.ledger import Ledger  # noqa: E402
from services.metering.records import Actor, UsageEvent  # noqa: E402
from services.router.ids import time_ordered_hex  # noqa: E402

PATH = "bench-cpu"
KEYS: dict[str, Callable[[], str]] = {
    "random (uuid4)": lambda: uuid.uuid4().hex,
    "time-ordered (uuid7)": time_ordered_hex,
}


# what the router sends per request, but for its key and times
REQUEST = UsageEvent(idempotency_key="", **request_usage(PATH, "small", "bench", "p-bench", 120))


def events(key: Callable[[], str], n: int) -> list[UsageEvent]:
    """What the router sends per request (its request id is the key and, so, the job id)."""
    now = time.time_ns() // 1000
    return [REQUEST._replace(idempotency_key=key(), started_us=now, ended_us=now + 900) for _ in range(n)]


def open_ledger(url: str) -> Ledger:
    ledger = Ledger.open(url)
    actor = Actor("bench", "benchmark", "", "")
    ledger.set_price(actor, "bench-price", 1_000_000, "USD", 1)
    ledger.register_path(actor, PATH, "cpu", "cpu", "bench-price", "")
    return ledger


def measure(urls: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    ledgers = {kind: open_ledger(url) for kind, url in urls.items()}
    try:
        for kind, ledger in ledgers.items():
            for _ in range(args.prefill // 1000):
                ledger.record_usage(events(KEYS[kind], 1000))
        walls: dict[str, list[float]] = {kind: [] for kind in ledgers}
        cpus: dict[str, list[float]] = {kind: [] for kind in ledgers}
        per_round = max(1, args.batches // args.rounds)
        for r in range(args.rounds):
            for kind in list(ledgers)[r % 2 :] + list(ledgers)[: r % 2]:  # order alternates
                for _ in range(per_round):
                    batch = events(KEYS[kind], args.batch)
                    w0, c0 = time.perf_counter(), time.process_time()
                    ledgers[kind].record_usage(batch)
                    cpus[kind].append(time.process_time() - c0)
                    walls[kind].append(time.perf_counter() - w0)
    finally:
        for ledger in ledgers.values():
            ledger.close()
    out: dict[str, Any] = {}
    for kind in ledgers:
        out[kind] = {
            "batches": len(walls[kind]),
            "wall_ms_median": round(statistics.median(walls[kind]) * 1e3, 3),
            "cpu_ms_median": round(statistics.median(cpus[kind]) * 1e3, 3),
        }
    rnd, seq = (out[k] for k in KEYS)
    out["ratio_wall_time_ordered_vs_random"] = round(seq["wall_ms_median"] / rnd["wall_ms_median"], 3)
    out["ratio_cpu_time_ordered_vs_random"] = round(seq["cpu_ms_median"] / rnd["cpu_ms_median"], 3)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--batch", type=int, default=25, help="events per batch (router: ~rate x flush)")
    parser.add_argument("--batches", type=int, default=400, help="batches per key kind")
    parser.add_argument("--prefill", type=int, default=50_000, help="events in each ledger beforehand")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--no-postgres", action="store_true")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        urls = {kind: f"sqlite:///{tmp}/ledger-{i}.db" for i, kind in enumerate(KEYS)}
        results["sqlite (WAL, synchronous=FULL)"] = measure(urls, args)
    if not args.no_postgres:
        with postgres_databases("sy_keys", len(KEYS)) as pg_urls:
            if pg_urls is not None:
                results["postgresql"] = measure(dict(zip(KEYS, pg_urls, strict=True)), args)
    config = {
        "batch_events": args.batch,
        "batches_per_key_kind": args.batches,
        "prefill_events_per_ledger": args.prefill,
        "rounds": args.rounds,
        "event": "one router request: key = job id = request id; 1 journal line + 1 job",
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    print(
        f"ledger work per usage batch of {args.batch} events ({args.batches} batches per key kind, "
        f"ledgers prefilled with {args.prefill} events, {args.rounds} alternating rounds):"
    )
    for database, r in results.items():
        rnd, seq = (r[k] for k in KEYS)
        print(
            f"  {database}: random keys {rnd['wall_ms_median']:.3f} ms wall / "
            f"{rnd['cpu_ms_median']:.3f} ms CPU | time-ordered {seq['wall_ms_median']:.3f} ms / "
            f"{seq['cpu_ms_median']:.3f} ms | ratio "
            f"wall x{r['ratio_wall_time_ordered_vs_random']}, CPU x{r['ratio_cpu_time_ordered_vs_random']}"
        )
    write_report("usage_keys", {"config": config, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
