"""The finance side of the main job, through the metering service only (the ledger's writer).

Prices for the local paths, reservations that frame the job's window (so idle reserved time
shows up as idle lines, not as nothing), and the cost report per path: cost per completed
job, the idle share and generation jobs' cost per million output tokens, in integer
micro-units as the ledger keeps them.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from clients.local_cluster.local_routes import PATH_IDS
from services.metering.money import decimal, per_job_text
from switchyard import tls
from switchyard.errors import FailedPrecondition
from switchyard.field_copy import copy_fields
from switchyard.gen.switchyard.v1 import executor_pb2, executor_pb2_grpc, metering_pb2, metering_pb2_grpc

ACTOR = metering_pb2.Actor(principal="admin", source="switchyard demo")
# Illustrative list prices for this machine's paths (micro-units per hour): both run on the
# same two CPU cores, so the same price; the trial then compares cost per completed job.
LOCAL_PRICES = {"cpu": 120_000, "xla": 120_000, "cuda": 2_500_000, "tpu": 1_200_000}
CURRENCY = "USD"


class FinanceError(FailedPrecondition):
    """A finance step of the main job did not complete."""


@dataclass(frozen=True)
class PathCost:
    path: str
    jobs_completed: int
    jobs_failed: int
    total_micros: int
    busy_micros: int
    idle_micros: int
    prepare_micros: int
    cost_per_completed_job_micros: int
    unpriced_events: int
    currency: str
    output_tokens: int = 0  # generation jobs' tokens, and their cost per million of them
    cost_per_million_output_tokens_micros: int = 0
    example_priced_lines: int = 0  # charged at the example price book

    @property
    def idle_share(self) -> float:
        return self.idle_micros / self.total_micros if self.total_micros else 0.0


async def _describe(address: str) -> executor_pb2.DescribeResponse | None:
    async with tls.aio_channel(address, expect=tls.EXECUTOR) as channel:
        try:
            return await executor_pb2_grpc.ExecutorControlStub(channel).Describe(
                executor_pb2.DescribeRequest(), timeout=10
            )
        except grpc.aio.AioRpcError:
            return None


async def ensure_prices(
    metering: str, executors: Mapping[str, str], paths: Mapping[str, str], from_us: int | None = None
) -> None:
    """A price in force and a registered path for every executor (audited admin actions).
    `executors` maps backend -> address, `paths` backend -> ledger path id; the prices take
    effect from `from_us`, by default an hour ago (on a cluster with no usage charged yet:
    metering never re-prices a charged line)."""
    from_us = int(time.time() * 1_000_000) - 3_600_000_000 if from_us is None else from_us
    async with tls.aio_channel(metering, expect=tls.METERING) as channel:
        stub = metering_pb2_grpc.MeteringStub(channel)
        for backend, address in executors.items():
            described = await _describe(address)
            price_key = (described.price_key if described else "") or f"local-{backend}"
            await stub.SetPrice(
                metering_pb2.SetPriceRequest(
                    price=metering_pb2.Price(
                        price_key=price_key,
                        micros_per_hour=LOCAL_PRICES.get(backend, 120_000),
                        currency=CURRENCY,
                        effective_from_unix_us=from_us,
                        example=True,  # the example book: reports mark costs charged at it
                    ),
                    actor=ACTOR,
                ),
                timeout=10,
            )
            await stub.RegisterPath(
                metering_pb2.RegisterPathRequest(
                    path_info=metering_pb2.PathInfo(
                        path=paths.get(backend) or PATH_IDS.get(backend, backend),
                        backend=backend,
                        resource_class=(described.resource_class if described else "") or backend,
                        price_key=price_key,
                        host=(described.host if described else "") or "localhost",
                    ),
                    actor=ACTOR,
                ),
                timeout=10,
            )


async def open_reservations(metering: str, paths: Mapping[str, str], run: str, start_us: int) -> list[str]:
    """One reservation per path from `start_us`: the window whose idle time is charged.
    All or none: if one cannot be opened, those already opened are closed again."""
    ids: list[str] = []
    async with tls.aio_channel(metering, expect=tls.METERING) as channel:
        stub = metering_pb2_grpc.MeteringStub(channel)
        try:
            for path in paths.values():
                r = await stub.OpenReservation(
                    metering_pb2.OpenReservationRequest(
                        idempotency_key=f"demo-{run}-{path}", path=path, start_unix_us=start_us, actor=ACTOR
                    ),
                    timeout=10,
                )
                ids.append(r.reservation_id)
        except grpc.aio.AioRpcError:
            await close_reservations(metering, ids)
            raise
    return ids


async def close_reservations(metering: str, reservation_ids: list[str]) -> None:
    end_us = int(time.time() * 1_000_000)
    async with tls.aio_channel(metering, expect=tls.METERING) as channel:
        stub = metering_pb2_grpc.MeteringStub(channel)
        for rid in reservation_ids:
            await stub.CloseReservation(
                metering_pb2.CloseReservationRequest(reservation_id=rid, end_unix_us=end_us, actor=ACTOR),
                timeout=10,
            )


async def report(metering: str, since_us: int) -> list[PathCost]:
    async with tls.aio_channel(metering, expect=tls.METERING) as channel:
        reply = await metering_pb2_grpc.MeteringStub(channel).CostReport(
            metering_pb2.CostReportRequest(group_by=["path"], since_unix_us=since_us, actor=ACTOR), timeout=30
        )
    return [copy_fields(PathCost, row, path=row.group.get("path", "?")) for row in reply.rows]


money = decimal  # micro-units printed exactly: integer division, never a float


def _notes(r: PathCost) -> list[str]:
    """Usage with no price in force is reported as such, never folded in as zero; a cost at
    the example price book is marked as an example, not as finance's figure."""
    notes = [f"{r.unpriced_events} unpriced events"] if r.unpriced_events else []
    return notes + (["example prices"] if r.example_priced_lines else [])


def format_table(rows: list[PathCost]) -> str:
    head = (
        "path",
        "jobs ok",
        "failed",
        "total",
        "busy",
        "idle",
        "prepare",
        "per completed job",
        "idle share",
        "output tokens",
        "per 1M output tokens",
        "",
    )
    body = [
        (
            r.path,
            str(r.jobs_completed),
            str(r.jobs_failed),
            f"{money(r.total_micros)} {r.currency}",
            money(r.busy_micros),
            money(r.idle_micros),
            money(r.prepare_micros),
            # Exact, from the same integers: per job, or per 1,000 / 1,000,000 jobs where one job
            # costs under a micro-unit (0.000000 per job would say nothing).
            per_job_text(r.total_micros, r.jobs_completed, r.currency) if r.jobs_completed else "n/a",
            f"{r.idle_share:.1%}",
            str(r.output_tokens) if r.output_tokens else "-",
            # The ledger's exact integer: generation cost x 10^6 / output tokens.
            f"{money(r.cost_per_million_output_tokens_micros)} {r.currency}" if r.output_tokens else "-",
            # Usage with no price in force is reported as such, never folded in as zero.
            "; ".join(_notes(r)),
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in (head, *body)) for i in range(len(head))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(head, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths).rstrip())
    for row in body:
        lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines) if body else "(no cost lines in this window)"


async def write_html(metering: str, path: Path, since_us: int) -> Path:
    """The ledger's self-contained HTML report, made by the finance tool a person would run
    (`switchyard ledger html`), so the demo shows exactly what that command gives."""
    path.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "clients.cli", "ledger", "html", "-o", str(path)]
    argv += ["--since", str(since_us), "--metering", metering, "--as", "switchyard-demo"]
    # The tool dials metering as this process does: with its certificate, or in plaintext.
    security = tls.current()
    env = dict(os.environ)
    if security.insecure:
        env[tls.INSECURE_ENV] = "true"
    else:
        env[tls.TLS_DIR_ENV] = security.directory
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise FinanceError(
            f"switchyard ledger html failed ({proc.returncode}): {out.decode(errors='replace')}"
        )
    return path
