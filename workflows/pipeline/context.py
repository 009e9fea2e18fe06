"""What every activity call of a trial shares: the spec, the trial id, and `TrialContext.call`,
which runs one activity method (one dataclass in, one out) with the spec's timeouts and
retries, so mypy sees each call's types. Runs in the workflow sandbox.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.workflow import ActivityCancellationType

from workflows.pipeline.types import InputsPlan
from workflows.spec.trial_spec import TrialSpec

In = TypeVar("In")
Out = TypeVar("Out")


def now_us() -> int:
    return int(workflow.now().timestamp() * 1_000_000)


class PathProblem(Exception):
    """A path cannot go on for a reason of the trial's own (not an activity failure)."""


def reason_of(err: BaseException) -> str:
    """The innermost message of an activity failure, for the report."""
    cause: BaseException | None = err
    while isinstance(cause, ActivityError) and cause.cause is not None:
        cause = cause.cause
    if isinstance(cause, ApplicationError):
        return cause.message
    return str(cause)


@dataclass
class TrialContext:
    spec: TrialSpec
    trial_id: str

    async def call(self, activity: Callable[[Any, In], Awaitable[Out]], arg: In) -> Out:
        """Run one activity method with the spec's timeouts and retries."""
        t = self.spec.timeouts
        return await workflow.execute_activity_method(
            activity,
            arg,
            start_to_close_timeout=timedelta(seconds=t.activity_s),
            heartbeat_timeout=timedelta(seconds=t.heartbeat_s),
            retry_policy=RetryPolicy(
                maximum_attempts=t.max_attempts,
                initial_interval=timedelta(seconds=1),
                non_retryable_error_types=["InvalidTrialSpec"],
            ),
            cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
        )

    def inputs(self) -> InputsPlan:
        i = self.spec.inputs
        return InputsPlan(i.seed, list(i.tensors), i.file, i.file_sha256, i.workload, i.workload_sha256)
