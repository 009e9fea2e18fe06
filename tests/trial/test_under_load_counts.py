"""Counting and naming of the answers under load (workflows/tensor/under_load.py), and the verdict's
correctness criterion that a single answer beyond tolerance fails."""

from __future__ import annotations

import dataclasses

from tests.trial.test_verdict import _state
from workflows.pipeline.types import CorrectnessResult, OutputVerdict, UnderLoad
from workflows.spec.trial_spec import Policy
from workflows.tensor import under_load
from workflows.tensor.strategy import TENSOR

WHY = "allclose to reference (atol=rtol=0.0001), no float64 run supplied: fail"
GOOD = CorrectnessResult(True, [OutputVerdict("y", True, {}, ["allclose ...: pass"], "")])
BAD = CorrectnessResult(False, [OutputVerdict("y", False, {}, [WHY], "", "wrong")])


def _checked(answers: list[tuple[int, int, bool]], measured: int) -> UnderLoad:
    check = UnderLoad(measured=measured)
    for index, batch, ok in answers:
        under_load.record(check, index, batch, GOOD if ok else BAD)
    return check


def test_the_share_checked_is_seeded_and_bounded() -> None:
    picked = [i for i in range(10_000) if under_load.chosen(i, 7, 0)]
    assert picked[: under_load.FIRST_ALL] == list(range(under_load.FIRST_ALL))
    later = len(picked) - under_load.FIRST_ALL
    expected = (10_000 - under_load.FIRST_ALL) / under_load.ONE_IN
    assert 0.8 * expected < later < 1.2 * expected, later
    assert picked == [i for i in range(10_000) if under_load.chosen(i, 7, 0)]  # the same each time
    assert picked != [i for i in range(10_000) if under_load.chosen(i, 8, 0)]  # the seed picks them
    assert not under_load.chosen(0, 7, under_load.MAX_CHECKED)  # at most MAX_CHECKED per scenario


def test_counts_and_names_the_first_answer_beyond_tolerance() -> None:
    answers = [(i, 1, i not in (37, 74)) for i in range(100)] + [(i, 4, i != 37) for i in range(100)]
    check = _checked(answers, 1_200)
    assert (check.checked, check.beyond, check.first_request, check.first_batch) == (200, 3, 37, 1)
    assert under_load.failure(check) == (
        "3 of 200 answers checked under load beyond tolerance (of 1,200 measured), "
        "first at request 37, batch 1"
    )
    assert check.first_reason.startswith("y: allclose to reference") and check.batches_beyond == [1, 4]


def test_a_defect_only_above_batch_1_is_named_batch_dependent() -> None:
    check = _checked([(i, 1, True) for i in range(64)] + [(i, 4, i % 2 == 1) for i in range(64)], 500)
    assert under_load.failure(check) == (
        "batch-dependent: 32 of 128 answers checked under load beyond tolerance (of 500 measured), "
        "first at request 0, batch 4; batch 1 was clean"
    )
    # without batch 1 checked there is nothing to call it dependent on
    assert not under_load.failure(_checked([(0, 4, False)], 10)).startswith("batch-dependent")


def test_one_answer_beyond_tolerance_fails_correctness_and_skips_speed() -> None:
    candidate = _state(9.0, 80)
    assert candidate.performance is not None
    check = _checked([(i, 1, i != 5) for i in range(64)], 80)
    candidate.performance = dataclasses.replace(candidate.performance, under_load=check)
    v = TENSOR.judge(_state(10.0, 100), candidate, Policy())
    corr = v.criteria["correctness"]
    assert (v.verdict, corr.result, v.criteria["latency"].result) == ("REJECT", "fail", "skipped")
    assert corr.figure == (
        "1 of 64 answers checked under load beyond tolerance (of 80 measured), first at request 5, batch 1"
    )
    assert (
        corr.reason
        == f"{corr.figure}: y: allclose to reference (atol=rtol=0.0001), no float64 run supplied: fail"
    )
    assert "correctness fail (1 of 64 answers" in v.line


def test_clean_or_unchecked_answers_under_load_are_said_in_a_pass() -> None:
    candidate = _state(9.0, 80)
    assert candidate.performance is not None
    clean = _checked([(i, 1, True) for i in range(64)], 80)
    candidate.performance = dataclasses.replace(candidate.performance, under_load=clean)
    corr = TENSOR.judge(_state(10.0, 100), candidate, Policy()).criteria["correctness"]
    assert corr.result == "pass" and corr.reason.endswith(
        "; 64 answers under load within tolerance (of 80 measured)"
    )
    replay = UnderLoad(measured=80, skipped="not checked under load: workload replay")
    candidate.performance = dataclasses.replace(candidate.performance, under_load=replay)
    corr = TENSOR.judge(_state(10.0, 100), candidate, Policy()).criteria["correctness"]
    assert corr.result == "pass" and corr.reason.endswith("; not checked under load: workload replay")
