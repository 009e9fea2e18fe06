"""RecordUsage: a batch of usage events becomes journal lines and jobs in one transaction.

Idempotency is by the event's key: a key already stored with the same content digest is a
duplicate (counted, not written again); with another digest the whole batch is rejected.
Each event is charged its busy time at the price in force when it started, or stored
unpriced (NULL amount) when no price was in force. Events fall in the reservation given or
the path's reservation covering their start; an event in a closed reservation is refused,
because that reservation's idle lines are already final.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from sqlalchemy import Connection, Table, and_, or_, select, update

from services.metering import costmodel, rowmac
from services.metering.costmodel import Price, PriceBook
from services.metering.metering_errors import BadInput, Conflict, MeteringError, UnknownEntity, WrongState
from services.metering.records import UsageEvent, UsageResult, validate_event
from services.metering.schema import JOBS, LINES, PATHS, PRICES, RESERVATIONS

CHUNK = 900  # bound parameters per IN (...) list, under SQLite's historical limit of 999


LINE_COLUMNS = (*rowmac.LINE_FIELDS, "mac")  # what the hot path inserts: every field, then the MAC
# The key order of the job dicts that _job_rows builds.
JOB_COLUMNS = (
    "job_id", "kind", "path", "model", "model_version", "team", "principal", "trial_id", "arm", "status",
    "met_quality", "started_us", "ended_us",
)  # fmt: skip


def bulk_insert(
    conn: Connection,
    table: Table,
    cols: Sequence[str],
    rows: Sequence[tuple[Any, ...]],
    skip_existing: bool = False,
) -> int:
    """executemany straight to the driver: the hot path skips Core's per-row parameter
    processing, which costs more than the insert itself (see benchmarks/bench_ledger.py).
    With `skip_existing`, rows whose key exists are skipped (ON CONFLICT DO NOTHING, on both
    SQLite and PostgreSQL); returns how many rows were inserted."""
    if not rows:
        return 0
    mark = "?" if conn.dialect.paramstyle == "qmark" else "%s"
    sql = f"INSERT INTO {table.name} ({', '.join(cols)}) VALUES ({', '.join([mark] * len(cols))})"
    if skip_existing:
        sql += " ON CONFLICT DO NOTHING"
    return int(conn.exec_driver_sql(sql, list(rows)).rowcount)


def insert_dicts(
    conn: Connection, table: Table, rows: Sequence[dict[str, Any]], skip_existing: bool = False
) -> int:
    if not rows:
        return 0
    cols = list(rows[0])
    return bulk_insert(conn, table, cols, [tuple(r[c] for c in cols) for r in rows], skip_existing)


def chunks(items: Sequence[str]) -> Iterable[Sequence[str]]:
    for i in range(0, len(items), CHUNK):
        yield items[i : i + CHUNK]


def load_price_book(conn: Connection, price_keys: Iterable[str]) -> PriceBook:
    keys = sorted(set(price_keys))
    rows: list[Any] = []
    for part in chunks(keys):
        rows += conn.execute(select(PRICES).where(PRICES.c.price_key.in_(part))).all()
    forged = [r.version for r in rows if not rowmac.price_ok(conn, r)]
    if forged:  # a price written behind metering's back charges nothing (rowmac.py)
        raise WrongState(
            f"price {forged[0]} fails its MAC: it was written behind metering's back, so usage on "
            f"{forged[0].rpartition('@')[0]} is not charged; check it and set it again "
            "(`switchyard prices set`), and see `switchyard audit verify`"
        )
    return PriceBook(
        Price(r.price_key, r.micros_per_hour, r.currency, r.effective_from_us, r.version) for r in rows
    )


def load_paths(conn: Connection, names: Iterable[str], lock: str = "share") -> dict[str, str]:
    """path -> price key; raises NOT_FOUND naming the first unknown path.

    The path rows are also the lock of what happens on a path: writes that add usage to a
    path take them shared (FOR SHARE, in path order), writes that decide on a path's usage
    as a whole (closing or opening a reservation, reversing a line) exclusively (FOR
    UPDATE), so one never decides on a set of lines another is still adding to. SQLite's
    write transactions are exclusive already (BEGIN IMMEDIATE). `lock=""` reads only.
    """
    wanted = sorted(set(names))
    found: dict[str, str] = {}
    for part in chunks(wanted):
        stmt = select(PATHS).where(PATHS.c.path.in_(part)).order_by(PATHS.c.path)
        if lock:
            stmt = stmt.with_for_update(read=lock == "share")
        for row in conn.execute(stmt):
            if not rowmac.path_ok(conn, row):  # its price key set behind metering's back
                raise WrongState(
                    f"path {row.path} fails its MAC: it was written behind metering's back, so usage "
                    "on it is not charged; see `switchyard audit verify`"
                )
            found[row.path] = row.price_key
    for name in wanted:
        if name not in found:
            raise UnknownEntity(f"unknown path {name!r}; register it first (RegisterPath)")
    return found


@dataclass
class _Window:
    reservation_id: str
    start_us: int
    end_us: int | None
    state: str


def _reservations(conn: Connection, events: Sequence[UsageEvent]) -> dict[str, list[_Window]]:
    paths = sorted({e.path for e in events})
    explicit = sorted({e.reservation_id for e in events if e.reservation_id})
    lo, hi = min(e.started_us for e in events), max(e.started_us for e in events)
    cond = and_(
        RESERVATIONS.c.path.in_(paths),
        RESERVATIONS.c.start_us <= hi,
        or_(RESERVATIONS.c.end_us.is_(None), RESERVATIONS.c.end_us > lo),
    )
    if explicit:
        cond = or_(cond, RESERVATIONS.c.reservation_id.in_(explicit))
    by_path: dict[str, list[_Window]] = {}
    stmt = select(RESERVATIONS.c.reservation_id, RESERVATIONS.c.path, RESERVATIONS.c.start_us)
    stmt = stmt.add_columns(RESERVATIONS.c.end_us, RESERVATIONS.c.state).where(cond)
    for r in conn.execute(stmt):
        by_path.setdefault(r.path, []).append(_Window(r.reservation_id, r.start_us, r.end_us, r.state))
    return by_path


def _match(ev: UsageEvent, windows: list[_Window]) -> str | None:
    if ev.reservation_id:
        win = next((w for w in windows if w.reservation_id == ev.reservation_id), None)
        if win is None:
            raise UnknownEntity(
                f"event {ev.idempotency_key}: no reservation {ev.reservation_id!r} on {ev.path}"
            )
        if ev.started_us < win.start_us:
            raise BadInput(f"event {ev.idempotency_key} started before reservation {win.reservation_id} did")
    else:
        covering = [
            w
            for w in windows
            if w.start_us <= ev.started_us and (w.end_us is None or ev.started_us < w.end_us)
        ]
        if not covering:
            return None
        win = max(covering, key=lambda w: w.start_us)
    if win.state != "open":
        raise WrongState(
            f"event {ev.idempotency_key}: reservation {win.reservation_id} on {ev.path} is closed; "
            "its cost is final, so usage inside it can no longer be recorded"
        )
    return win.reservation_id


def _existing(conn: Connection, keys: list[str]) -> dict[str, str]:
    """The content hash of each key already stored; a stored line that fails its MAC (one
    inserted by SQL to make a real event look like a duplicate) refuses the batch."""
    out: dict[str, str] = {}
    for part in chunks(keys):
        rows = conn.execute(select(LINES).where(LINES.c.idempotency_key.in_(part))).all()
        rowmac.check_lines(conn, rows, "recording usage")
        out.update((r.idempotency_key, r.content_hash) for r in rows)
    return out


def _job_rows(events: Sequence[UsageEvent]) -> dict[str, dict[str, Any]]:
    """The jobs these events describe, merged per job id (a job may span several events)."""
    jobs: dict[str, dict[str, Any]] = {}
    for ev in events:
        job_id = ev.effective_job_id
        if job_id is None:
            continue
        job = jobs.get(job_id)
        if job is None:
            jobs[job_id] = job = {
                "job_id": job_id,
                "kind": "request" if ev.kind == "prepare" else ev.kind,
                "path": ev.path,
                "model": ev.model,
                "model_version": ev.model_version,
                "team": ev.team,
                "principal": ev.principal,
                "trial_id": ev.trial_id,
                "arm": ev.arm,
                "status": "running",
                "met_quality": False,
                "started_us": ev.started_us,
                "ended_us": ev.ended_us or ev.started_us,
            }
        else:  # a later event of the same job: widen its span
            if job["path"] != ev.path:
                raise BadInput(
                    f"job {job_id} has usage on {job['path']} and {ev.path}; a job runs on one path"
                )
            if ev.started_us < job["started_us"]:
                job["started_us"] = ev.started_us
            ended = ev.ended_us or ev.started_us
            if ended > job["ended_us"]:
                job["ended_us"] = ended
        if ev.status:
            job["status"], job["met_quality"] = ev.status, ev.met_quality
    return jobs


def _merge_jobs(conn: Connection, jobs: dict[str, dict[str, Any]]) -> None:
    """Create the jobs, or move existing ones to a terminal status (once)."""
    if not jobs:
        return
    ids = sorted(jobs)
    stored: dict[str, Any] = {}
    for part in chunks(ids):
        # Locked (in id order): two replicas ending the same job do not both read "running".
        stmt = select(JOBS).where(JOBS.c.job_id.in_(part)).order_by(JOBS.c.job_id).with_for_update()
        for r in conn.execute(stmt):
            stored[r.job_id] = r
    insert_dicts(conn, JOBS, [jobs[k] for k in sorted(jobs) if k not in stored])
    for job_id, old in stored.items():
        new = jobs[job_id]
        if old.path != new["path"]:
            raise BadInput(f"job {job_id} runs on {old.path}, not {new['path']}")
        status, quality = old.status, old.met_quality
        if new["status"] != "running" and (old.status, old.met_quality) != (
            new["status"],
            new["met_quality"],
        ):
            if old.status != "running":
                raise WrongState(f"job {job_id} already ended as {old.status}; its outcome cannot change")
            status, quality = new["status"], new["met_quality"]
        conn.execute(
            update(JOBS)
            .where(JOBS.c.job_id == job_id)
            .values(
                status=status,
                met_quality=quality,
                started_us=min(old.started_us, new["started_us"]),
                ended_us=max(old.ended_us, new["ended_us"]),
            )
        )


@dataclass(frozen=True)
class CheckedBatch:
    """A batch that passed the checks needing no database: each key's digest, the events
    to store (first of each key) and how many repeated a key within the batch."""

    seen: dict[str, str]
    fresh: list[UsageEvent]
    dup: int


def check_batch(events: Sequence[UsageEvent]) -> CheckedBatch:
    """Validate every event and digest its content; raise BadInput or Conflict (a key twice in
    the batch with different content). Pure, so the servicer runs it before the batch queues
    for the single writer thread, beside the write of the batch before it."""
    seen: dict[str, str] = {}
    fresh: list[UsageEvent] = []
    dup = 0
    for i, ev in enumerate(events):
        if not ev.started_us:
            raise BadInput(f"event {i} ({ev.idempotency_key}): started_unix_us is required")
        validate_event(ev, i)
        digest = ev.content_hash()
        prior = seen.get(ev.idempotency_key)
        if prior is not None:
            if prior != digest:
                raise Conflict(
                    f"idempotency key {ev.idempotency_key} appears twice in the batch with different content"
                )
            dup += 1
            continue
        seen[ev.idempotency_key] = digest
        fresh.append(ev)
    return CheckedBatch(seen, fresh, dup)


def record_usage(conn: Connection, events: Sequence[UsageEvent], now_us: int) -> UsageResult:
    """Validate and store one batch inside the caller's transaction; raise and nothing is kept."""
    return store_batch(conn, check_batch(events), now_us)


def store_batch(conn: Connection, batch: CheckedBatch, now_us: int) -> UsageResult:
    """Store a checked batch inside the caller's transaction; raise and nothing is kept.
    Reads `batch` only, so a transaction retried from the start sees the same batch."""
    if not batch.fresh:
        return UsageResult(0, batch.dup, 0)
    seen, fresh, dup = batch.seen, batch.fresh, batch.dup
    # Fast path, the usual case of a batch of new events: two INSERTs that skip existing keys,
    # no lookups. If any key or job already existed (a retry, a job seen before), the savepoint
    # is undone and the batch takes the careful path, which classifies every key.
    try:
        rows, unpriced = _lines(conn, fresh, seen, now_us)
    except MeteringError:
        rows = []  # maybe only about keys already stored: the careful path decides
    if rows:
        jobs = _job_rows(fresh)
        savepoint = conn.begin_nested()
        job_rows = [tuple(jobs[k].values()) for k in sorted(jobs)]  # dicts are built in JOB_COLUMNS order
        if bulk_insert(conn, LINES, LINE_COLUMNS, rows, skip_existing=True) == len(rows) and bulk_insert(
            conn, JOBS, JOB_COLUMNS, job_rows, skip_existing=True
        ) == len(jobs):
            savepoint.commit()
            return UsageResult(len(rows), dup, unpriced)
        savepoint.rollback()
    stored = _existing(conn, list(seen))
    for key, digest in stored.items():
        if digest != seen[key]:
            raise Conflict(f"idempotency key {key} is already stored with different content; use a new key")
    dup += len(stored)
    fresh = [ev for ev in fresh if ev.idempotency_key not in stored]
    if not fresh:
        return UsageResult(0, dup, 0)
    rows, unpriced = _lines(conn, fresh, seen, now_us)
    _merge_jobs(conn, _job_rows(fresh))
    bulk_insert(conn, LINES, LINE_COLUMNS, rows)
    return UsageResult(len(rows), dup, unpriced)


def _lines(
    conn: Connection, fresh: Sequence[UsageEvent], seen: dict[str, str], now_us: int
) -> tuple[list[tuple[Any, ...]], int]:
    """One priced (or unpriced) journal line per event, in its reservation if it has one."""
    price_keys = load_paths(conn, (e.path for e in fresh))
    book = load_price_book(conn, price_keys.values())
    windows = _reservations(conn, fresh)
    rows: list[tuple[Any, ...]] = []
    unpriced = 0
    sign = rowmac.line_signer(conn)
    per_path: dict[str, tuple[str, list[_Window]]] = {}
    charges: dict[tuple[int, int], int] = {}  # (busy_us, micros/hour) -> amount
    for ev in fresh:
        path = ev.path
        looked_up = per_path.get(path)
        if looked_up is None:
            looked_up = per_path[path] = (price_keys[path], windows.get(path, []))
        price_key, path_windows = looked_up
        rid = _match(ev, path_windows) if path_windows or ev.reservation_id else None
        price = book.at(price_key, ev.started_us)
        busy = ev.busy_us
        if price is None:
            unpriced += 1
            amount, currency, version, method = None, None, None, "unpriced: no price in force"
        else:
            amount = charges.get((busy, price.micros_per_hour))
            if amount is None:
                amount = costmodel.charge(busy, price, f"event {ev.idempotency_key}")
                charges[busy, price.micros_per_hour] = amount
            currency, version, method = price.currency, price.version, None
        key = ev.idempotency_key
        line = (  # in LINE_FIELDS order
            key, seen[key], "prepare" if ev.kind == "prepare" else "busy",
            ev.started_us, ev.ended_us or ev.started_us + busy, busy, amount, currency, version,
            method, path, rid, ev.effective_job_id, ev.model, ev.team, ev.trial_id, ev.arm,
            json.dumps(dict(ev.tags), sort_keys=True) if ev.tags else "{}", now_us,
            ev.prompt_tokens, ev.output_tokens,
        )  # fmt: skip
        rows.append((*line, sign(line)))
    # Key order: concurrent writers then take unique-index locks in the same order (PostgreSQL
    # would otherwise abort one of two batches that overlap in opposite orders as a deadlock).
    rows.sort(key=itemgetter(0))
    return rows, unpriced


def reverse_usage(conn: Connection, key: str, reverses: str, reason: str, now_us: int) -> tuple[Any, bool]:
    """Cancel one busy or preparation line with a reversal line (negated amount, time and tokens).

    The reversal sits where the original did (same time, path, job, reservation), so reports
    over any window and a later reservation close both see the correction. A closed
    reservation's cost is final, so its lines cannot be reversed. Returns (row, duplicate).
    """
    if not key or not reverses:
        raise BadInput("idempotency_key and reverses_key are both required")
    digest = hashlib.sha256(repr(("reversal", key, reverses, reason)).encode()).hexdigest()
    stored = conn.execute(select(LINES).where(LINES.c.idempotency_key == key)).first()
    if stored is not None:
        rowmac.check_lines(conn, [stored], f"reversal {key}")
        if stored.content_hash != digest:
            raise Conflict(f"idempotency key {key} is already stored with different content; use a new key")
        return stored, True
    orig = conn.execute(select(LINES).where(LINES.c.idempotency_key == reverses)).first()
    if orig is None:
        raise UnknownEntity(f"no usage line with idempotency key {reverses!r}")
    rowmac.check_lines(conn, [orig], f"reversing {reverses}")
    # Exclusive on the path: no reservation closes over this line while it is being reversed.
    # (Two reversals of one line are stopped by the unique index on the reversal target.)
    load_paths(conn, [orig.path], lock="update")
    if orig.basis not in ("busy", "prepare"):
        raise WrongState(
            f"line {reverses} is a {orig.basis} line; only busy and preparation lines are reversed"
        )
    already = conn.execute(
        select(LINES.c.idempotency_key).where(
            LINES.c.basis == "reversal", LINES.c.method == f"reverses {reverses}"
        )
    ).first()
    if already is not None:
        raise WrongState(f"line {reverses} is already reversed by {already.idempotency_key}")
    # A line in a closed reservation's interval (attached to it or recorded before it opened)
    # is part of that reservation's final cost.
    covering = and_(RESERVATIONS.c.start_us <= orig.at_us, RESERVATIONS.c.end_us > orig.at_us)
    if orig.reservation_id:
        covering = or_(covering, RESERVATIONS.c.reservation_id == orig.reservation_id)
    closed = conn.execute(
        select(RESERVATIONS.c.reservation_id).where(
            RESERVATIONS.c.path == orig.path, RESERVATIONS.c.state == "closed", covering
        )
    ).first()
    if closed is not None:
        raise WrongState(
            f"line {reverses} is in closed reservation {closed.reservation_id}; its cost is final"
        )
    row = {name: getattr(orig, name) for name in rowmac.LINE_FIELDS}
    row.update(idempotency_key=key, content_hash=digest, basis="reversal", recorded_us=now_us)
    row.update(quantity_us=-orig.quantity_us, method=f"reverses {reverses}")
    row.update(amount_micros=None if orig.amount_micros is None else -orig.amount_micros)
    row.update(prompt_tokens=-orig.prompt_tokens, output_tokens=-orig.output_tokens)
    row["tags_json"] = json.dumps({"reason": reason}, sort_keys=True)
    insert_dicts(conn, LINES, rowmac.signed_lines(conn, [row]))
    return conn.execute(select(LINES).where(LINES.c.idempotency_key == key)).one(), False
