"""The finance and admin commands behind the CLI: gRPC calls to the metering service.

Every command goes through the service (the ledger's only writer, and the place that audits
changes). Errors print the service's status and message and exit non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import json
import os
import sys
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, TypeVar

import grpc

from clients.finance_html import COST_COLUMNS, cost_cells
from services.metering import money
from switchyard import tls
from switchyard.gen.switchyard.v1 import metering_pb2 as pb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as pb_grpc

T = TypeVar("T")
REPORT_FIELDS = (
    "total_micros",
    "busy_micros",
    "idle_micros",
    "prepare_micros",
    "jobs_completed",
    "jobs_failed",
    "jobs_total",
    "cost_per_completed_job_micros",
    "unpriced_events",
    "currency",
    "prompt_tokens",
    "output_tokens",
    "generation_micros",
    "generation_jobs_completed",
    "generation_jobs_total",
    "cost_per_completed_generation_job_micros",
    "cost_per_million_output_tokens_micros",
    "cost_per_million_prompt_tokens_micros",
    "example_priced_lines",
)
# Shown in the table only when some row has tokens (a ledger without generation keeps its columns).
GENERATION_SHOWN = (
    "prompt_tok", "output_tok", "gen_completed", "per_gen_job", "per_1M_output", "per_1M_prompt",
)  # fmt: skip


class UsageError(ValueError):
    pass


def parse_time(text: str) -> int:
    """'' -> 0; digits -> microseconds; else an ISO date or date-time (UTC unless it says otherwise)."""
    if not text:
        return 0
    if text.isdigit():
        return int(text)
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(f"time {text!r} is neither ISO 8601 nor microseconds since the epoch") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp()) * 1_000_000 + when.microsecond


def parse_money(text: str) -> int:
    """A decimal amount to micro-units, exactly; more than 6 decimals is refused, not rounded."""
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise UsageError(f"amount {text!r} is not a decimal number") from None
    micros = value * 1_000_000
    if micros != micros.to_integral_value():
        raise UsageError(f"amount {text} has more than 6 decimals (micro-units)")
    return int(micros)


def per_job_text(total_micros: int, jobs: int) -> str:
    """Per job, or per 1,000 / 1,000,000 jobs where one job costs under a micro-unit."""
    from services.metering.money import per_job_text as text

    return text(total_micros, jobs)


def actor(args: argparse.Namespace) -> pb.Actor:
    return pb.Actor(principal=args.actor, source="cli")


def call(args: argparse.Namespace, fn: Callable[[pb_grpc.MeteringAsyncStub], Awaitable[T]]) -> T:
    async def run() -> T:
        # the operator's certificate (or explicit plaintext), and SWITCHYARD_API_KEY if set
        key = os.environ.get("SWITCHYARD_API_KEY", "")
        async with tls.aio_channel(args.metering, api_key=key, expect=tls.METERING) as channel:
            return await fn(pb_grpc.MeteringStub(channel))

    return asyncio.run(run())


def guarded(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except UsageError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except grpc.aio.AioRpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1

    return wrapper


def serve(args: argparse.Namespace) -> int:
    from services.metering import metering_metrics as metrics
    from services.metering.metering_server import start_metering
    from switchyard import metrics_endpoint as prometheus
    from switchyard import telemetry
    from switchyard.grpcio import ServerOptions, run_service, stop_signal

    telemetry.setup(telemetry.TelemetryConfig.from_env("switchyard-metering"))
    metrics_port = prometheus.metrics_port(args.metrics_port)

    async def run() -> None:
        stop = stop_signal()  # before the address is announced: see stop_signal
        running = await start_metering(args.db, ServerOptions(host=args.host, port=args.port))
        servicer = running.servicer
        watch = running.ledger.tx.watch
        collectors = [metrics.collector(servicer.stats, servicer.write_queue_depth, lambda: watch.failures)]
        with prometheus.serving(collectors, args.host, metrics_port, "metering"):
            print(f"metering serving on {running.address}", flush=True)
            await running.serve_until_signal(stop)

    run_service(run())
    return 0


def migrate(args: argparse.Namespace) -> int:
    from services.metering.db import migrate as run_migrations

    run_migrations(args.db, runtime_role=args.runtime_role)
    return 0


def fetch_report(args: argparse.Namespace, group_by: list[str]) -> list[dict[str, Any]]:
    req = pb.CostReportRequest(group_by=group_by, since_unix_us=parse_time(args.since))
    req.until_unix_us = parse_time(args.until)
    req.trial_id = getattr(args, "trial", "")
    req.actor.CopyFrom(actor(args))
    resp = call(args, lambda stub: stub.CostReport(req))
    return [dict(r.group) | {f: getattr(r, f) for f in REPORT_FIELDS} for r in resp.rows]


@guarded
def report(args: argparse.Namespace) -> int:
    group_by = [g.strip() for g in args.by.split(",") if g.strip()]
    rows = fetch_report(args, group_by)
    if args.format == "json":
        print(json.dumps(rows, indent=2))
        return 0
    columns = [*group_by, *REPORT_FIELDS]
    if args.format == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        print(out.getvalue(), end="")
        return 0
    shown = [*group_by, *COST_COLUMNS, "per_completed", "unpriced"]
    table = [
        [
            *(str(r.get(g, "")) for g in group_by),
            *cost_cells(r),
            per_job_text(r["total_micros"], r["jobs_completed"]) if r["jobs_completed"] else "n/a",
            str(r["unpriced_events"]),
        ]
        for r in rows
    ]
    if any(r["prompt_tokens"] or r["output_tokens"] for r in rows):
        shown += GENERATION_SHOWN
        for line, r in zip(table, rows, strict=True):
            line += generation_cells(r)
    widths = [max(len(h), *(len(row[i]) for row in table)) if table else len(h) for i, h in enumerate(shown)]
    print("  ".join(h.ljust(w) for h, w in zip(shown, widths, strict=True)))
    for row in table:
        print(
            "  ".join(
                c.rjust(w) if i >= len(group_by) + 1 else c.ljust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    if any(r["unpriced_events"] for r in rows):
        print("note: unpriced usage exists (no price in force); it is not included in the totals above")
    if example := sum(r["example_priced_lines"] for r in rows):
        print(
            f"note: {example} lines charged at the example price book (`switchyard prices set` replaces it)"
        )
    return 0


def generation_cells(r: dict[str, Any]) -> list[str]:
    """Tokens and the cost of generation: per completed generation job, per million output and
    prompt tokens, each exact (services/metering/money.py) or "n/a" without a divisor."""
    from services.metering.money import per_million_tokens_text

    cost, currency, jobs = r["generation_micros"], r["currency"], r["generation_jobs_completed"]
    return [
        str(r["prompt_tokens"]),
        str(r["output_tokens"]),
        str(jobs),
        per_job_text(cost, jobs) if jobs else "n/a",
        per_million_tokens_text(cost, r["output_tokens"], currency) if r["output_tokens"] > 0 else "n/a",
        per_million_tokens_text(cost, r["prompt_tokens"], currency) if r["prompt_tokens"] > 0 else "n/a",
    ]


@guarded
def export(args: argparse.Namespace) -> int:
    req = pb.ExportRequest(
        format=args.format, since_unix_us=parse_time(args.since), until_unix_us=parse_time(args.until)
    )
    req.actor.CopyFrom(actor(args))

    async def run(stub: pb_grpc.MeteringAsyncStub) -> int:
        # Small synchronous writes between network chunks; a CLI has nothing else to run meanwhile.
        sink = sys.stdout.buffer if args.output == "-" else open(args.output, "wb")  # noqa: SIM115, ASYNC230
        size = 0
        try:
            async for chunk in stub.Export(req):
                sink.write(chunk.data)
                size += len(chunk.data)
        finally:
            if sink is not sys.stdout.buffer:
                sink.close()
        return size

    size = call(args, run)
    if args.output != "-":
        print(f"wrote {size} bytes ({args.format}) to {args.output}", file=sys.stderr)
    return 0


@guarded
def html(args: argparse.Namespace) -> int:
    from clients.finance_html import render

    by_day = fetch_report(args, ["path", "day"])
    by_path = fetch_report(args, ["path"])
    Path(args.output).write_text(render(by_day, by_path, datetime.now(UTC)), encoding="utf-8")
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


@guarded
def reverse(args: argparse.Namespace) -> int:
    key = args.key or f"reversal:{args.line_key}"
    req = pb.ReverseUsageRequest(idempotency_key=key, reverses_key=args.line_key, reason=args.reason)
    req.actor.CopyFrom(actor(args))
    r = call(args, lambda stub: stub.ReverseUsage(req))
    state = "already recorded" if r.duplicate else "recorded"
    print(f"reversal {key} {state}: {money.decimal(r.amount_micros)} {r.currency}".rstrip())
    return 0


@guarded
def audit_verify(args: argparse.Namespace) -> int:
    v = call(args, lambda stub: stub.VerifyAudit(pb.VerifyAuditRequest()))
    if v.ok:
        print(f"audit chain OK: {v.rows_checked} rows checked")
        return 0
    print(f"audit chain BROKEN at seq {v.first_broken_seq}: row {v.problem} ({v.rows_checked} rows checked)")
    return 1


def audit_reanchor(args: argparse.Namespace) -> int:
    """Local, like migrate: the operator's re-anchoring after an investigation."""
    from services.metering.ledger import Ledger
    from services.metering.metering_errors import MeteringError
    from services.metering.records import Actor

    ledger = Ledger.open(args.db, run_migrations=False)
    try:
        seq = ledger.audit.reanchor(Actor(args.actor, "cli audit reanchor"), args.reason)
    except MeteringError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        ledger.close()
    print(f"audit chain re-anchored at seq {seq}; restart metering to resume ledger writes")
    return 0


@guarded
def audit_query(args: argparse.Namespace) -> int:
    req = pb.QueryAuditRequest(action=args.action, principal=args.principal, limit=args.limit)
    req.since_unix_us, req.until_unix_us = parse_time(args.since), parse_time(args.until)
    resp = call(args, lambda stub: stub.QueryAudit(req))
    for r in resp.records:
        when = datetime.fromtimestamp(r.at_unix_us / 1e6, UTC).isoformat()
        print(
            f"{r.seq:>6} {when} {r.actor.principal or '-'} {r.action} {r.resource} {r.outcome}",
            r.detail_json,
        )
    return 0


@guarded
def prices_set(args: argparse.Namespace) -> int:
    price = pb.Price(
        price_key=args.price_key,
        micros_per_hour=parse_money(args.per_hour),
        currency=args.currency,
        effective_from_unix_us=parse_time(args.effective_from),
    )
    req = pb.SetPriceRequest(price=price, actor=actor(args))
    p = call(args, lambda stub: stub.SetPrice(req))
    print(f"price {p.version}: {money.decimal(p.micros_per_hour)} {p.currency}/hour")
    return 0


@guarded
def principals_create(args: argparse.Namespace) -> int:
    req = pb.CreatePrincipalRequest(name=args.name, kind=args.kind, team=args.team)
    req.actor.CopyFrom(actor(args))
    p = call(args, lambda stub: stub.CreatePrincipal(req))
    print(f"principal {p.name} ({p.kind}) id {p.principal_id}")
    return 0


@guarded
def keys_create(args: argparse.Namespace) -> int:
    req = pb.CreateKeyRequest(principal=args.principal, expires_unix_us=parse_time(args.expires))
    req.actor.CopyFrom(actor(args))
    k = call(args, lambda stub: stub.CreateKey(req))
    print(f"key id: {k.key_id}")
    print(f"key (shown once, store it now): {k.key}")
    return 0


@guarded
def keys_revoke(args: argparse.Namespace) -> int:
    req = pb.RevokeKeyRequest(key_id=args.key_id)
    req.actor.CopyFrom(actor(args))
    call(args, lambda stub: stub.RevokeKey(req))
    print(f"revoked {args.key_id}")
    return 0


def _role(args: argparse.Namespace) -> pb.RoleRequest:
    req = pb.RoleRequest(principal=args.principal, role=args.role, scope=args.scope)
    req.actor.CopyFrom(actor(args))
    return req


@guarded
def roles_grant(args: argparse.Namespace) -> int:
    call(args, lambda stub: stub.GrantRole(_role(args)))
    print(f"granted {args.role} on {args.scope} to {args.principal}")
    return 0


@guarded
def roles_revoke(args: argparse.Namespace) -> int:
    call(args, lambda stub: stub.RevokeRole(_role(args)))
    print(f"revoked {args.role} on {args.scope} from {args.principal}")
    return 0
