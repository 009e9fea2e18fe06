"""What the usage journal costs a request: `Spool.usage` alone against `usage` + `durable()`,
with the journal written to the OS (the default: survives a killed router) and fdatasynced
(`usage_journal_sync = true`: survives a host losing power).

Commits are grouped, so the cost per request falls with concurrency. Measured on the spool
directory given (default: a temporary one), with a sink that takes every batch, the three
modes alternating per concurrency in the same run; printed as µs per request and as ratios to
the journal-less baseline, and written to --out as JSON.

    python -m benchmarks.bench_usage_journal [--dir DIR] [--requests N] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from services.router.spool import Spool
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb


class _Sink:
    async def record_usage(self, request: mpb.RecordUsageRequest) -> None:
        return None

    async def append_audit(self, request: mpb.AppendAuditRequest) -> None:
        return None


def _event(i: int) -> mpb.UsageEvent:
    return mpb.UsageEvent(
        idempotency_key=f"{i:032x}",
        path="cpu",
        model="mlp",
        team="t",
        principal="p",
        kind="request",
        status="completed",
        met_quality=True,
        busy_us=120,
        started_unix_us=i,
        ended_unix_us=i + 1,
        arm="primary",
    )


async def _run(
    folder: Path, requests: int, concurrency: int, durable: bool, sync: bool = False
) -> tuple[float, int]:
    spool = Spool(_Sink(), folder, flush_s=0.25, batch=1000, journal_sync=sync)
    spool.start()
    numbers = iter(range(requests))

    async def client() -> None:
        for i in numbers:
            spool.usage(_event(i))
            if durable:
                await spool.durable()
            else:
                await asyncio.sleep(0)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    await spool.close()
    return elapsed / requests * 1e6, spool.journal_commits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--out", type=Path, default=Path("out/bench/usage_journal.json"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        print(f"{args.requests} usage events per cell; µs per request, and x the no-journal baseline")
        print(f"{'concurrency':>11} {'no journal':>11} {'write':>15} {'fdatasync':>17} {'commits':>8}")
        for c in (1, 8, 64):
            base, _ = asyncio.run(_run(Path(tmp) / f"a{c}", args.requests, c, False))
            write, commits = asyncio.run(_run(Path(tmp) / f"b{c}", args.requests, c, True))
            synced, _ = asyncio.run(_run(Path(tmp) / f"c{c}", args.requests, c, True, sync=True))
            rows.append(
                {
                    "concurrency": c,
                    "base_us": base,
                    "write_us": write,
                    "fdatasync_us": synced,
                    "commits": commits,
                    "write_x": write / base,
                    "fdatasync_x": synced / base,
                }
            )
            print(
                f"{c:>11} {base:>11.1f} {write:>7.1f} (x{write / base:>4.1f}) "
                f"{synced:>8.1f} (x{synced / base:>5.1f}) {commits:>8}"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"requests": args.requests, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
