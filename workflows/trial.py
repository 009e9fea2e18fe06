"""TrialWorkflow: one JSON spec in, a report with a verdict per path out (docs/architecture.md#trials).

Per path: prepare -> correctness -> performance -> training -> economics. Paths on different
hosts run in parallel; paths sharing a host (as Describe reports it) never measure at once:
the candidates on the reference's host that can be loaded beside it are measured with it in
alternating blocks, taking turns for their other phases (workflows/pipeline/interleave.py), and any
other path there holds that host's lock for its whole pipeline, after them. The reference
path goes first on its host; candidates elsewhere wait only for the reference outputs they
are compared with.
A path whose backend fails is INCONCLUSIVE with its reason; the trial itself completes.
`progress` (query) and `cancel` (update) are for operators; search attributes model, paths
and verdict let them filter in the UI.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from temporalio import workflow
from temporalio.common import SearchAttributeKey
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    # the sandbox resolves an activity result's type hints in the modules it imported itself
    import workflows.generation.types  # noqa: F401
    from workflows.activities import authorization
    from workflows.activities.authorization import AuthorizationActivities
    from workflows.activities.trial_ledger import LedgerActivities
    from workflows.kinds import kind_of
    from workflows.pipeline import interleave
    from workflows.pipeline.context import TrialContext
    from workflows.pipeline.path_run import PathRun
    from workflows.pipeline.types import PHASES, PathInfo, Target, TrialRecord
    from workflows.report.build import TrialRun, build_report
    from workflows.report.results import overall
    from workflows.spec.trial_io import TrialInput, TrialReport
    from workflows.spec.trial_spec import SpecError, TrialSpec, batch_buckets, parse_spec

MODEL = SearchAttributeKey.for_keyword("model")
PATHS = SearchAttributeKey.for_keyword_list("paths")
VERDICT = SearchAttributeKey.for_keyword("verdict")
SEARCH_ATTRIBUTES = (MODEL, PATHS, VERDICT)


class TrialRefused(Exception):
    """The trial cannot measure anything (e.g. the reference path lacks the model): it fails."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@workflow.defn(name="TrialWorkflow")
class TrialWorkflow:
    def __init__(self) -> None:
        self.status = "starting"
        self.runs: dict[str, PathRun] = {}
        self.cancel_reason = ""
        self.finished = False
        self.tasks: list[asyncio.Task[None]] = []
        self.report: TrialReport | None = None
        self.notes: list[str] = []

    @workflow.run
    async def run(self, trial: TrialInput) -> TrialReport:
        spec_json = trial.to_json()
        spec = self._parse(spec_json)
        info = workflow.info()
        trial_id = info.workflow_id
        started = workflow.now()
        workflow.upsert_search_attributes(
            [
                MODEL.value_set(spec.model.name),
                PATHS.value_set([p.name for p in spec.paths]),
                VERDICT.value_set("RUNNING"),
            ]
        )
        ctx, kind = TrialContext(spec, trial_id), kind_of(spec)
        await self._authorize(ctx, spec, trial_id)
        record = TrialRecord(trial_id, trial_id, spec.model.name, "running", json.dumps(spec_json))
        await self._record(ctx, record, "could not record the trial start")
        self.status = "running"
        self.runs = {
            p.name: PathRun(ctx, self._target(spec, trial_id, p.name), p.name == spec.reference,
                            f"paths[{i}].version" if p.version else "model.version", kind)
            for i, p in enumerate(spec.paths)
        }  # fmt: skip
        cancelled = await self._measure(ctx, record)
        run = TrialRun(spec, spec_json, trial_id, info.run_id, started, workflow.now(), self.cancel_reason)
        self.report = build_report(run, {name: r.state for name, r in self.runs.items()})
        verdicts = self.report.verdict_keywords()
        summary = "CANCELLED" if cancelled else str(overall(verdicts))
        workflow.upsert_search_attributes([VERDICT.value_set(summary)])
        record.status = "cancelled" if cancelled else "completed"
        record.verdicts = verdicts
        self.report.notes = self.notes
        record.report_json = json.dumps(self.report.to_json())
        await asyncio.shield(self._record(ctx, record, "could not store the report"))
        self.status = record.status
        self.finished = True
        return self.report

    def _parse(self, spec_json: dict[str, Any]) -> TrialSpec:
        try:
            return parse_spec(spec_json)
        except SpecError as err:
            self.status = "rejected"
            raise ApplicationError(
                f"invalid trial spec: {err}",
                {"field": err.field},
                type="InvalidTrialSpec",
                non_retryable=True,
            ) from None

    async def _authorize(self, ctx: TrialContext, spec: TrialSpec, trial_id: str) -> None:
        """Whoever started the trial holds trials:run on its model (workflows/activities/authorization.py)."""
        need = authorization.needs(spec, trial_id)
        need.grant = workflow.memo_value(authorization.GRANT_MEMO, "", type_hint=str)
        try:
            await ctx.call(AuthorizationActivities.authorize_trial, need)
        except ActivityError as err:
            self.status = "rejected"
            cause: BaseException = err.cause or err
            why = cause.message if isinstance(cause, ApplicationError) else str(cause)
            raise ApplicationError(
                f"trial not authorised: {why}", type="TrialNotAuthorized", non_retryable=True
            ) from None

    async def _record(self, ctx: TrialContext, record: TrialRecord, problem: str) -> None:
        try:
            await ctx.call(LedgerActivities.record_trial, record)
        except ActivityError as err:
            # the trial still runs; its report says the ledger could not be written
            self.notes.append(f"ledger: {problem}: {err.cause or err}")

    async def _measure(self, ctx: TrialContext, record: TrialRecord) -> bool:
        """Run every path's pipeline; True if the trial was cancelled (cleanup done)."""
        cancelled = False
        try:
            await self._run_paths()
        except TrialRefused as refused:
            self.status = record.status = "failed"
            workflow.upsert_search_attributes([VERDICT.value_set("REFUSED")])
            # no report: nothing was measured; the failure (trial status) says why
            await self._record(ctx, record, "could not record the refusal")
            raise ApplicationError(
                str(refused), {"field": refused.field}, type="UnknownModel", non_retryable=True
            ) from None
        except asyncio.CancelledError:
            cancelled = True
            self.cancel_reason = self.cancel_reason or "workflow cancellation requested"
        if self.cancel_reason:
            cancelled = True
            self.status = "cancelled"
            # cleanup must finish even though the trial was cancelled
            await asyncio.shield(asyncio.gather(*(r.ledger.cleanup() for r in self.runs.values())))
        return cancelled

    async def _run_paths(self) -> None:
        infos = await asyncio.gather(*(r.describe() for r in self.runs.values()))
        reference = self._reference()
        if reference.model_problem:
            # nothing can be compared without the reference: refuse before any reservation or load
            field = reference.version_field if reference.target.version else "model.name"
            raise TrialRefused(
                f"trial refused: path {reference.target.path}: {reference.model_problem}", field
            )
        locks: dict[str, asyncio.Lock] = {}
        for info in infos:
            if info is not None:
                locks.setdefault(info.host, asyncio.Lock())
        if self.cancel_reason:
            raise asyncio.CancelledError()
        grouped = self._interleave(reference)
        ordered = sorted(self.runs.values(), key=lambda r: not r.is_reference)
        for run in ordered:
            # the reference holds its host's lock for the paths measured with it
            lock = asyncio.Lock() if run.target.path in grouped else locks.get(run.state.host, asyncio.Lock())
            self.tasks.append(asyncio.create_task(run.pipeline(lock, reference)))
        await asyncio.gather(*self.tasks)

    def _interleave(self, reference: PathRun) -> set[str]:
        """The candidates measured with the reference in alternating blocks, on its host
        (workflows/pipeline/interleave.py); a candidate there that cannot be is told why."""
        spec = reference.ctx.spec
        if reference.state.info is None:
            return set()
        candidates = [
            (r.target, r.state.info)
            for r in self.runs.values()
            if not r.is_reference and r.state.info is not None and not r.state.errors
        ]
        found = interleave.plan((reference.target, reference.state.info), candidates)
        if not spec.performance.interleave:
            apart = found.members[1:] + list(found.apart)
            found = interleave.Plan(found.members[:1], dict.fromkeys(apart, "interleave off in the spec"))
        for name, why in found.apart.items():
            self.runs[name].group = interleave.Alone(reference.ctx, why)
        if len(found.members) < 2:
            return set()
        group = interleave.Interleaved(reference.ctx, found.members)
        for name in found.members:
            self.runs[name].group = group
        for name in found.shared:
            self.runs[name].ledger.unload = False
        return set(found.members[1:])

    def _reference(self) -> PathRun:
        return next(r for r in self.runs.values() if r.is_reference)

    @staticmethod
    def _target(spec: TrialSpec, trial_id: str, name: str) -> Target:
        p = spec.path(name)
        inputs_batch = spec.inputs.tensors[0].shape[0] if spec.inputs.tensors else 1
        return Target(
            trial_id=trial_id,
            path=p.name,
            executor=p.executor,
            model=spec.model.name,
            version=p.version or spec.model.version,
            checkpoint_sha256=spec.model.checkpoint_sha256,
            mode=p.mode,
            precision=p.precision,
            batch_buckets=list(batch_buckets(spec, inputs_batch)),
            team=spec.team,
        )

    @workflow.query
    def progress(self) -> dict[str, Any]:
        total = max(len(self.runs) * len(PHASES), 1)
        done = sum(r.state.phases_done for r in self.runs.values())
        return {
            "trial_id": workflow.info().workflow_id,
            "status": self.status,
            "percent": 100.0 if self.finished else round(100.0 * done / total, 1),
            "paths": {name: r.state.summary() for name, r in self.runs.items()},
            "verdicts": self.report.verdict_keywords() if self.report else {},
        }

    @workflow.update
    async def cancel(self, reason: str) -> str:
        self.cancel_reason = reason or "cancelled by operator"
        for task in self.tasks:
            task.cancel()
        await workflow.wait_condition(lambda: self.finished)
        return self.status

    @cancel.validator
    def _validate_cancel(self, reason: str) -> None:
        if self.finished or self.cancel_reason:
            raise ValueError(f"trial is already {self.status}; nothing to cancel")


__all__ = ["SEARCH_ATTRIBUTES", "ActivityError", "PathInfo", "TrialInput", "TrialReport", "TrialWorkflow"]
