"""Price book, paths, reservations and jobs: the ledger's slower-moving writes.

Closing a reservation crystallises its cost: the reserved time x the prices in force (exact,
rounded once) minus the busy and preparation lines already charged inside it becomes idle,
shared to the reservation's jobs by busy time. The idle lines complete the reservation, so
its lines sum to its cost to the micro-unit.
"""

from __future__ import annotations

import hashlib
from typing import Any

from sqlalchemy import Connection, func, select, update

from services.metering import costmodel, rowmac
from services.metering.costmodel import IDLE_METHOD, UNALLOCATED_METHOD
from services.metering.metering_errors import BadInput, Conflict, UnknownEntity, WrongState
from services.metering.records import ReservationInfo, check_key, check_time
from services.metering.schema import JOBS, LINES, PATHS, PRICES, RESERVATIONS
from services.metering.usage import load_paths, load_price_book

CURRENCY_LEN = 3


def set_price(
    conn: Connection,
    key: str,
    micros_per_hour: int,
    currency: str,
    effective_us: int,
    now_us: int,
    example: bool = False,
) -> Any:
    """A new price version from `effective_us` on, or the version already saying so (the same
    rate and the same example mark: finance's price at the example's rate is a new version)."""
    check_key(key, "price_key")
    check_time(effective_us, "effective_from_unix_us")
    if micros_per_hour < 0:
        raise BadInput(f"micros_per_hour is negative ({micros_per_hour}); a price is >= 0")
    costmodel.check_int64(micros_per_hour, "micros_per_hour")
    if len(currency) != CURRENCY_LEN or not currency.isalpha() or not currency.isupper():
        raise BadInput(f"currency {currency!r} is not an ISO 4217 code such as USD or EUR")
    rows = conn.execute(select(PRICES).where(PRICES.c.price_key == key)).all()
    same_time = [r for r in rows if r.effective_from_us == effective_us]
    if same_time:
        old = same_time[0]
        if (old.micros_per_hour, old.currency, old.example) == (micros_per_hour, currency, example):
            return old
        said = f"{old.micros_per_hour} {old.currency}{' (example)' if old.example else ''}"
        raise Conflict(f"price {key} from {effective_us} is already {said}")
    if rows and rows[0].currency != currency:
        raise BadInput(f"price key {key} is priced in {rows[0].currency}; a key keeps one currency")
    in_force = max(
        (r for r in rows if r.effective_from_us <= effective_us),
        key=lambda r: r.effective_from_us,
        default=None,
    )
    later = [r for r in rows if r.effective_from_us > effective_us]
    same = in_force is not None and (in_force.micros_per_hour, in_force.example) == (micros_per_hour, example)
    if same and not later:
        return in_force  # already the price from then on: nothing changes, so no new version
    charged = conn.execute(
        select(func.max(LINES.c.at_us))
        .join(PATHS, PATHS.c.path == LINES.c.path)
        .where(PATHS.c.price_key == key)
    ).scalar()
    if charged is not None and effective_us <= charged:
        raise WrongState(
            f"usage on {key} is already charged up to {charged}; a new price must take effect after that "
            "(past lines are never re-priced)"
        )
    version = f"{key}@{effective_us}"
    values = dict(price_key=key, micros_per_hour=micros_per_hour, currency=currency)
    values.update(effective_from_us=effective_us, version=version, created_us=now_us, example=example)
    conn.execute(PRICES.insert().values(**values, mac=rowmac.price_mac(conn, values)))
    return conn.execute(select(PRICES).where(PRICES.c.version == version)).one()


def register_path(
    conn: Connection, path: str, backend: str, resource_class: str, price_key: str, host: str, now_us: int
) -> Any:
    check_key(path, "path")
    check_key(price_key, "price_key")
    # A price key with no price yet is accepted: usage on the path is then recorded unpriced
    # (reported as such) until a price is in force, rather than refused and held back.
    values = dict(path=path, backend=backend, resource_class=resource_class, price_key=price_key, host=host)
    old = conn.execute(select(PATHS).where(PATHS.c.path == path)).first()
    if old is not None:
        if {k: getattr(old, k) for k in values} != values:
            raise Conflict(f"path {path} is already registered with other settings; paths are immutable")
        return old
    row: dict[str, Any] = {**values, "created_us": now_us}
    conn.execute(PATHS.insert().values(**row, mac=rowmac.path_mac(conn, row)))
    return conn.execute(select(PATHS).where(PATHS.c.path == path)).one()


def list_paths(conn: Connection, now_us: int) -> list[tuple[Any, bool]]:
    """Every registered path, with whether a price is in force for its key at `now_us`."""
    rows = conn.execute(select(PATHS).order_by(PATHS.c.path)).all()
    book = load_price_book(conn, (r.price_key for r in rows))
    return [(r, book.at(r.price_key, now_us) is not None) for r in rows]


def _info(r: Any) -> ReservationInfo:
    return ReservationInfo(
        r.reservation_id,
        r.path,
        r.start_us,
        r.end_us,
        r.state,
        r.trial_id,
        r.cost_micros,
        r.idle_micros,
        r.currency,
        r.price_version,
    )


def open_reservation(conn: Connection, key: str, path: str, start_us: int, trial_id: str) -> ReservationInfo:
    check_key(key, "idempotency_key")
    check_time(start_us, "start_unix_us")
    if start_us == 0:
        raise BadInput("start_unix_us is required")
    old = conn.execute(select(RESERVATIONS).where(RESERVATIONS.c.idempotency_key == key)).first()
    if old is not None:
        if (old.path, old.start_us, old.trial_id) != (path, start_us, trial_id):
            raise Conflict(f"reservation key {key} is already used for {old.path} from {old.start_us}")
        return _info(old)
    load_paths(conn, [path], lock="update")  # one opener per path at a time: no overlap
    clash = conn.execute(
        select(RESERVATIONS.c.reservation_id).where(
            RESERVATIONS.c.path == path,
            (RESERVATIONS.c.end_us.is_(None)) | (RESERVATIONS.c.end_us > start_us),
        )
    ).first()
    if clash is not None:
        raise WrongState(
            f"path {path} is already reserved by {clash.reservation_id} at {start_us}; close it first "
            "(a path's capacity is held by one reservation at a time)"
        )
    rid = "r_" + hashlib.sha256(key.encode()).hexdigest()[:24]
    conn.execute(
        RESERVATIONS.insert().values(
            reservation_id=rid,
            idempotency_key=key,
            path=path,
            start_us=start_us,
            end_us=None,
            state="open",
            trial_id=trial_id,
            cost_micros=None,
            idle_micros=None,
            currency=None,
            price_version="",
            closed_us=None,
        )
    )
    return get_reservation(conn, rid)


def get_reservation(conn: Connection, rid: str) -> ReservationInfo:
    row = conn.execute(select(RESERVATIONS).where(RESERVATIONS.c.reservation_id == rid)).first()
    if row is None:
        raise UnknownEntity(f"unknown reservation {rid!r}")
    return _info(row)


def close_reservation(conn: Connection, rid: str, end_us: int, now_us: int) -> ReservationInfo:
    res = get_reservation(conn, rid)
    # Exclusive on the path, then read again: usage being added there commits first (or
    # waits, and then sees the reservation closed).
    load_paths(conn, [res.path], lock="update")
    res = get_reservation(conn, rid)
    check_time(end_us, "end_unix_us")
    if res.state == "closed":
        if res.end_us == end_us:
            return res
        raise WrongState(f"reservation {rid} is already closed at {res.end_us}")
    if end_us < res.start_us:
        raise BadInput(f"end_unix_us {end_us} is before the reservation's start {res.start_us}")
    late = conn.execute(
        select(func.max(LINES.c.at_us)).where(LINES.c.reservation_id == rid, LINES.c.at_us >= end_us)
    ).scalar()
    if late is not None:
        raise BadInput(f"reservation {rid} has usage starting at {late}; end_unix_us must be after it")
    price_key = load_paths(conn, [res.path])[res.path]
    book = load_price_book(conn, [price_key])
    reserved = costmodel.reserved_cost(book, price_key, res.start_us, end_us)
    # Usage recorded on the path before the reservation was opened (so with no reservation)
    # but inside its interval was charged already: it counts against the reserved total too,
    # or that time would be paid twice (once busy, once as idle).
    unreserved = (
        LINES.c.reservation_id.is_(None)
        & (LINES.c.path == res.path)
        & (LINES.c.at_us >= res.start_us)
        & (LINES.c.at_us < end_us)
    )
    lines = conn.execute(select(LINES).where((LINES.c.reservation_id == rid) | unreserved)).all()
    rowmac.check_lines(conn, lines, f"closing reservation {rid}")
    charged = sum(r.amount_micros or 0 for r in lines)
    idle_us = (end_us - res.start_us) - sum(r.quantity_us for r in lines)
    weights: dict[str, int] = {}
    for r in lines:
        if r.basis in ("busy", "reversal") and r.job_id:
            weights[r.job_id] = weights.get(r.job_id, 0) + r.quantity_us
    weights = {job: w for job, w in weights.items() if w > 0}  # a fully reversed job shares no idle
    idle = None if reserved.total_micros is None else reserved.total_micros - charged
    _write_idle_lines(conn, res, end_us, idle, idle_us, weights, reserved, now_us)
    conn.execute(
        update(RESERVATIONS)
        .where(RESERVATIONS.c.reservation_id == rid)
        .values(
            end_us=end_us,
            state="closed",
            cost_micros=reserved.total_micros,
            idle_micros=idle,
            currency=reserved.currency,
            price_version=",".join(dict.fromkeys(reserved.versions)),
            closed_us=now_us,
        )
    )
    return get_reservation(conn, rid)


def _write_idle_lines(
    conn: Connection,
    res: ReservationInfo,
    end_us: int,
    idle: int | None,
    idle_us: int,
    weights: dict[str, int],
    reserved: costmodel.ReservedCost,
    now_us: int,
) -> None:
    versions = ",".join(dict.fromkeys(reserved.versions)) or None
    base = dict(at_us=end_us, end_us=end_us, path=res.path, reservation_id=res.reservation_id)
    base.update(
        currency=reserved.currency, price_version=versions, recorded_us=now_us, arm="", tags_json="{}"
    )
    rows: list[dict[str, Any]] = []
    if not weights:
        method = UNALLOCATED_METHOD if idle is not None else "unpriced: no price in force"
        rows.append(
            dict(base, job_id=None, basis="idle", quantity_us=idle_us, amount_micros=idle, method=method)
            | {"model": "", "team": "", "trial_id": res.trial_id}
        )
    else:
        money = costmodel.largest_remainder(idle, weights) if idle is not None else {}
        time = costmodel.largest_remainder(idle_us, weights)
        jobs = {r.job_id: r for r in conn.execute(select(JOBS).where(JOBS.c.job_id.in_(list(weights))))}
        for job_id in sorted(weights):
            job = jobs[job_id]
            rows.append(
                dict(base, job_id=job_id, basis="idle_share", quantity_us=time[job_id])
                | {
                    "amount_micros": money.get(job_id),
                    "method": IDLE_METHOD if idle is not None else "unpriced",
                }
                | {"model": job.model, "team": job.team, "trial_id": job.trial_id or res.trial_id}
            )
    for row in rows:
        row["idempotency_key"] = f"{res.reservation_id}:idle:{row['job_id'] or '-'}"
        row["content_hash"] = hashlib.sha256(repr(sorted(row.items())).encode()).hexdigest()
    conn.execute(LINES.insert(), rowmac.signed_lines(conn, rows))
