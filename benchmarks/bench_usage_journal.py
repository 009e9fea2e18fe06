"""What the usage journal costs a request: `Spool.usage` alone against `usage` + `durable()`.

Each request's usage is fsynced to the journal before the router answers (`spool_journal`);
commits are grouped, so the cost per request falls with concurrency. Measured on the spool
directory given (default: a temporary one), with a sink that takes every batch.

    python -m benchmarks.bench_usage_journal [--dir DIR] [--requests N]
"""

from __future__ import annotations

import argparse
import asyncio
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


async def _run(folder: Path, requests: int, concurrency: int, durable: bool) -> tuple[float, int]:
    spool = Spool(_Sink(), folder, flush_s=0.25, batch=1000)
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--requests", type=int, default=4000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        print(f"{'concurrency':>11} {'usage us/req':>13} {'+durable us/req':>16} {'fsyncs':>7}")
        for concurrency in (1, 8, 64):
            base, _ = asyncio.run(_run(Path(tmp) / f"a{concurrency}", args.requests, concurrency, False))
            cost, commits = asyncio.run(_run(Path(tmp) / f"b{concurrency}", args.requests, concurrency, True))
            print(f"{concurrency:>11} {base:>13.1f} {cost:>16.1f} {commits:>7}")


if __name__ == "__main__":
    main()
