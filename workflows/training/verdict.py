"""The training kind's criterion: the candidate's loss curve against the reference's (the
evaluator's CompareLoss at the path's precision), and, for a distributed plan, against its own
single-process curve (workflows/training/activities.py folds that into the comparison). A
training phase that ran and failed (a rank died) is inconclusive, never skipped. Pure: runs
in the workflow sandbox when the report is built.
"""

from __future__ import annotations

from workflows.pipeline.path_state import PathState
from workflows.report.results import FAIL, PASS, SKIPPED, UNKNOWN
from workflows.spec.trial_io import Criterion
from workflows.spec.trial_spec import Policy


def training(candidate: PathState, policy: Policy, correct: bool) -> Criterion:
    """The training criterion of a candidate (`correct`: its correctness passed)."""
    if not correct:
        return Criterion(SKIPPED, "not run without correctness")
    failed = candidate.errors.get("training")
    if failed:
        # training ran and failed (e.g. a rank died): not judged, so not adoptable either
        return Criterion(UNKNOWN, f"training failed: {failed}")
    comparison = candidate.training.comparison if candidate.training else None
    if comparison is None:
        why = candidate.training_skipped or "no loss comparison"
        return Criterion(UNKNOWN if policy.require_training else SKIPPED, why)
    return Criterion(
        PASS if comparison.passed else FAIL,
        "; ".join(comparison.reasons),
        f"max loss deviation {comparison.max_relative_deviation:.2%}",
    )
