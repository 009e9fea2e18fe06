"""One path's pipeline inside TrialWorkflow: prepare -> correctness -> performance -> training
-> economics, with the path's state kept typed (workflows/pipeline/path_state.py) for the
`progress` query, the verdict and the report.

What every trial kind shares is here: describe and register the path, open its reservation,
load and prepare it, check that it runs the reference's artifact, keep the phases' timeline,
read its cost and clean up. What differs by kind (the golden run, correctness, the measurement,
training) is the kind's `PathSteps` (workflows/pipeline/kind.py), called step by step.

Runs in the workflow sandbox: it only schedules activities and awaits events. Every activity
is called by its method with one dataclass in and one out (`TrialContext.call`), so mypy sees
each call's types. A failed activity ends that path's measurement (the path becomes
INCONCLUSIVE with the reason), but its reservation is still closed and its cost still read,
so the ledger stays whole.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.exceptions import ActivityError

from workflows.activities.path import PathActivities
from workflows.activities.trial_ledger import LedgerActivities
from workflows.pipeline.context import PathProblem, TrialContext, reason_of
from workflows.pipeline.interleave import Alone, Interleaved
from workflows.pipeline.kind import TrialKind
from workflows.pipeline.path_ledger import PathLedger
from workflows.pipeline.path_state import PathState
from workflows.pipeline.types import PathInfo, Target

T = TypeVar("T")


def artifact_problem(path: Target, mine: str, reference: Target, theirs: str) -> str:
    """Why two paths of one model version do not run one artifact ("" if they do)."""
    if path.version != reference.version or mine == theirs:
        return ""
    return (
        f"FAILED_PRECONDITION: {path.model}:{path.version or 'default'} on {path.path} has artifact sha256 "
        f"{mine}, the reference {reference.path} has {theirs}: the executors' model repositories hold "
        "different files for one version; add the same artifact to both (`switchyard models add`) or "
        "pin model.checkpoint_sha256"
    )


class PathRun:
    def __init__(
        self, ctx: TrialContext, target: Target, is_reference: bool, version_field: str, kind: TrialKind
    ) -> None:
        self.ctx = ctx
        self.target = target
        self.is_reference = is_reference
        self.version_field = version_field  # the spec field that names this path's version
        self.state = PathState(target.path, "reference" if is_reference else "candidate")
        self.ledger = PathLedger(ctx, target, self.state)
        self.steps = kind.steps(ctx, target, self.state, self.ledger)
        self.model_problem = ""  # why the executor cannot load the model ("" = it can)
        self.prepared = asyncio.Event()
        # the paths it is measured with and the turns it keeps meanwhile (interleave.py)
        self.group: Alone | Interleaved = Alone(ctx)

    async def describe(self) -> PathInfo | None:
        """Describe the executor and register the path; refuse a model it does not hold."""
        try:
            info = await self.ctx.call(PathActivities.describe_path, self.target)
        except ActivityError as err:
            self.state.fail("prepare", f"Describe failed: {reason_of(err)}")
            return None
        self.state.host = info.host
        self.state.info = info
        self.target.ledger_path = info.ledger_path
        self.model_problem = info.model_problem(self.target, self.version_field)
        if self.model_problem:
            self.state.fail("prepare", self.model_problem)
            return info
        try:
            registered = await self.ctx.call(LedgerActivities.register_path, info)
            self.state.ledger_problem = registered.problem
        except ActivityError as err:
            self.state.ledger_problem = f"ledger: {reason_of(err)}"
        return info

    def _enter(self, phase: str) -> None:
        self.state.phase = phase
        self.state.status = "running"
        self.state.timeline[phase] = [workflow.now().isoformat()]

    def _leave(self) -> None:
        self.state.phases_done += 1
        self.state.timeline[self.state.phase].append(workflow.now().isoformat())

    async def pipeline(self, host_lock: asyncio.Lock, reference: PathRun) -> None:
        try:
            if self.state.errors:
                return
            async with host_lock:
                await self._pipeline(reference)
        except asyncio.CancelledError:
            self.state.status = "cancelled"
            raise
        finally:
            self._release()
            self.group.finished(self.target.path)

    def _release(self) -> None:
        """Whoever waits on this path's results need wait no longer: they are ready, or never."""
        self.prepared.set()
        self.steps.release()

    async def _pipeline(self, reference: PathRun) -> None:
        name = self.target.path
        try:
            async with self.group.turn(name, "setup"):  # its reservation opens with its turn
                self._enter("prepare")
                await self.ledger.open()
                await self._prepare(reference)
                self._leave()
                passed = await self._phase("correctness", self.steps.correctness(reference.steps))
            await self._phase("performance", self._performance(passed, reference))
            async with self.group.turn(name, "training"):
                await self._phase("training", self.steps.training(reference.steps, passed))
        except (ActivityError, PathProblem) as err:
            self.state.fail(self.state.phase, reason_of(err))
            self._release()  # a candidate elsewhere need not wait for this path's cleanup
        self.group.leave(name)
        await self.group.last_out(name)
        await self._phase("economics", self.ledger.economics())
        await self.ledger.cleanup()
        if self.state.status != "failed":
            self.state.status = "done"

    async def _phase(self, phase: str, step: Coroutine[Any, Any, T]) -> T:
        if (task := asyncio.current_task()) is not None and task.cancelling():
            step.close()  # never started: closed, so it is not left unawaited
            raise asyncio.CancelledError()  # cancelled while in an activity that then completed
        self._enter(phase)
        result = await step
        self._leave()
        return result

    async def _prepare(self, reference: PathRun) -> None:
        self.state.restore = await self.ctx.call(PathActivities.serving_config, self.target)
        self.state.loaded = True
        await self.steps.prepare()
        prepared = await self.ctx.call(PathActivities.prepare_path, self.target)
        self.state.prepare = prepared
        busy = int(prepared.total_s * 1e6)
        await self.ledger.usage("prepare", busy, prepared.started_unix_us, prepared.ended_unix_us)
        self.prepared.set()
        if not self.is_reference:
            await reference.prepared.wait()
            if reference.state.prepare is not None:
                theirs = reference.state.prepare.checkpoint_sha256
                problem = artifact_problem(self.target, prepared.checkpoint_sha256, reference.target, theirs)
                if problem:
                    raise PathProblem(problem)

    async def _performance(self, passed: bool, reference: PathRun) -> None:
        if not passed:
            self.state.performance_skipped = "failed correctness: no speed verdict"
            self.steps.release()  # a path that waits on this one's answers need not wait longer
            self.group.withdraw(self.target.path)
            return
        await self.steps.performance(reference.steps, self.group)
