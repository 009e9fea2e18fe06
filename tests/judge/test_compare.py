"""The evaluator's domain: the justified tolerance agrees with torch._dynamo.utils.same."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch._dynamo.utils import same

from switchyard.judge.compare import Criteria, compare
from switchyard.judge.judge_errors import BadCriteria, BadTensor
from switchyard.judge.loss import LossCriteria, compare_loss
from switchyard.judge.tensors import DecodedTensor, decode, encode


def _t(x: torch.Tensor) -> DecodedTensor:
    names = {torch.float32: "FP32", torch.float64: "FP64", torch.float16: "FP16", torch.bfloat16: "BF16"}
    datatype = names[x.dtype]
    raw = x.view(torch.int16).numpy().tobytes() if x.dtype == torch.bfloat16 else x.numpy().tobytes()
    return decode("t", datatype, list(x.shape), raw)


def _model_outputs(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 computation and its float64 'golden' twin, as the trial produces them."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, n, generator=g)
    x = torch.randn(32, n, generator=g)
    ref = torch.tanh(x @ w) @ w
    golden = torch.tanh(x.double() @ w.double()) @ w.double()
    return ref, golden


@pytest.mark.parametrize("noise", [0.0, 1e-7, 1e-6, 1e-5, 3e-5, 1e-4, 1e-3, 1e-1])
def test_verdict_matches_torch_dynamo_same(noise: float) -> None:
    ref, golden = _model_outputs()
    g = torch.Generator().manual_seed(1)
    cand = ref + noise * torch.randn(ref.shape, generator=g) * ref.abs().mean()
    expected = same(ref, cand, fp64_ref=golden, tol=1e-4, log_error=lambda *a: None)
    # cosine is checked on top of the rmse rule; switch it off to compare the rule alone
    result = compare(_t(ref), _t(cand), _t(golden), None, Criteria(min_cosine=1e-12))
    assert result.passed == expected, result.reasons


def test_exact_candidate_passes_even_when_reference_is_exact() -> None:
    golden = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    ref = golden.float()
    result = compare(_t(ref), _t(ref.clone()), _t(golden), _t(ref.clone()), Criteria())
    assert result.passed
    assert result.metrics.reference_rmse == 0.0
    assert result.metrics.allowed_rmse == pytest.approx(1e-5)  # the tol/10 floor
    assert result.metrics.reference_deterministic
    assert "torch._dynamo.utils.same" in result.justification


def test_perturbed_candidate_fails_and_says_which_criterion() -> None:
    ref, golden = _model_outputs()
    cand = ref * 1.01
    result = compare(_t(ref), _t(cand), _t(golden), None, Criteria())
    assert not result.passed
    assert any(r.startswith("rmse vs float64") and r.endswith("fail") for r in result.reasons)
    assert result.metrics.max_abs_error > 0 and result.metrics.mismatch_share > 0.5


def test_bf16_gets_the_wider_multiplier_and_tol() -> None:
    ref, golden = _model_outputs(2048 // 32)
    cand = ref.to(torch.bfloat16)
    strict = compare(_t(ref), _t(cand), _t(golden), None, Criteria(precision="fp32"))
    result = compare(_t(ref.to(torch.bfloat16)), _t(cand), _t(golden), None, Criteria(precision="bf16"))
    assert not strict.passed
    assert result.passed, result.reasons
    assert "3x" in result.justification


def test_logit_metrics_detect_a_changed_argmax() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 8, 32, generator=g, dtype=torch.float64)
    ref = logits.float()
    swapped = ref.clone()
    swapped[0, 0] = -swapped[0, 0]  # flips that position's distribution
    ok = compare(_t(ref), _t(ref.clone()), _t(logits), None, Criteria(logits=True))
    bad = compare(_t(ref), _t(swapped), _t(logits), None, Criteria(logits=True, min_cosine=1e-12))
    assert ok.passed and ok.metrics.top1_agreement == 1.0 and ok.metrics.kl_divergence == 0.0
    assert bad.metrics.top1_agreement == pytest.approx(31 / 32)
    assert bad.metrics.kl_divergence > 1e-3
    assert not bad.passed
    assert any(r.startswith("top-1 agreement") and r.endswith("fail") for r in bad.reasons)


def test_nondeterministic_reference_widens_the_tolerance_and_is_reported() -> None:
    ref, golden = _model_outputs()
    repeat = ref + 1e-4 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(5))
    cand = ref + 1e-4 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(6))
    result = compare(_t(ref), _t(cand), _t(golden), _t(repeat), Criteria())
    assert not result.metrics.reference_deterministic
    assert result.metrics.repeat_rmse > result.metrics.reference_rmse
    assert result.passed
    assert any("not deterministic" in r for r in result.reasons)


def test_nan_candidate_fails_and_shape_mismatch_fails() -> None:
    ref, golden = _model_outputs()
    cand = ref.clone()
    cand[0, 0] = math.nan
    assert not compare(_t(ref), _t(cand), _t(golden), None, Criteria()).passed
    short = compare(_t(ref), _t(ref[:-1]), _t(golden), None, Criteria())
    assert not short.passed and short.reasons[0].startswith("shape")


def test_bad_tensors_and_criteria_are_named() -> None:
    with pytest.raises(BadTensor, match="reference: 7 bytes"):
        decode("reference", "FP32", [2], b"\0" * 7)
    with pytest.raises(BadTensor, match="datatype 'FP8'"):
        decode("golden", "FP8", [1], b"\0")
    ints = decode("candidate", "INT64", [2], encode(np.array([1, 2]), "INT64"))
    ref = _t(torch.ones(2))
    with pytest.raises(BadTensor, match="candidate: datatype INT64"):
        compare(ref, ints, None, None, Criteria())
    with pytest.raises(BadCriteria, match=r"criteria\.precision"):
        compare(ref, ref, None, None, Criteria(precision="fp8"))


def test_bf16_codec_round_trips_like_torch() -> None:
    x = torch.randn(100, generator=torch.Generator().manual_seed(7))
    ours = decode("x", "BF16", [100], encode(x.numpy(), "BF16"))
    assert np.array_equal(ours.values, x.to(torch.bfloat16).double().numpy())


def test_loss_curves() -> None:
    ref = [2.0, 1.5, 1.2, 1.0, 0.9]
    near = [v * (1 - 1e-4) for v in ref]
    ok = compare_loss(ref, near, LossCriteria(target_loss=1.0))
    assert ok.passed and ok.reference_steps_to_target == 4 and ok.candidate_steps_to_target == 4
    diverged = compare_loss(ref, [2.0, 1.8, 1.7, 1.65, 1.6], LossCriteria(target_loss=1.0))
    assert not diverged.passed and diverged.candidate_steps_to_target == -1
    assert any("step 5" in r and r.endswith("fail") for r in diverged.reasons)
    with pytest.raises(BadCriteria, match="candidate: 2 steps"):
        compare_loss(ref, [1.0, 2.0], LossCriteria())


def test_candidate_that_differs_from_itself_is_non_deterministic_with_its_repeat_error() -> None:
    ref, golden = _model_outputs()
    g = torch.Generator().manual_seed(7)
    first = ref + 1e-2 * torch.randn(ref.shape, generator=g)
    second = ref + 1e-2 * torch.randn(ref.shape, generator=g)
    result = compare(_t(ref), _t(first), _t(golden), _t(ref), Criteria(), candidate_repeat=_t(second))
    assert not result.passed and result.finding == "non-deterministic"
    assert result.reasons[0].startswith("non-deterministic: two candidate runs on the same inputs differ")
    assert result.reasons[0].endswith(": fail")
    m = result.metrics
    assert not m.candidate_deterministic and m.candidate_repeated
    assert m.candidate_repeat_max_abs == pytest.approx(float((first - second).abs().max()), rel=1e-6)
    assert m.candidate_repeat_rmse > 1e-2


def test_wrong_but_stable_is_named_apart_from_non_deterministic() -> None:
    ref, golden = _model_outputs()
    biased = ref + 1e-3  # the same wrong answer every run
    result = compare(
        _t(ref), _t(biased), _t(golden), _t(ref), Criteria(), candidate_repeat=_t(biased.clone())
    )
    assert not result.passed and result.finding == "wrong but stable"
    assert result.metrics.candidate_deterministic and result.metrics.candidate_repeat_max_abs == 0.0
    assert result.reasons[0].startswith("deterministic: ") and result.reasons[0].endswith("pass")
    assert any(r.startswith("rmse vs float64") and r.endswith("fail") for r in result.reasons)
    # without a repeat the failure is only "wrong": nothing says whether it is stable
    assert compare(_t(ref), _t(biased), _t(golden), None, Criteria()).finding == "wrong"


def test_repeat_noise_within_the_precision_tolerance_is_deterministic_enough() -> None:
    ref, golden = _model_outputs()
    wobble = ref + 1e-6 * torch.sign(ref)  # well inside allclose(atol=rtol=1e-4)
    result = compare(_t(ref), _t(ref), _t(golden), _t(ref), Criteria(), candidate_repeat=_t(wobble))
    assert result.passed and result.finding == ""
    assert result.metrics.candidate_deterministic and result.metrics.candidate_repeat_max_abs > 0


def test_a_shape_that_changes_between_runs_is_non_deterministic() -> None:
    ref, golden = _model_outputs()
    result = compare(_t(ref), _t(ref[:-1]), _t(golden), None, Criteria(), candidate_repeat=_t(ref[:-2]))
    assert not result.passed and result.finding == "non-deterministic"
    assert "shape changed between two runs" in result.reasons[0]
    same_wrong_shape = compare(
        _t(ref), _t(ref[:-1]), _t(golden), None, Criteria(), candidate_repeat=_t(ref[:-1])
    )
    assert same_wrong_shape.finding == "wrong but stable" and same_wrong_shape.reasons[0].startswith("shape")
