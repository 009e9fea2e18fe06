"""The generation divergence rule (switchyard/judge/divergence.py): equal tokens up to the
first divergence, each side's token in the other's top-k there, logprobs against the
reference's own float64 error."""

from __future__ import annotations

from switchyard.judge.compare import Criteria
from switchyard.judge.divergence import (
    Generated,
    check_sequence,
    compare_generations,
    first_divergence,
    generation_criteria,
    judge_pair,
)
from switchyard.judge.tolerances import Tolerances


def gen(
    tokens: list[int], logprobs: list[float] | None = None, tops: list[list[int]] | None = None
) -> Generated:
    lps = logprobs if logprobs is not None else [-0.5 - 0.01 * i for i in range(len(tokens))]
    top_ids = tops if tops is not None else [[t, 900 + i, 901 + i] for i, t in enumerate(tokens)]
    top = tuple(
        tuple((t, lp - 0.1 * j) for j, t in enumerate(row)) for row, lp in zip(top_ids, lps, strict=True)
    )
    return Generated(tuple(tokens), tuple(lps), top)


def test_first_divergence_counts_an_early_end() -> None:
    assert first_divergence((1, 2, 3), (1, 2, 3)) == -1
    assert first_divergence((1, 2, 3), (1, 5, 3)) == 1
    assert first_divergence((1, 2), (1, 2, 3)) == 2


def test_a_near_tie_passes_and_names_the_position() -> None:
    ref = gen([5, 6, 7, 8], tops=[[5, 9], [6, 9], [7, 11], [8, 9]])
    cand = gen([5, 6, 11, 3], tops=[[5, 9], [6, 9], [11, 7], [3, 9]])
    check = check_sequence(0, ref, cand, top_k=5)
    assert check.passed and check.first_divergence == 2
    assert (check.reference_rank_in_candidate, check.candidate_rank_in_reference) == (2, 2)
    assert "position 2: reference token 7 vs candidate token 11" in check.reason
    assert "near-tie, allowed" in check.reason


def test_a_token_outside_the_other_top_k_fails() -> None:
    ref = gen([5, 6, 7], tops=[[5, 9], [6, 9], [7, 12]])
    cand = gen([5, 6, 11], tops=[[5, 9], [6, 9], [11, 7]])  # 7 is in the candidate's top-k, 11 not in ref's
    check = check_sequence(0, ref, cand, top_k=5)
    assert not check.passed and check.first_divergence == 2
    assert check.candidate_rank_in_reference == 0 and check.reference_rank_in_candidate == 2
    assert "11 is not in the reference's top-5" in check.reason
    # the k of the rule is the criteria's: with k=1 even rank 2 is outside
    assert not check_sequence(0, ref, gen([5, 6, 11], tops=[[5], [6], [11, 7]]), top_k=1).passed


def test_without_logprobs_the_rule_cannot_pass_a_divergence() -> None:
    check = check_sequence(3, Generated((1, 2)), Generated((1, 4)), top_k=5)
    assert not check.passed and "no top-5 logprobs" in check.reason


def test_logprobs_within_the_reference_own_error_pass_and_beyond_fail() -> None:
    tokens = [1, 2, 3, 4, 5, 6]
    gold = [gen(tokens, [-1.0, -2.0, -0.5, -0.25, -3.0, -1.5])]
    ref = [gen(tokens, [v + 2e-4 for v in gold[0].logprobs])]  # reference error 2e-4
    near = [gen(tokens, [v - 3e-4 for v in gold[0].logprobs])]  # within 3 x 2e-4 + 1e-5
    far = [gen(tokens, [v + 5e-3 for v in gold[0].logprobs])]
    ok = compare_generations(ref, near, Criteria(precision="fp32"), golden=gold)
    assert ok.passed, ok.reasons
    assert abs(ok.metrics["reference_rmse"] - 2e-4) < 1e-9
    assert abs(ok.metrics["allowed_rmse"] - (3 * 2e-4 + 1e-5)) < 1e-9
    assert "float64" in ok.justification and "top-5" in ok.justification
    bad = compare_generations(ref, far, Criteria(precision="fp32"), golden=gold)
    assert not bad.passed and bad.finding == "wrong"
    assert any("logprobs" in r and r.endswith("fail") for r in bad.reasons)
    assert bad.first_divergence == -1  # the tokens agree: it is the logprobs that fail


def test_only_positions_where_all_runs_agree_are_compared() -> None:
    gold = [gen([1, 2, 3, 9], [-1.0, -1.0, -1.0, -1.0])]
    ref = [gen([1, 2, 3, 4], [-1.0, -1.0, -1.0, -7.0], tops=[[1], [2], [3], [4, 5]])]
    cand = [gen([1, 2, 3, 5], [-1.0, -1.0, -1.0, -0.1], tops=[[1], [2], [3], [5, 4]])]
    v = compare_generations(ref, cand, Criteria(precision="fp32"), golden=gold)
    assert v.metrics["logprob_positions"] == 3
    assert v.passed and v.first_divergence == 3 and v.diverged == [0]


def test_a_perturbed_candidate_is_wrong_and_the_first_position_named() -> None:
    ref = [gen([1, 2, 3, 4]), gen([7, 7, 7])]
    cand = [gen([1, 2, 3, 4]), gen([7, 40, 41], tops=[[7], [40, 41], [41, 40]])]
    again = [gen([1, 2, 3, 4]), gen([7, 40, 41], tops=[[7], [40, 41], [41, 40]])]
    v = compare_generations(ref, cand, Criteria(precision="fp32"), candidate_repeat=again)
    assert not v.passed and v.finding == "wrong but stable"
    assert v.first_divergence == 1 and v.diverged == [1]
    assert "prompt 1: position 1: reference token 7 vs candidate token 40" in v.reasons[0]
    assert v.reasons[0].endswith("fail")


def test_a_candidate_that_changes_between_runs_is_non_deterministic() -> None:
    ref = [gen([1, 2, 3])]
    cand = [gen([1, 2, 3])]
    again = [gen([1, 2, 8], tops=[[1], [2], [8, 3]])]
    v = compare_generations(ref, cand, Criteria(precision="fp32"), candidate_repeat=again)
    assert not v.passed and v.finding == "non-deterministic"
    assert v.reasons[0].startswith("determinism: prompts [0]")


def test_the_shadow_and_the_trial_give_one_verdict_on_a_pair() -> None:
    """The router's `judge_pair` is the trial's rule: the same verdict, in the same words."""
    ref = gen([1, 2, 3], tops=[[1, 9], [2, 7], [3, 8]])
    far = gen([1, 7, 3], tops=[[1, 9], [7, 6], [3, 8]])  # 2 is not in its top-2 at position 1
    online = judge_pair(ref, far)
    trial = compare_generations([ref], [far], generation_criteria(Tolerances(top_k=2), "fp32"))
    assert (online.passed, online.finding, online.reasons) == (trial.passed, trial.finding, trial.reasons)
    assert online.finding == "wrong" and online.checked and "position 1" in online.reason
    blind = judge_pair(Generated((4, 4)), Generated((4, 5)))  # no logprobs asked for
    assert not blind.passed and not blind.checked
