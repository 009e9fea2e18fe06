"""The trial kinds, and the one place that chooses a trial's kind: from its spec when the trial
runs, from the report when a stored report is rendered (reports written before the report
named its kind are told by their inputs and configuration).
"""

from __future__ import annotations

from typing import Any

from workflows.generation.strategy import GENERATION
from workflows.pipeline.kind import TrialKind
from workflows.spec.trial_spec import TrialSpec
from workflows.tensor.strategy import TENSOR
from workflows.training.strategy import TRAINING

KINDS: dict[str, TrialKind] = {kind.name: kind for kind in (TENSOR, GENERATION, TRAINING)}


def kind_of(spec: TrialSpec) -> TrialKind:
    """Prompts make a generation trial, a training plan a training trial, else tensors."""
    if spec.generative:
        return GENERATION
    return TRAINING if spec.training is not None else TENSOR


def kind_of_report(report: dict[str, Any]) -> TrialKind:
    named = KINDS.get(str(report.get("kind", "")))
    if named is not None:
        return named
    if (report.get("inputs") or {}).get("prompts"):
        return GENERATION
    return TRAINING if (report.get("configuration") or {}).get("training") else TENSOR
