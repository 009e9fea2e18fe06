"""The ledger's domain facade: one method per operation, one transaction per call.

Every write runs in a single transaction together with its audit row, so a call is all or
nothing, retried when it lost a race with another writer (services/metering/transactions.py).
Methods are synchronous; the gRPC servicer runs them in worker threads.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Connection

from services.metering import (
    audit,
    auditkey,
    jobs,
    limit_changes,
    reports,
    reservations,
    route_changes,
    rowmac,
    statefiles,
    usage,
    witness_client,
)
from services.metering.db import Engines, make_engines, migrate
from services.metering.ledger_access import LedgerAccess
from services.metering.ledger_audit import AuditTrail
from services.metering.records import Actor, JobCostInfo, JobInfo, ReservationInfo, UsageEvent, UsageResult
from services.metering.transactions import Transactions, now_us

log = logging.getLogger(__name__)


# `anchor_path` left out: the default for the database (auditkey.default_anchor).
DEFAULT_ANCHOR = Path("<default>")


class Ledger:
    """Owns the engines and their transactions; safe to share between threads. Usage, reservations,
    jobs, prices, paths, reports, trials and route changes here; its parts share its
    transactions (`tx`): `access` (principals, keys, roles, authenticate; ledger_access.py) and
    `audit` (the audit chain, the anchor and the witness; ledger_audit.py)."""

    def __init__(
        self,
        engines: Engines,
        clock: Callable[[], int] = now_us,
        audit_key: bytes | None = None,
        anchor_path: Path | None = DEFAULT_ANCHOR,
    ) -> None:
        self.engines = engines
        statefiles.protect_sqlite(engines.url)
        key = audit_key if audit_key is not None else auditkey.load_key(engines.url)
        self.tx = Transactions(engines, key, clock)
        default = anchor_path == DEFAULT_ANCHOR
        anchor = auditkey.default_anchor(engines.url) if default else anchor_path
        self.access = LedgerAccess(self.tx)
        self.audit = AuditTrail(self.tx, anchor, witness_client.WitnessClient.from_env())

    @classmethod
    def open(
        cls,
        url: str | None = None,
        run_migrations: bool = True,
        audit_key: bytes | None = None,
        anchor_path: Path | None = DEFAULT_ANCHOR,
    ) -> Ledger:
        engines = make_engines(url)
        if run_migrations:
            migrate(engines.url)
        ledger = cls(engines, audit_key=audit_key, anchor_path=anchor_path)
        legacy = ledger.tx.write(rowmac.adopt_legacy_lines)  # once per ledger (rowmac.py)
        if legacy:
            log.warning(
                "%d ledger lines from before their MACs (migration 0013) recorded in the chain", legacy
            )
        return ledger

    def close(self) -> None:
        self.engines.dispose()

    # -- usage and cost -----------------------------------------------------------------
    def record_usage(self, events: Sequence[UsageEvent] | usage.CheckedBatch) -> UsageResult:
        """Store a batch of usage events (or one already through `usage.check_batch`)."""
        batch = events if isinstance(events, usage.CheckedBatch) else usage.check_batch(events)
        return self.tx.write(lambda conn, now: usage.store_batch(conn, batch, now))

    def reverse_usage(self, actor: Actor, key: str, reverses: str, reason: str) -> tuple[Any, bool]:
        def run(conn: Connection, now: int) -> tuple[Any, bool]:
            row, duplicate = usage.reverse_usage(conn, key, reverses, reason, now)
            if not duplicate:
                detail = {"reverses": reverses, "reason": reason, "amount_micros": row.amount_micros}
                audit.append(conn, actor, "usage.reverse", f"line/{reverses}", "ok", now, detail)
            return row, duplicate

        return self.tx.write(run)

    def set_price(
        self,
        actor: Actor,
        key: str,
        micros_per_hour: int,
        currency: str,
        effective_us: int,
        example: bool = False,
    ) -> Any:
        def run(conn: Connection, now: int) -> Any:
            when = effective_us or now
            row = reservations.set_price(conn, key, micros_per_hour, currency, when, now, example)
            detail = {"micros_per_hour": micros_per_hour, "currency": currency, "version": row.version}
            if example:
                detail["example"] = True
            detail["unchanged"] = row.created_us != now
            audit.append(conn, actor, "price.set", f"price/{key}", "ok", now, detail)
            return row

        return self.tx.write(run)

    def register_path(
        self, actor: Actor, path: str, backend: str, resource_class: str, price_key: str, host: str
    ) -> Any:
        def run(conn: Connection, now: int) -> Any:
            row = reservations.register_path(conn, path, backend, resource_class, price_key, host, now)
            if row.created_us == now:
                detail = {"price_key": price_key, "resource_class": resource_class}
                audit.append(conn, actor, "path.register", f"path/{path}", "ok", now, detail)
            return row

        return self.tx.write(run)

    def list_paths(self) -> list[tuple[Any, bool]]:
        now = int(time.time() * 1_000_000)
        return self.tx.read(lambda conn: reservations.list_paths(conn, now))

    def open_reservation(
        self, actor: Actor, key: str, path: str, start_us: int, trial_id: str
    ) -> ReservationInfo:
        return self.tx.write(
            lambda conn, now: reservations.open_reservation(conn, key, path, start_us, trial_id)
        )

    def close_reservation(self, actor: Actor, rid: str, end_us: int) -> ReservationInfo:
        return self.tx.write(lambda conn, now: reservations.close_reservation(conn, rid, end_us or now, now))

    def complete_job(self, outcome: JobInfo, prepare_us: int) -> JobInfo:
        """`outcome.ended_us` 0: now."""
        return self.tx.write(
            lambda conn, now: jobs.complete_job(
                conn, dataclasses.replace(outcome, ended_us=outcome.ended_us or now), prepare_us
            )
        )

    def job_cost(self, job_id: str) -> JobCostInfo:
        return self.tx.read(lambda conn: jobs.job_cost(conn, job_id))

    def cost_report(
        self, group_by: Sequence[str], since_us: int, until_us: int, trial_id: str = ""
    ) -> list[reports.CostRow]:
        return reports.cost_report(
            self.engines.read, group_by, since_us, until_us, trial_id, self.tx.audit_key
        )

    def export(self, fmt: str, since_us: int, until_us: int) -> Iterator[bytes]:
        return reports.export(self.engines.read, fmt, since_us, until_us, audit_key=self.tx.audit_key)

    # -- trials -------------------------------------------------------------------------
    def record_trial(self, actor: Actor, trial: jobs.TrialUpdate) -> None:
        self.tx.write(lambda conn, now: jobs.record_trial(conn, actor, trial, now))

    def trial(self, trial_id: str) -> Any:
        return self.tx.read(lambda conn: jobs.get_trial(conn, trial_id))

    # -- route changes ------------------------------------------------------------------
    def save_route_change(
        self, actor: Actor, fleet: str, model: str, route_json: str | None, previous_json: str = ""
    ) -> Any:
        return self.tx.write(
            lambda conn, now: route_changes.save(conn, actor, fleet, model, route_json, previous_json, now)
        )

    def route_changes(self, fleet: str) -> list[Any]:
        return self.tx.read(lambda conn: route_changes.latest(conn, fleet))

    # -- per-principal limits, shared by a fleet of routers ------------------------------
    def save_limit_change(self, actor: Actor, fleet: str, change: limit_changes.PrincipalLimit) -> Any:
        return self.tx.write(lambda conn, now: limit_changes.save(conn, actor, fleet, change, now))

    def limit_changes(self, fleet: str) -> list[Any]:
        return self.tx.read(lambda conn: limit_changes.latest(conn, fleet))
