"""The verdict of a generation trial's candidate: correctness under the divergence rule,
compatibility as for every trial, latency as p99 TTFT and TPOT against the reference's at each
load level, and cost per million output tokens.

- correctness: the divergence rule (switchyard/judge/divergence.py); its figure names the
  first diverging position and why (a token outside the other's top-k, logprobs beyond the
  reference's own float64 error, or a candidate that changes between runs).
- latency: at every load level both paths measured, p99 TTFT and p99 TPOT may be at most
  `max_ttft_p99_regression` / `max_tpot_p99_regression` above the reference's; the worst level
  decides. Compilation while measuring makes it inconclusive.
- cost: the path's trial cost in the ledger (preparation, idle reserved time and failed work
  included, or preparation amortised over `amortize_over_jobs` jobs) per million output
  tokens of its generations (the ledger's token count), exact; at least
  `min_output_token_cost_saving` below the reference's. The ledger's own figure (the busy cost
  of the generation jobs alone, per million output tokens) is given beside it.
Pure: runs in the workflow sandbox.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from workflows.generation.latency import judge_level, time_per_token
from workflows.generation.metrics import load_label
from workflows.pipeline.compatibility import judge_compatibility
from workflows.pipeline.interleave import how_measured
from workflows.pipeline.path_state import PathState
from workflows.pipeline.types import example_note
from workflows.report.results import FAIL, PASS, SKIPPED, UNKNOWN
from workflows.spec.trial_io import Criterion, Verdict
from workflows.spec.trial_spec import Policy
from workflows.tensor.intervals import decide, rescaled


def _correctness(candidate: PathState) -> Criterion:
    g = candidate.generation
    if g is None:
        why = candidate.errors.get("correctness") or candidate.errors.get("prepare") or "did not run"
        return Criterion(UNKNOWN, f"not established: {why}", "not established")
    reason = "; ".join(g.reasons)
    if g.passed:
        at = (
            f"first divergence at position {g.first_divergence} (a near-tie)"
            if g.diverged
            else "tokens identical"
        )
        rmse = g.metrics.get("rmse")
        allowed = g.metrics.get("allowed_rmse")
        lp = f", logprob rmse {rmse:.3g} <= allowed {allowed:.3g}" if rmse is not None and allowed else ""
        return Criterion(PASS, reason, at + lp)
    if g.finding == "non-deterministic":
        return Criterion(FAIL, f"non-deterministic: {reason}", "non-deterministic: runs differ")
    bad = [s for s in g.sequences if not s["passed"]]
    if bad:
        first = min(bad, key=lambda s: s["first_divergence"])
        figure = (
            f"{g.finding}: first divergence at position {first['first_divergence']} (prompt {first['index']})"
        )
    else:
        m = g.metrics
        figure = (
            f"{g.finding}: logprob rmse {m.get('rmse', 0.0):.3g} > allowed {m.get('allowed_rmse', 0.0):.3g}"
        )
    return Criterion(FAIL, f"{g.finding}: {reason}", figure)


def _levels(state: PathState) -> dict[str, dict[str, Any]]:
    perf = state.generation_performance
    return {load_label(level["load"]): level for level in perf.levels} if perf else {}


def _latency(reference: PathState, candidate: PathState, policy: Policy, correct: bool) -> Criterion:
    if not correct:
        return Criterion(SKIPPED, "no speed verdict without correctness")
    problem = candidate.errors.get("performance") or reference.errors.get("performance")
    if problem:
        return Criterion(UNKNOWN, f"performance: {problem}", problem.split(";")[0])
    mine, theirs = _levels(candidate), _levels(reference)
    common = [label for label in mine if label in theirs]
    if not common:
        return Criterion(UNKNOWN, "no load level measured on both paths", "not comparable")
    judged = [
        judged
        for label in common
        for metric, allowed in (
            ("ttft_ms", policy.max_ttft_p99_regression),
            ("tpot_ms", policy.max_tpot_p99_regression),
        )
        if (judged := judge_level(label, metric, mine[label], theirs[label], allowed, policy.confidence))
    ]
    if not judged:
        return Criterion(UNKNOWN, "no TTFT or TPOT figure on both paths", "not comparable")
    result = (
        FAIL
        if any(j.result == FAIL for j in judged)
        else PASS
        if all(j.result == PASS for j in judged)
        else UNKNOWN
    )
    # the figure names the level that decided: the worst failure, else an undecided one, else the worst
    deciding = [j for j in judged if j.result == result] or judged
    figure = max(deciding, key=lambda j: j.excess).figure
    return Criterion(
        result,
        "; ".join(j.reason for j in judged)
        + f"; {how_measured(reference, candidate, candidate.generation_performance)}",
        figure,
    )


def cost_per_million_output_tokens(state: PathState, policy: Policy) -> Fraction | None:
    """Micro-units per million output tokens, exact (None: no tokens or no cost)."""
    econ, perf = state.economics, state.generation_performance
    # the ledger's token count of the path's jobs; the trial's own count where the ledger has none
    tokens = (
        econ.output_tokens if econ is not None and econ.output_tokens else perf.output_tokens if perf else 0
    )
    if econ is None or not tokens:
        return None
    if not policy.amortize_over_jobs or not econ.jobs_completed:
        return Fraction(econ.total_micros * 1_000_000, tokens)
    steady = Fraction((econ.total_micros - econ.prepare_micros) * 1_000_000, tokens)
    tokens_per_job = Fraction(tokens, econ.jobs_completed)
    return steady + Fraction(econ.prepare_micros * 1_000_000) / (policy.amortize_over_jobs * tokens_per_job)


def _cost(reference: PathState, candidate: PathState, policy: Policy, correct: bool) -> Criterion:
    if not correct:
        return Criterion(SKIPPED, "no completed generation within quality")
    econ, ref_econ = candidate.economics, reference.economics
    unpriced = candidate.economics_unpriced or reference.economics_unpriced
    if unpriced or econ is None or ref_econ is None or econ.unpriced or ref_econ.unpriced:
        problems = [s.ledger_problem for s in (candidate, reference) if s.economics_unpriced]
        why = next((p for p in problems if p), "usage without a price in force")
        return Criterion(UNKNOWN, f"unpriced: {why}", "unpriced")
    mine, ref = (
        cost_per_million_output_tokens(candidate, policy),
        cost_per_million_output_tokens(reference, policy),
    )
    if mine is None or ref is None:
        return Criterion(UNKNOWN, "no output tokens on one of the paths", "no output tokens")
    if not ref:
        return Criterion(
            UNKNOWN, "the reference path cost nothing in the ledger: no basis for a saving", "no basis"
        )
    saving = float(1 - mine / ref)
    need = policy.min_output_token_cost_saving
    basis = (
        f"preparation amortised over {policy.amortize_over_jobs} jobs"
        if policy.amortize_over_jobs
        else "all of the trial's cost in the ledger, preparation included"
    )
    tokens = econ.output_tokens or (
        candidate.generation_performance.output_tokens if candidate.generation_performance else 0
    )
    busy_only = (
        f"; the ledger's busy cost of the generations alone: {econ.cost_per_million_output_tokens_micros:,} "
        f"vs {ref_econ.cost_per_million_output_tokens_micros:,} per million"
        if econ.cost_per_million_output_tokens_micros and ref_econ.cost_per_million_output_tokens_micros
        else ""
    )
    reason = (
        f"cost per million output tokens {float(mine):,.0f} vs reference {float(ref):,.0f} {econ.currency} "
        f"micro-units ({basis}; {tokens} output tokens): saving {saving:+.1%}, "
        f"policy needs at least {need:+.0%}{busy_only}{example_note(econ, ref_econ)}"
    )
    figure = f"saving {saving:+.1%} per million output tokens (needs {need:+.0%})"
    spread = time_per_token(_levels(candidate), _levels(reference), policy.confidence)
    if spread is None:  # no blocks on both paths: the two exact figures decide
        return Criterion(PASS if saving >= need else FAIL, reason, figure)
    interval = rescaled(spread, float(mine / ref))
    decision = decide(interval, -need, "cost ratio")
    why = "its spread is that of the mean TPOT ratio over the same paired blocks: a token's cost is its time"
    return Criterion(
        decision.result, f"{reason}; {decision.reason} ({why})", f"{figure}; {interval.text('cost ratio')}"
    )


def judge_generation(reference: PathState, candidate: PathState, policy: Policy) -> dict[str, Criterion]:
    """The criteria of one generation candidate (verdict.judge turns them into the verdict)."""
    criteria = {"correctness": _correctness(candidate)}
    criteria["compatibility"] = judge_compatibility(candidate, policy)
    correct = criteria["correctness"].result == PASS
    criteria["latency"] = _latency(reference, candidate, policy, correct)
    criteria["cost"] = _cost(reference, candidate, policy, correct)
    return criteria


__all__ = ["Verdict", "cost_per_million_output_tokens", "judge_generation"]
