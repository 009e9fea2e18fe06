"""Greedy generations compared token by token: where two paths diverge, and whether they may.

One implementation for the trial's correctness phase (workflows/generation/activities.py) and
the router's shadow of generative models (services/router/shadow_divergence.py). The rule:

1. Tokens must be equal up to the first divergence.
2. At the first divergence each side's token must be in the other side's top-k at that
   position (the rule of vLLM's `check_logprobs_close`): a near-tie that rounding may flip,
   not a different model. After it the sequences are conditioned on different prefixes and
   are not compared any further (vLLM breaks there too).
3. On the positions where both paths chose the same tokens, the candidate's logprobs are
   judged as tensors are (services/evaluator/compare.py): within allclose(atol=rtol=tol) of
   the reference's, or with an RMSE against the reference model's float64 ("golden") run of at
   most `multiplier` x the reference's own RMSE against it, plus tol/10. Without a golden run,
   allclose at tol decides, and the justification says so.
4. A candidate whose two greedy runs differ (tokens, or logprobs beyond the same tolerance) is
   non-deterministic, named before anything else.

Pure (numpy only), no I/O; JSON-friendly results.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.evaluator.compare import SMALL_TENSOR, Criteria


@dataclass(frozen=True)
class Generated:
    """One greedy generation: the new token ids and, per position, the chosen token's logprob
    and the top-k (token, logprob) pairs, most likely first (empty lists: no logprobs)."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...] = ()
    top: tuple[tuple[tuple[int, float], ...], ...] = ()

    @staticmethod
    def of(data: dict[str, Any]) -> Generated:
        return Generated(
            tuple(int(t) for t in data.get("tokens", [])),
            tuple(float(x) for x in data.get("logprobs", [])),
            tuple(tuple((int(t), float(lp)) for t, lp in row) for row in data.get("top", [])),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": list(self.tokens),
            "logprobs": list(self.logprobs),
            "top": [[[t, lp] for t, lp in row] for row in self.top],
        }


def first_divergence(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """The first position where the sequences differ (one ending before the other counts),
    or -1 if they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


def _rank(token: int, top: tuple[tuple[int, float], ...]) -> int:
    """1-based rank of `token` in a top-k list, 0 if absent."""
    return next((i + 1 for i, (t, _) in enumerate(top) if t == token), 0)


@dataclass
class SequenceCheck:
    """One prompt's pair of generations under the rule."""

    index: int
    passed: bool
    length: int  # tokens of the reference
    first_divergence: int = -1  # -1: identical
    reference_token: int | None = None
    candidate_token: int | None = None
    reference_rank_in_candidate: int = 0  # 1-based rank in the candidate's top-k; 0 = absent
    candidate_rank_in_reference: int = 0
    reference_logprob: float | None = None
    candidate_logprob: float | None = None
    reason: str = ""


def check_sequence(index: int, reference: Generated, candidate: Generated, top_k: int) -> SequenceCheck:
    """Rules 1 and 2 for one pair: where they diverge, and whether each token was in the
    other's top-k there."""
    at = first_divergence(reference.tokens, candidate.tokens)
    check = SequenceCheck(index, True, len(reference.tokens), at)
    if at < 0:
        check.reason = f"identical ({len(reference.tokens)} tokens)"
        return check
    if at >= len(reference.tokens) or at >= len(candidate.tokens):
        shorter = "reference" if at >= len(reference.tokens) else "candidate"
        check.passed = False
        check.reason = (
            f"position {at}: the {shorter} ended after {at} tokens, the other went on "
            f"({len(reference.tokens)} vs {len(candidate.tokens)} tokens)"
        )
        return check
    r, c = reference.tokens[at], candidate.tokens[at]
    check.reference_token, check.candidate_token = r, c
    if at < len(reference.logprobs):
        check.reference_logprob = reference.logprobs[at]
    if at < len(candidate.logprobs):
        check.candidate_logprob = candidate.logprobs[at]
    if at >= len(reference.top) or at >= len(candidate.top):
        side = "reference" if at >= len(reference.top) else "candidate"
        check.passed = False
        check.reason = (
            f"position {at}: reference token {r} vs candidate token {c}; the {side} has no top-{top_k} "
            "logprobs there, so the near-tie rule cannot be checked"
        )
        return check
    check.reference_rank_in_candidate = _rank(r, candidate.top[at][:top_k])
    check.candidate_rank_in_reference = _rank(c, reference.top[at][:top_k])
    check.passed = bool(check.reference_rank_in_candidate and check.candidate_rank_in_reference)

    def where(token: int, rank: int, side: str) -> str:
        return (
            f"{token} is rank {rank} in the {side}'s top-{top_k}"
            if rank
            else (f"{token} is not in the {side}'s top-{top_k}")
        )

    lp = ""
    if check.reference_logprob is not None and check.candidate_logprob is not None:
        lp = f" (logprobs {check.reference_logprob:.4f} vs {check.candidate_logprob:.4f})"
    check.reason = (
        f"position {at}: reference token {r} vs candidate token {c}{lp}; "
        f"{where(r, check.reference_rank_in_candidate, 'candidate')}, "
        f"{where(c, check.candidate_rank_in_reference, 'reference')}: "
        + ("a near-tie, allowed" if check.passed else "not a near-tie")
    )
    return check


@dataclass
class GenerationVerdict:
    passed: bool
    finding: str  # "non-deterministic" | "wrong but stable" | "wrong" | ""
    sequences: list[SequenceCheck]
    metrics: dict[str, Any]
    reasons: list[str]
    justification: str
    diverged: list[int] = field(default_factory=list)  # indexes of prompts whose tokens diverged

    @property
    def first_divergence(self) -> int:
        """The earliest diverging position over all prompts, -1 if none diverged."""
        points = [s.first_divergence for s in self.sequences if s.first_divergence >= 0]
        return min(points) if points else -1


def _agreeing(*runs: Generated) -> int:
    """How many leading positions all runs chose the same tokens at (and have logprobs for)."""
    n = min(min(len(r.tokens), len(r.logprobs)) for r in runs)
    for other in runs[1:]:
        d = first_divergence(runs[0].tokens[:n], other.tokens[:n])
        n = n if d < 0 else d
    return n


def _rmse(a: list[float], b: list[float]) -> float:
    if not a:
        return 0.0
    return float(np.sqrt(np.mean((np.asarray(a) - np.asarray(b)) ** 2)))


@dataclass
class _Logprobs:
    """Logprobs at the positions where every run (and the golden, if any) chose the same tokens."""

    ref: list[float] = field(default_factory=list)
    cand: list[float] = field(default_factory=list)
    gold: list[float] = field(default_factory=list)
    repeat: list[float] = field(default_factory=list)


def _agreeing_logprobs(
    reference: list[Generated],
    candidate: list[Generated],
    golden: list[Generated] | None,
    reference_repeat: list[Generated] | None,
) -> _Logprobs:
    lp = _Logprobs()
    for i, (r, k) in enumerate(zip(reference, candidate, strict=True)):
        runs = [r, k]
        if golden:
            runs.append(golden[i])
        if reference_repeat:
            runs.append(reference_repeat[i])
        n = _agreeing(*runs)
        lp.ref += r.logprobs[:n]
        lp.cand += k.logprobs[:n]
        if golden:
            lp.gold += golden[i].logprobs[:n]
        if reference_repeat:
            lp.repeat += reference_repeat[i].logprobs[:n]
    return lp


def _determinism(
    candidate: list[Generated],
    candidate_repeat: list[Generated],
    lp: _Logprobs,
    multiplier: float,
    tol: float,
    metrics: dict[str, Any],
) -> str:
    """The candidate against its own second run: the failing reason, or "" when stable."""
    unstable = [
        i for i, (k, again) in enumerate(zip(candidate, candidate_repeat, strict=True))
        if first_divergence(k.tokens, again.tokens) >= 0
    ]  # fmt: skip
    again_lp: list[float] = []
    own_lp: list[float] = []
    for k, again in zip(candidate, candidate_repeat, strict=True):
        m = _agreeing(k, again)
        own_lp += k.logprobs[:m]
        again_lp += again.logprobs[:m]
    noise = _rmse(lp.repeat, lp.ref) if lp.repeat else 0.0
    repeat_rmse = _rmse(again_lp, own_lp)
    metrics["candidate_repeat_rmse"] = repeat_rmse
    wobble = own_lp and not np.allclose(again_lp, own_lp, atol=tol, rtol=tol)
    if not (unstable or (wobble and repeat_rmse > multiplier * noise)):
        return ""
    what = (
        f"prompts {unstable} gave other tokens on a second run"
        if unstable
        else f"logprobs differ between runs by rmse {repeat_rmse:.3g}"
    )
    return f"determinism: {what}: fail"


def _logprob_rule(
    lp: _Logprobs, multiplier: float, tol: float, close: bool, metrics: dict[str, Any]
) -> tuple[bool, str, str]:
    """(passed, reason, justification) of the logprobs on the agreeing positions."""
    n = len(lp.ref)
    if lp.gold and n:
        ref_err = _rmse(lp.ref, lp.gold)
        cand_err = _rmse(lp.cand, lp.gold)
        noise = _rmse(lp.repeat, lp.ref) if lp.repeat else 0.0
        allowed = multiplier * max(ref_err, noise) + tol / 10
        metrics.update(
            rmse=cand_err, reference_rmse=ref_err, reference_repeat_rmse=noise, allowed_rmse=allowed
        )
        ok = close or cand_err <= allowed
        reason = (
            f"logprobs on {n} agreeing positions: rmse vs float64 {cand_err:.3g} "
            + ("<=" if cand_err <= allowed else ">")
            + f" allowed {allowed:.3g}"
            + (" (allclose to the reference at tol)" if close else "")
            + (": pass" if ok else ": fail")
        )
        justification = (
            f"reference's own logprob error vs its float64 run: rmse {ref_err:.3g}"
            + (f" (run-to-run {noise:.3g})" if lp.repeat else "")
            + f"; allowed = {multiplier:g} x {max(ref_err, noise):.3g} + tol/10 ({tol / 10:.3g}), "
            f"as torch._dynamo.utils.same derives it; allclose(atol=rtol={tol:g}) passes outright"
        )
        return ok, reason, justification
    metrics.update(rmse=metrics["logprob_rmse_vs_reference"], allowed_rmse=0.0)
    reason = (
        f"logprobs on {n} agreeing positions: max |diff| {metrics['max_abs_logprob_diff']:.3g}, "
        f"allclose at tol {tol:g}" + (": pass" if close else ": fail")
    )
    justification = (
        f"no float64 run of the reference: logprobs judged by allclose(atol=rtol={tol:g}) alone"
        if n
        else "no positions where both paths agree: logprobs not compared"
    )
    return close, reason, justification


def _token_reason(checks: list[SequenceCheck], top_k: int, identical: int) -> str:
    """1 and 2: tokens, and the near-tie rule at each divergence."""
    bad = [s for s in checks if not s.passed]
    near = [s for s in checks if s.passed and s.first_divergence >= 0]
    summary = f"tokens: {identical} of {len(checks)} prompts identical" + (
        f", {len(near)} diverged at a near-tie (top-{top_k} rule)" if near else ""
    )
    if bad:
        first = min(bad, key=lambda s: s.first_divergence)
        return f"{summary}; prompt {first.index}: {first.reason}: fail"
    return f"{summary}: pass"


def _generation_metrics(
    reference: list[Generated],
    checks: list[SequenceCheck],
    lp: _Logprobs,
    diff: Any,
    top_k: int,
    tol: float,
    multiplier: float,
) -> dict[str, Any]:
    n = len(lp.ref)
    return {
        "prompts": len(reference),
        "tokens": sum(len(r.tokens) for r in reference),
        "identical": sum(1 for s in checks if s.first_divergence < 0),
        "diverged": sum(1 for s in checks if s.first_divergence >= 0),
        "first_divergence": min((s.first_divergence for s in checks if s.first_divergence >= 0), default=-1),
        "logprob_positions": n,
        "max_abs_logprob_diff": float(diff.max()) if n else 0.0,
        "logprob_rmse_vs_reference": _rmse(lp.cand, lp.ref),
        "top_k": top_k,
        "tol": tol,
        "error_multiplier": multiplier,
    }


def compare_generations(
    reference: list[Generated],
    candidate: list[Generated],
    criteria: Criteria,
    golden: list[Generated] | None = None,
    reference_repeat: list[Generated] | None = None,
    candidate_repeat: list[Generated] | None = None,
) -> GenerationVerdict:
    """The rule over every prompt's pair (index i of each list is prompt i)."""
    c = criteria.resolved()
    top_k, tol = c.top_k, c.atol_floor
    if len(reference) != len(candidate):
        return GenerationVerdict(
            False, "wrong", [], {}, [f"prompts: {len(reference)} vs {len(candidate)}: fail"], ""
        )
    checks = [
        check_sequence(i, r, k, top_k) for i, (r, k) in enumerate(zip(reference, candidate, strict=True))
    ]
    lp = _agreeing_logprobs(reference, candidate, golden, reference_repeat)
    n = len(lp.ref)
    multiplier = max(c.error_multiplier, 3.0) if n < SMALL_TENSOR else c.error_multiplier
    diff = np.abs(np.asarray(lp.cand) - np.asarray(lp.ref)) if n else np.zeros(0)
    close = bool(np.all(diff <= tol + tol * np.abs(np.asarray(lp.ref)))) if n else True
    metrics = _generation_metrics(reference, checks, lp, diff, top_k, tol, multiplier)
    reasons: list[str] = []
    finding = ""
    # 4. determinism of the candidate, named first
    if candidate_repeat:
        unstable = _determinism(candidate, candidate_repeat, lp, multiplier, tol, metrics)
        if unstable:
            finding = "non-deterministic"
            reasons.append(unstable)
    reasons.append(_token_reason(checks, top_k, metrics["identical"]))
    # 3. logprobs on the agreeing positions
    ok, reason, justification = _logprob_rule(lp, multiplier, tol, close, metrics)
    reasons.append(reason)
    if not ok:
        metrics["logprobs_failed"] = True
    passed = not finding and all(s.passed for s in checks) and ok
    if not passed and not finding:
        finding = "wrong but stable" if candidate_repeat else "wrong"
    justification += f"; near-tie rule: at the first divergence each token in the other's top-{top_k}"
    return GenerationVerdict(
        passed,
        finding,
        checks,
        {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()},
        reasons,
        justification,
        [s.index for s in checks if s.first_divergence >= 0],
    )
