"""Correctness under load: which of a candidate's answers under load are checked, the running
count of those beyond tolerance, and the verdict's words for it.

Every scenario's inputs are the same on every call, so the reference's answer to each batch
size's inputs (one request each, just before its measurement: workflows/tensor/strategy.py) is the
answer every candidate call at that batch size must meet. The candidate keeps every
answer of the first FIRST_ALL requests of a scenario, then a seeded 1 in ONE_IN, at most
MAX_CHECKED per scenario, and each is judged by the evaluator's Compare (the correctness
phase's rule, workflows/comparison_activities.py) after the scenario's timing is done, so the
checking costs no measured latency.
"""

from __future__ import annotations

import random

from workflows.pipeline.types import CorrectnessResult, UnderLoad

FIRST_ALL = 64
ONE_IN = 8
MAX_CHECKED = 256


def chosen(index: int, seed: int, kept: int) -> bool:
    """Whether the answer to request `index` of a scenario is checked (`kept` already are)."""
    if kept >= MAX_CHECKED:
        return False
    return index < FIRST_ALL or random.Random(f"{seed}:{index}").randrange(ONE_IN) == 0


def record(check: UnderLoad, index: int, batch: int, result: CorrectnessResult) -> None:
    """Count one checked answer, and where it first went beyond tolerance."""
    check.checked += 1
    if batch not in check.batches_checked:
        check.batches_checked.append(batch)
    if result.passed:
        return
    check.beyond += 1
    if batch not in check.batches_beyond:
        check.batches_beyond.append(batch)
    if check.first_request < 0:
        check.first_request, check.first_batch = index, batch
        failed = [f"{o.output}: {r}" for o in result.outputs for r in o.reasons if r.endswith("fail")]
        check.first_reason = "; ".join(failed) or "differs from the reference"


def failure(check: UnderLoad | None) -> str:
    """The correctness failure under load, named with its count ("" when none)."""
    if check is None or not check.beyond:
        return ""
    text = (
        f"{check.beyond:,} of {check.checked:,} answers checked under load beyond tolerance "
        f"(of {check.measured:,} measured), first at request {check.first_request}, "
        f"batch {check.first_batch}"
    )
    if 1 in check.batches_checked and all(b > 1 for b in check.batches_beyond):
        text = f"batch-dependent: {text}; batch 1 was clean"
    return text


def note(check: UnderLoad | None) -> str:
    """What a passing correctness verdict adds about the answers under load."""
    if check is None:
        return ""
    if check.skipped and not check.checked:
        return check.skipped
    text = f"{check.checked:,} answers under load within tolerance (of {check.measured:,} measured)"
    return f"{text}; {check.skipped}" if check.skipped else text
