"""Jobs and trials: completing a job (with its preparation charge), a job's cost, trial records.

A job's outcome is set once: the same outcome again is accepted (retries), another outcome is
FAILED_PRECONDITION. A trial's record moves running -> completed | cancelled | failed; each
move is audited (trial.start, trial.cancel, trial.verdict) in the same transaction.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, select, update

from services.metering import audit, costmodel, rowmac
from services.metering.metering_errors import BadInput, Conflict, UnknownEntity, WrongState
from services.metering.records import (
    JOB_STATUSES,
    Actor,
    CostLineInfo,
    JobCostInfo,
    JobInfo,
    check_key,
    check_time,
)
from services.metering.schema import JOBS, LINES, RESERVATIONS, TRIALS
from services.metering.usage import load_paths, load_price_book

TRIAL_STATUSES = ("running", "completed", "cancelled", "failed")
VERDICTS = ("ADOPT", "REJECT", "INCONCLUSIVE")


def job_info(r: Any) -> JobInfo:
    return JobInfo(r.job_id, r.path, r.model, r.team, r.status, bool(r.met_quality), r.trial_id, r.ended_us)


def complete_job(conn: Connection, outcome: JobInfo, prepare_us: int) -> JobInfo:
    """Ends a job as `outcome` says, charging `prepare_us` of preparation to its path."""
    job_id, path, status, met_quality = outcome.job_id, outcome.path, outcome.status, outcome.met_quality
    trial_id, ended_us = outcome.trial_id, outcome.ended_us
    check_key(job_id, "job_id")
    check_time(ended_us, "ended_unix_us")
    check_time(prepare_us, "prepare_us")
    if status not in JOB_STATUSES:
        raise BadInput(f"status {status!r} is not one of {', '.join(JOB_STATUSES)}")
    old = conn.execute(select(JOBS).where(JOBS.c.job_id == job_id)).first()
    if old is not None:
        # The path first (the order every writer takes), then the job row, read again locked.
        load_paths(conn, [old.path])
        old = conn.execute(select(JOBS).where(JOBS.c.job_id == job_id).with_for_update()).one()
    if old is None:
        if not path:
            raise BadInput(f"job {job_id} has no usage yet; give its path")
        load_paths(conn, [path])
        conn.execute(
            JOBS.insert().values(
                job_id=job_id,
                kind="trial" if trial_id else "request",
                path=path,
                model=outcome.model,
                model_version="",
                team=outcome.team,
                principal="",
                trial_id=trial_id,
                arm="",
                status=status,
                met_quality=met_quality,
                started_us=ended_us - prepare_us,
                ended_us=ended_us,
            )
        )
    else:
        if path and path != old.path:
            raise BadInput(f"job {job_id} runs on {old.path}, not {path}")
        if old.status != "running" and (old.status, bool(old.met_quality)) != (status, met_quality):
            raise WrongState(f"job {job_id} already ended as {old.status}; its outcome cannot change")
        conn.execute(
            update(JOBS)
            .where(JOBS.c.job_id == job_id)
            .values(status=status, met_quality=met_quality, ended_us=max(old.ended_us, ended_us))
        )
    job = conn.execute(select(JOBS).where(JOBS.c.job_id == job_id)).one()
    if prepare_us > 0:
        _charge_prepare(conn, job, prepare_us, ended_us)
    return job_info(job)


def _charge_prepare(conn: Connection, job: Any, prepare_us: int, now_us: int) -> None:
    """Preparation is charged to the job's path at the price in force when it started."""
    key = f"job:{job.job_id}:prepare"
    at = job.started_us
    content = hashlib.sha256(f"{job.job_id}|{job.path}|{prepare_us}|{at}".encode()).hexdigest()
    stored = conn.execute(select(LINES).where(LINES.c.idempotency_key == key)).first()
    if stored is not None:
        rowmac.check_lines(conn, [stored], f"the preparation charge of job {job.job_id}")
        if stored.content_hash != content:
            raise Conflict(f"job {job.job_id} already has a different preparation charge")
        return
    price_key = load_paths(conn, [job.path])[job.path]
    price = load_price_book(conn, [price_key]).at(price_key, at)
    res = conn.execute(
        select(RESERVATIONS.c.reservation_id, RESERVATIONS.c.state).where(
            RESERVATIONS.c.path == job.path,
            RESERVATIONS.c.start_us <= at,
            (RESERVATIONS.c.end_us.is_(None)) | (RESERVATIONS.c.end_us > at),
        )
    ).first()
    if res is not None and res.state != "open":
        raise WrongState(f"reservation {res.reservation_id} covering job {job.job_id} is closed")
    line = dict(
        idempotency_key=key,
        content_hash=content,
        basis="prepare",
        at_us=at,
        end_us=at + prepare_us,
        quantity_us=prepare_us,
        amount_micros=costmodel.charge(prepare_us, price, "preparation charge") if price else None,
        currency=price.currency if price else None,
        price_version=price.version if price else None,
        method=None if price else "unpriced: no price in force",
        path=job.path,
        reservation_id=res.reservation_id if res else None,
        job_id=job.job_id,
        model=job.model,
        team=job.team,
        trial_id=job.trial_id,
        arm=job.arm,
        tags_json="{}",
        recorded_us=now_us,
    )
    conn.execute(LINES.insert(), rowmac.signed_lines(conn, [line]))


def job_cost(conn: Connection, job_id: str) -> JobCostInfo:
    job = conn.execute(select(JOBS).where(JOBS.c.job_id == job_id)).first()
    if job is None:
        raise UnknownEntity(f"unknown job {job_id!r}")
    rows = conn.execute(select(LINES).where(LINES.c.job_id == job_id).order_by(LINES.c.id)).all()
    rowmac.check_lines(conn, rows, f"the cost of job {job_id}")
    lines = [
        CostLineInfo(
            r.basis if r.amount_micros is not None else "unpriced",
            r.amount_micros,
            r.currency,
            r.price_version or "",
            r.method or "",
            r.quantity_us,
        )
        for r in rows
    ]
    currency = next((r.currency for r in rows if r.currency), "")
    total = sum(r.amount_micros or 0 for r in rows)
    unpriced = any(r.amount_micros is None for r in rows)
    return JobCostInfo(job_info(job), total, currency, lines, unpriced)


def _check_trial(
    trial_id: str, status: str, spec_json: str, report_json: str, verdicts: dict[str, str]
) -> None:
    check_key(trial_id, "trial_id")
    if status not in TRIAL_STATUSES:
        raise BadInput(f"trial status {status!r} is not one of {', '.join(TRIAL_STATUSES)}")
    for blob, name in ((spec_json, "spec_json"), (report_json, "report_json")):
        if blob:
            try:
                json.loads(blob)
            except ValueError as exc:
                raise BadInput(f"{name} is not valid JSON: {exc}") from None
    for path, verdict in verdicts.items():
        if verdict not in VERDICTS:
            raise BadInput(f"verdict {verdict!r} for {path} is not one of {', '.join(VERDICTS)}")


@dataclass(frozen=True)
class TrialUpdate:
    """RecordTrial's fields: a trial's state as its workflow reports it."""

    trial_id: str
    workflow_id: str
    model: str
    status: str
    spec_json: str
    report_json: str
    verdicts: dict[str, str]


def record_trial(conn: Connection, actor: Actor, trial: TrialUpdate, now_us: int) -> None:
    trial_id, workflow_id, model, status = trial.trial_id, trial.workflow_id, trial.model, trial.status
    spec_json, report_json, verdicts = trial.spec_json, trial.report_json, trial.verdicts
    _check_trial(trial_id, status, spec_json, report_json, verdicts)
    verdicts_json = json.dumps(verdicts, sort_keys=True)
    old = conn.execute(select(TRIALS).where(TRIALS.c.trial_id == trial_id)).first()
    values: dict[str, Any] = dict(workflow_id=workflow_id, model=model, status=status, spec_json=spec_json)
    values.update(report_json=report_json, verdicts_json=verdicts_json, updated_us=now_us)
    if old is None:
        conn.execute(TRIALS.insert().values(trial_id=trial_id, created_us=now_us, **values))
        audit.append(conn, actor, "trial.start", f"trial/{trial_id}", "ok", now_us, {"model": model})
    else:
        if old.status != "running" and old.status != status:
            raise WrongState(f"trial {trial_id} already ended as {old.status}")
        if (old.status, old.report_json, old.verdicts_json) == (status, report_json, verdicts_json):
            return  # a retried activity: nothing new to record
        if not spec_json:
            values["spec_json"] = old.spec_json
        conn.execute(update(TRIALS).where(TRIALS.c.trial_id == trial_id).values(**values))
    if status == "cancelled" and (old is None or old.status != "cancelled"):
        audit.append(conn, actor, "trial.cancel", f"trial/{trial_id}", "ok", now_us)
    if verdicts and (old is None or old.verdicts_json != verdicts_json):
        audit.append(conn, actor, "trial.verdict", f"trial/{trial_id}", "ok", now_us, {"verdicts": verdicts})


def get_trial(conn: Connection, trial_id: str) -> Any:
    row = conn.execute(select(TRIALS).where(TRIALS.c.trial_id == trial_id)).first()
    if row is None:
        raise UnknownEntity(f"unknown trial {trial_id!r}")
    return row
