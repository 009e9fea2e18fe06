"""Output comparison against a justified tolerance, as `torch._dynamo.utils.same` does
(docs/architecture.md#trials).

The tolerance is not picked, it is derived from the reference path itself: both the reference
and the candidate are measured against a float64 run of the reference model (the "golden"
output), and the candidate's RMSE may be at most `multiplier` times the reference's own RMSE
(2x for fp32, 3x for bf16/fp16, and 3x as well for tensors under 1000 elements, where noise
dominates), plus a floor of tol/10 so that an exactly-equal reference (error 0) does not
demand an exactly-equal candidate. A candidate within allclose(atol=rtol=tol) of the reference
passes that check outright, as in `same`. If the reference is not deterministic (two runs
differ), its run-to-run RMSE is the larger error and widens the tolerance accordingly; the
response says so. For logits, cosine similarity, top-1/top-k agreement and the KL divergence
between the softmax distributions are checked as well.

Determinism is judged on both sides (repeats.py). Given a second candidate run on the same inputs, a
candidate whose two runs differ beyond its precision's tolerance (not allclose at tol, and more
than `multiplier` x the reference's own run-to-run noise) is "non-deterministic", with the
repeat error; that fails apart from, and is named before, any error against the reference. A
candidate whose runs agree but whose values are wrong is "wrong but stable".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from switchyard.judge.judge_errors import BadCriteria, BadTensor
from switchyard.judge.repeats import candidate_stability, reference_noise, rmse, wrong_finding
from switchyard.judge.tensors import FLOAT_TYPES, DecodedTensor
from switchyard.judge.tolerances import Tolerances

Array = npt.NDArray[np.float64]

# Per precision: (error multiplier, tol, min cosine, min top-1, min top-k, max KL in nats).
# tol follows the dynamo benchmark harness (1e-4 fp32, 1e-3 fp16, 1e-2 bf16); cosine 0.99 is
# `same`'s cos_similarity threshold, tightened to 0.999 for fp32 where errors are ~1e-7.
DEFAULTS: dict[str, tuple[float, float, float, float, float, float]] = {
    "fp32": (2.0, 1e-4, 0.999, 0.99, 0.95, 1e-3),
    "fp16": (3.0, 1e-3, 0.99, 0.95, 0.90, 1e-2),
    "bf16": (3.0, 1e-2, 0.99, 0.95, 0.90, 1e-2),
}
SMALL_TENSOR = 1000


@dataclass(frozen=True)
class Criteria(Tolerances):
    """What the candidate is held to at `precision`; zero tolerances mean its default."""

    precision: str = "fp32"

    def resolved(self) -> Criteria:
        precision = self.precision or "fp32"
        if precision not in DEFAULTS:
            raise BadCriteria(f"criteria.precision {precision!r} is not one of {', '.join(DEFAULTS)}")
        for name in ("error_multiplier", "min_cosine", "min_top1_agreement", "min_topk_agreement", "max_kl"):
            value = getattr(self, name)
            if value < 0 or not math.isfinite(value):
                raise BadCriteria(f"criteria.{name} must be a finite number >= 0, got {value}")
        if self.top_k < 0:
            raise BadCriteria(f"criteria.top_k must be >= 0, got {self.top_k}")
        mult, tol, cos, top1, topk, kl = DEFAULTS[precision]
        return Criteria(
            precision=precision,
            error_multiplier=self.error_multiplier or mult,
            min_cosine=self.min_cosine or cos,
            min_top1_agreement=self.min_top1_agreement or top1,
            min_topk_agreement=self.min_topk_agreement or topk,
            top_k=self.top_k or 5,
            max_kl=self.max_kl or kl,
            logits=self.logits,
            atol_floor=self.atol_floor or tol,
        )


@dataclass(frozen=True)
class Metrics:
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    mismatch_share: float = 0.0
    rmse: float = 0.0
    reference_rmse: float = 0.0
    cosine: float = 1.0
    top1_agreement: float = 1.0
    topk_agreement: float = 1.0
    kl_divergence: float = 0.0
    reference_deterministic: bool = True
    reference_repeat_max_abs: float = 0.0
    allowed_rmse: float = 0.0
    repeat_rmse: float = 0.0
    elements: int = 0
    allclose: bool = False
    candidate_deterministic: bool = True
    candidate_repeat_max_abs: float = 0.0
    candidate_repeat_rmse: float = 0.0
    candidate_repeated: bool = False


@dataclass(frozen=True)
class Comparison:
    metrics: Metrics
    passed: bool
    reasons: list[str] = field(default_factory=list)
    justification: str = ""
    finding: str = ""  # "non-deterministic" | "wrong but stable" | "wrong" | "" (passed)

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "FAIL"


def _cosine(a: Array, b: Array) -> float:
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 and nb == 0.0:
        return 1.0
    return float(np.dot(a.ravel(), b.ravel()) / max(na * nb, 1e-300))


def _log_softmax(x: Array) -> Array:
    shifted = x - x.max(axis=-1, keepdims=True)
    out: Array = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return out


def logit_metrics(reference: Array, candidate: Array, k: int) -> tuple[float, float, float]:
    """Top-1 agreement, mean top-k overlap and mean KL(reference || candidate) over positions."""
    vocab = reference.shape[-1]
    ref = reference.reshape(-1, vocab)
    cand = candidate.reshape(-1, vocab)
    k = min(k, vocab)
    top1 = float(np.mean(ref.argmax(axis=-1) == cand.argmax(axis=-1)))
    ref_k = np.argsort(-ref, axis=-1, kind="stable")[:, :k]
    cand_k = np.argsort(-cand, axis=-1, kind="stable")[:, :k]
    overlap = [len(set(r.tolist()) & set(c.tolist())) / k for r, c in zip(ref_k, cand_k, strict=True)]
    log_p, log_q = _log_softmax(ref), _log_softmax(cand)
    kl = float(np.mean(np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)))
    return top1, float(np.mean(overlap)), max(kl, 0.0)


def _check_float(name: str, tensor: DecodedTensor) -> None:
    if tensor.datatype not in FLOAT_TYPES:
        raise BadTensor(
            f"{name}: datatype {tensor.datatype} is not floating point; compare FP64/32/16 or BF16"
        )


def compare(
    reference: DecodedTensor,
    candidate: DecodedTensor,
    golden: DecodedTensor | None,
    reference_repeat: DecodedTensor | None,
    criteria: Criteria,
    candidate_repeat: DecodedTensor | None = None,
) -> Comparison:
    """Judge `candidate` against `reference`, with the tolerance derived from `golden`, and
    the candidate's determinism from `candidate_repeat` (a second run on the same inputs)."""
    c = criteria.resolved()
    _check_inputs(reference, candidate, golden, reference_repeat, candidate_repeat, c)
    if candidate.shape != reference.shape:
        return _shape_mismatch(reference, candidate, candidate_repeat)

    ref, cand = reference.values, candidate.values
    tol = c.atol_floor
    finite = bool(np.isfinite(cand).all())
    diff = np.abs(cand - ref)
    mismatch = ~np.isclose(ref, cand, rtol=tol, atol=tol)  # as torch.allclose(ref, res)
    allclose = finite and not bool(mismatch.any())
    repeat_max, repeat_rmse = reference_noise(reference_repeat, ref)
    deterministic = repeat_max == 0.0

    multiplier = c.error_multiplier
    if criteria.error_multiplier == 0.0 and ref.size < SMALL_TENSOR:
        multiplier = max(multiplier, 3.0)
    rule = _rmse_rule(ref, cand, golden, c, criteria, multiplier, repeat_rmse, finite, allclose)
    reasons = [rule.reason]
    if not finite:
        reasons.append("finite: candidate has NaN or Inf: fail")
    cosine, top1, topk, kl, agree = _agreement(ref, cand, c, finite, allclose, reasons)
    passed = finite and rule.ok and agree
    if not deterministic:
        reasons.append(f"reference not deterministic: two runs differ by up to {repeat_max:.3g} (noted)")
    cand_stable, cand_repeat_max, cand_repeat_rmse = candidate_stability(
        cand, candidate_repeat, tol, multiplier * repeat_rmse + tol / 10.0, c.precision, reasons
    )
    passed = passed and cand_stable
    metrics = Metrics(
        **_error_figures(diff, mismatch, ref, tol),
        rmse=rule.cand_err,
        reference_rmse=rule.ref_err,
        cosine=cosine,
        top1_agreement=top1,
        topk_agreement=topk,
        kl_divergence=kl,
        reference_deterministic=deterministic,
        reference_repeat_max_abs=repeat_max,
        allowed_rmse=rule.allowed,
        repeat_rmse=repeat_rmse,
        elements=int(ref.size),
        allclose=allclose,
        candidate_deterministic=cand_stable,
        candidate_repeat_max_abs=cand_repeat_max,
        candidate_repeat_rmse=cand_repeat_rmse,
        candidate_repeated=candidate_repeat is not None,
    )
    finding = "" if passed else "non-deterministic" if not cand_stable else wrong_finding(candidate_repeat)
    return Comparison(metrics, passed, reasons, rule.justification, finding)


def _error_figures(diff: Array, mismatch: npt.NDArray[np.bool_], ref: Array, tol: float) -> dict[str, float]:
    denom = np.maximum(np.abs(ref), tol)
    return {
        "max_abs_error": float(diff.max()) if diff.size else 0.0,
        "max_rel_error": float((diff / denom).max()) if diff.size else 0.0,
        "mismatch_share": float(mismatch.mean()) if mismatch.size else 0.0,
    }


def _agreement(
    ref: Array, cand: Array, c: Criteria, finite: bool, allclose: bool, reasons: list[str]
) -> tuple[float, float, float, float, bool]:
    """Cosine similarity, and for logits top-1/top-k agreement and KL divergence; each adds its
    reason. (cosine, top1, topk, kl, all passed)."""
    cosine = _cosine(ref, cand) if finite else 0.0
    ok = allclose or cosine >= c.min_cosine
    reasons.append(f"cosine {cosine:.6f} >= {c.min_cosine:g}: {'pass' if ok else 'fail'}")
    top1 = topk = 1.0
    kl = 0.0
    if c.logits:
        top1, topk, kl, logits_ok = _logit_checks(ref, cand, c, finite, reasons)
        ok = ok and logits_ok
    return cosine, top1, topk, kl, ok


def _check_inputs(
    reference: DecodedTensor,
    candidate: DecodedTensor,
    golden: DecodedTensor | None,
    reference_repeat: DecodedTensor | None,
    candidate_repeat: DecodedTensor | None,
    c: Criteria,
) -> None:
    _check_float("reference", reference)
    _check_float("candidate", candidate)
    if golden is not None:
        _check_float("golden", golden)
        if golden.shape != reference.shape:
            raise BadTensor(
                f"golden: shape {list(golden.shape)} differs from reference {list(reference.shape)}"
            )
    if reference_repeat is not None and reference_repeat.shape != reference.shape:
        raise BadTensor(
            f"reference_repeat: shape {list(reference_repeat.shape)} differs from reference "
            f"{list(reference.shape)}"
        )
    if candidate_repeat is not None:
        _check_float("candidate_repeat", candidate_repeat)
    if c.logits and not reference.shape:
        raise BadCriteria("criteria.logits needs outputs with a last (vocabulary) dimension")


def _shape_mismatch(
    reference: DecodedTensor, candidate: DecodedTensor, candidate_repeat: DecodedTensor | None
) -> Comparison:
    reason = f"shape: candidate {list(candidate.shape)} differs from reference {list(reference.shape)}: fail"
    shape_reasons = [reason]
    stable = candidate_repeat is None or candidate_repeat.shape == candidate.shape
    if not stable:
        assert candidate_repeat is not None
        shape_reasons.insert(
            0,
            f"non-deterministic: the candidate's shape changed between two runs on the same inputs "
            f"({list(candidate.shape)}, then {list(candidate_repeat.shape)}): fail",
        )
    metrics = Metrics(
        elements=reference.values.size,
        candidate_deterministic=stable,
        candidate_repeated=candidate_repeat is not None,
    )
    finding = "non-deterministic" if not stable else wrong_finding(candidate_repeat)
    return Comparison(metrics, False, shape_reasons, "shapes must agree", finding)


@dataclass(frozen=True)
class _RmseRule:
    """The error rule applied: with a float64 run, the reference's own error times the
    multiplier; without one, allclose to the reference."""

    ref_err: float
    cand_err: float
    allowed: float
    ok: bool
    reason: str
    justification: str


def _rmse_rule(
    ref: Array,
    cand: Array,
    golden: DecodedTensor | None,
    c: Criteria,
    criteria: Criteria,
    multiplier: float,
    repeat_rmse: float,
    finite: bool,
    allclose: bool,
) -> _RmseRule:
    tol = c.atol_floor
    if golden is None:
        return _RmseRule(
            0.0,
            rmse(ref, cand),
            tol,
            allclose,
            f"allclose to reference (atol=rtol={tol:g}), no float64 run supplied: "
            + ("pass" if allclose else "fail"),
            f"No float64 run was supplied, so the justified rule could not be applied; fell back to "
            f"allclose(atol=rtol={tol:g}) against the reference, the default tol for {c.precision}.",
        )
    ref_err = rmse(golden.values, ref)
    cand_err = rmse(golden.values, cand) if finite else math.inf
    basis = max(ref_err, repeat_rmse)
    why = (
        "3x for bf16/fp16 and for tensors under 1000 elements, where noise dominates"
        if multiplier == 3.0
        else "2x for fp32"
        if criteria.error_multiplier == 0.0
        else "as the criteria ask"
    )
    allowed = multiplier * basis + tol / 10.0
    rmse_ok = allclose or cand_err <= allowed
    reason = (
        f"rmse vs float64: candidate {cand_err:.3g} <= {multiplier:g} x reference {basis:.3g} "
        f"+ floor {tol / 10.0:.3g} = {allowed:.3g}"
        + (" (within allclose of the reference)" if allclose and cand_err > allowed else "")
        + (": pass" if rmse_ok else ": fail")
    )
    justification = (
        f"No threshold was picked: the reference path's own error against a float64 run of the "
        f"same model is {ref_err:.3g} RMSE"
        + (
            f" (its run-to-run noise {repeat_rmse:.3g} is larger and is used)"
            if repeat_rmse > ref_err
            else ""
        )
        + f"; a {c.precision} candidate may be at most {multiplier:g}x that ({why}; "
        f"the rule of torch._dynamo.utils.same), plus a floor of tol/10 = {tol / 10.0:.3g} so an "
        f"exact reference does not demand an exact candidate; allclose(atol=rtol={tol:g}) to the "
        "reference passes outright."
    )
    return _RmseRule(ref_err, cand_err, allowed, rmse_ok, reason, justification)


def _logit_checks(
    ref: Array, cand: Array, c: Criteria, finite: bool, reasons: list[str]
) -> tuple[float, float, float, bool]:
    """Top-1 and top-k agreement and KL divergence of the logits; each adds its reason."""
    top1, topk, kl = logit_metrics(ref, cand, c.top_k) if finite else (0.0, 0.0, math.inf)
    checks = (
        (f"top-1 agreement {top1:.4f} >= {c.min_top1_agreement:g}", top1 >= c.min_top1_agreement),
        (f"top-{c.top_k} agreement {topk:.4f} >= {c.min_topk_agreement:g}", topk >= c.min_topk_agreement),
        (f"KL divergence {kl:.3g} nats <= {c.max_kl:g}", kl <= c.max_kl),
    )
    ok = True
    for text, passed in checks:
        reasons.append(f"{text}: {'pass' if passed else 'fail'}")
        ok = ok and passed
    return top1, topk, kl, ok
