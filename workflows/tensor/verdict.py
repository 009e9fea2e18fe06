"""The tensor kind's criteria of a candidate path, each with its reason and decisive figure.

Criteria in order: correctness (the evaluator's verdict, naming a non-deterministic candidate
apart from a wrong but stable one, and failed by a single answer under load beyond tolerance,
named with its count: workflows/tensor/under_load.py; a path that fails it gets no speed
verdict), compatibility (host-fallback ops, graph breaks, recompiles, unsupported dtypes,
adaptations, judged by the policy's maximums: see workflows/pipeline/compatibility.py), latency
(the single-stream p95 ratio to the reference's, decided on its paired block-bootstrap interval
at the policy's confidence: fail only when the whole interval lies beyond the allowed
regression, pass only when it lies within, else inconclusive with the requests that would settle
it, after the measurement extended itself while it could (workflows/tensor/extension.py); the
reference's A/A noise floor beside it, see workflows/tensor/intervals.py; compilation while
measuring makes it inconclusive, and so does a fault during the measurement, named: requests
that failed or stalled; a regression that coincides with a host fallback names the op), memory
(the candidate's process memory growth per 1,000 requests, failed only when both its own
slope's interval and its slope beyond the reference's lie above the policy's bound:
workflows/tensor/growth.py), and cost (cost per completed job from the ledger, at least the
policy's saving; inconclusive too after a fault during the measurement, whose time it holds).
The training kind adds its criterion before cost (workflows/training/verdict.py); `Verdict.of`
(workflows/spec/trial_io.py) turns the criteria into the verdict.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

from workflows.pipeline.compatibility import fallback_summary, findings, judge_compatibility
from workflows.pipeline.interleave import how_measured
from workflows.pipeline.path_state import PathState
from workflows.pipeline.types import EconomicsResult, OutputVerdict, ScenarioResult, example_note
from workflows.report.results import FAIL, PASS, SKIPPED, UNKNOWN
from workflows.spec.trial_io import Criterion
from workflows.spec.trial_spec import Policy
from workflows.tensor import extension, growth, under_load
from workflows.tensor.intervals import (
    Decision,
    RatioInterval,
    decide,
    drift,
    level_text,
    mean,
    noise_floor,
    paired_drift,
    ratio_interval,
    rescaled,
)

Criteria = dict[str, Criterion]
# Drift compares typical latency (a warm-up moves all of it), not the tail: a third's p95 over
# blocks of a few samples is their maximum, and one host hiccup in the last third of an honest
# path read as drift (2.98 [1.38, 3.85] in one run of tests/trial/test_under_load.py).
DRIFT_PERCENTILE = 50.0


def _single(state: PathState) -> ScenarioResult | None:
    scenarios = state.performance.scenarios if state.performance else []
    single = [s for s in scenarios if s.scenario == "single-stream"]
    chosen = single or sorted(scenarios, key=lambda s: s.batch_size)
    return chosen[0] if chosen else None


def cost_per_job(econ: EconomicsResult | None, policy: Policy) -> Fraction:
    """Cost per completed job in micro-units, exact: all cost / completed jobs, or with
    preparation spread over a job horizon. Exact, because a local trial's job can cost less
    than one micro-unit, and a rounded 0 would compare as "no cost" (or no jobs)."""
    if econ is None or not econ.jobs_completed:
        return Fraction(0)
    jobs, total, prepare = econ.jobs_completed, econ.total_micros, econ.prepare_micros
    if not policy.amortize_over_jobs:
        return Fraction(total, jobs)
    return Fraction(total - prepare, jobs) + Fraction(prepare, policy.amortize_over_jobs)


def criteria(reference: PathState, candidate: PathState, policy: Policy) -> Criteria:
    """The criteria of one candidate path against the reference path, in order."""
    criteria = {"correctness": _correctness(candidate)}
    criteria["compatibility"] = judge_compatibility(candidate, policy)
    correct = criteria["correctness"].result == PASS
    criteria["latency"] = _latency(reference, candidate, policy, correct)
    criteria["memory"] = _memory(reference, candidate, policy)
    criteria["cost"] = _cost(reference, candidate, policy, correct)
    return criteria


def _correctness(candidate: PathState) -> Criterion:
    corr = candidate.correctness
    if corr is None:
        errors = candidate.errors
        why = errors.get("correctness") or errors.get("prepare") or "did not run"
        return Criterion(UNKNOWN, f"not established: {why}", "not established")
    figure = _correctness_figure(corr.outputs)
    check = candidate.performance.under_load if candidate.performance else None
    text = under_load.failure(check)
    if corr.passed and text and check is not None:
        return Criterion(FAIL, f"{text}: {check.first_reason}", text)
    if corr.passed:
        reasons = [r for o in corr.outputs for r in o.reasons] + [under_load.note(check)]
        return Criterion(PASS, "; ".join(filter(None, reasons)), figure)
    failed = [f"{o.output}: {r}" for o in corr.outputs for r in o.reasons if r.endswith("fail")]
    kinds = [o.finding for o in corr.outputs if not o.passed]
    kind = next((k for k in ("non-deterministic", "wrong but stable", "wrong") if k in kinds), "")
    reason = "; ".join(failed) or "outputs differ from the reference"
    return Criterion(FAIL, f"{kind}: {reason}" if kind else reason, figure)


def _latency(reference: PathState, candidate: PathState, policy: Policy, correct: bool) -> Criterion:
    if not correct:
        return Criterion(SKIPPED, "no speed verdict without correctness")
    problem = candidate.errors.get("performance")
    if problem:
        return Criterion(UNKNOWN, f"performance: {problem}", problem.split(";")[0])
    mine, theirs = _single(candidate), _single(reference)
    if mine is None or theirs is None or reference.errors.get("performance"):
        return Criterion(UNKNOWN, "no comparable measurement on both paths", "not comparable")
    allowed = policy.max_p95_regression
    where = f"{mine.scenario} batch {mine.batch_size}"
    change = mine.p95_ms / theirs.p95_ms - 1 if theirs.p95_ms else 0.0
    reason = (
        f"p95 {mine.p95_ms:.3f} ms vs reference {theirs.p95_ms:.3f} ms ({where}): {change:+.1%}, "
        f"allowed up to {allowed:+.0%}"
    )
    host = fallback_summary(findings(candidate))
    if change > 0 and host:
        reason += f"; the regression coincides with host fallback: {host}"
    slower = ", with host fallback" if change > 0 and host else ""
    if not mine.blocks_ms or not theirs.blocks_ms:  # a result from before blocks were kept
        figure = f"p95 {change:+.1%} (allowed {allowed:+.0%})" + slower
        return Criterion(PASS if mine.p95_ms <= theirs.p95_ms * (1 + allowed) else FAIL, reason, figure)
    return _latency_interval(
        mine, theirs, policy, reason, slower, how_measured(reference, candidate, candidate.performance)
    )


def _latency_interval(
    mine: ScenarioResult, theirs: ScenarioResult, policy: Policy, reason: str, slower: str, how: str
) -> Criterion:
    """Decide on the paired block-bootstrap interval of the p95 ratio, beside the noise floor;
    an extended measurement at its stricter level (workflows/tensor/extension.py)."""
    level = extension.verdict_level(mine.extension, policy.confidence)
    try:
        interval = ratio_interval(mine.blocks_ms, theirs.blocks_ms, level=level)
        # blocks may be thinned (workflows/tensor/performance.py): count the requests that were measured
        interval = dataclasses.replace(interval, samples=max(interval.samples, mine.iterations))
    except ValueError as err:
        return Criterion(UNKNOWN, f"{reason}; no interval: {err}", "too few blocks")
    decision = decide(interval, policy.max_p95_regression)
    try:
        floor = noise_floor(theirs.blocks_ms, level=level)
        aa = floor.bracket()
    except ValueError:
        aa = "not measured (fewer than 8 reference blocks)"
    extended = f"; {mine.extension.text}" if mine.extension is not None and mine.extension.text else ""
    reason = f"{reason}; {decision.reason}{extended}; noise floor (reference A/A) {aa}; {how}"
    moved = _drifted(mine, theirs, policy)
    if moved:
        why = f"warm-up too short: {moved}, beyond the allowed drift {policy.max_latency_drift:+.0%}"
        return Criterion(UNKNOWN, f"{why}; {reason}", f"warm-up too short ({moved})")
    figure = (
        f"{interval.text()} at {level_text(level)}, allowed {1 + policy.max_p95_regression:.3g}; A/A {aa}"
        + slower
    )
    return Criterion(decision.result, reason, figure)


def _drifted(mine: ScenarioResult, theirs: ScenarioResult, policy: Policy) -> str:
    """How the candidate/reference ratio moved during the measurement, when it moved beyond the
    bound (the host's own drift cancels in the ratio), with each path's own drift beside it to
    say whose warm-up was too short; "" when it held or there are too few samples to tell."""
    bound, level = policy.max_latency_drift, policy.confidence
    if not bound:
        return ""
    try:
        moved = paired_drift(mine.blocks_ms, theirs.blocks_ms, bound, DRIFT_PERCENTILE, level)
    except ValueError:  # too few samples to tell: the criterion's own interval says so
        return ""
    if not moved.beyond:
        return ""
    own = [
        f"{role} {drift(s.blocks_ms, bound, DRIFT_PERCENTILE, level).text()}"
        for role, s in (("candidate", mine), ("reference", theirs))
    ]
    return f"{moved.text()} ({'; '.join(own)})"


def _memory(reference: PathState, candidate: PathState, policy: Policy) -> Criterion:
    """The candidate's process memory growth per 1,000 requests beyond the reference's, on its
    interval (workflows/tensor/growth.py), and its device memory's where the executor reports it."""
    allowed = policy.max_memory_growth_mib
    mine, theirs = candidate.performance, reference.performance
    if not allowed:
        return Criterion(SKIPPED, "not checked: policy.max_memory_growth_mib is 0")
    if mine is None or not mine.memory_steps:
        why = "the path was not measured" if mine is None else "its executor reports no process memory"
        return Criterion(SKIPPED, f"not sampled: {why}", "not sampled")
    columns = [("memory", 1)] + ([("device memory", 2)] if mine.memory_device_reported else [])
    decisions: list[Decision] = []
    figures: list[str] = []
    for what, column in columns:
        sampled = theirs is not None and (column == 1 or theirs.memory_device_reported)
        floor = growth.steps_of(theirs.memory_steps, column) if theirs is not None and sampled else None
        try:
            judged = growth.judge(
                growth.steps_of(mine.memory_steps, column), floor, allowed, what, policy.confidence
            )
        except ValueError as err:
            decisions.append(Decision(UNKNOWN, f"{what}: no interval: {err}"))
            figures.append(f"{what}: too few samples")
            continue
        decisions.append(judged.decision)
        figures.append(judged.figure)
    results = [d.result for d in decisions]
    result = FAIL if FAIL in results else UNKNOWN if UNKNOWN in results else PASS
    return Criterion(result, "; ".join(d.reason for d in decisions), "; ".join(figures))


def _cost(reference: PathState, candidate: PathState, policy: Policy, correct: bool) -> Criterion:
    econ, ref_econ = candidate.economics, reference.economics
    if not correct:
        return Criterion(SKIPPED, "no completed job within quality")
    if candidate.errors.get("training"):  # the ledger holds the failure's cost (timeouts, teardown)
        return Criterion(UNKNOWN, "not comparable: the training phase failed", "not comparable")
    fault = _fault(candidate)
    if fault:  # its jobs' time, and the ledger's, hold the fault: no steady cost per job
        return Criterion(UNKNOWN, f"not comparable: {fault}", "not comparable (a fault during measurement)")
    unpriced = candidate.economics_unpriced or reference.economics_unpriced
    if unpriced or econ is None or econ.unpriced or (ref_econ is not None and ref_econ.unpriced):
        problems = [s.ledger_problem for s in (candidate, reference) if s.economics_unpriced]
        why = next((p for p in problems if p), "usage without a price in force")
        return Criterion(UNKNOWN, f"unpriced: {why}", "unpriced")
    if not econ.jobs_completed or ref_econ is None or not ref_econ.jobs_completed:
        return Criterion(UNKNOWN, "no completed job on one of the paths", "no completed job")
    mine, ref = cost_per_job(econ, policy), cost_per_job(ref_econ, policy)
    if not ref:
        why = "the reference path cost nothing in the ledger: no basis for a saving"
        return Criterion(UNKNOWN, why, "no basis")
    basis = (
        f"preparation amortised over {policy.amortize_over_jobs} jobs"
        if policy.amortize_over_jobs
        else "all of the trial's cost in the ledger, preparation included"
    )
    saving = float(1 - mine / ref)
    reason = (
        f"cost per completed job {float(mine):.4g} vs reference {float(ref):.4g} {econ.currency} "
        f"micro-units ({basis}): saving {saving:+.1%}, policy needs at least {policy.min_cost_saving:+.0%}"
        f"{example_note(econ, ref_econ)}"
    )
    figure = f"saving {saving:+.1%} (needs {policy.min_cost_saving:+.0%})"
    spread = _time_per_job(_single(candidate), _single(reference), policy)
    if spread is None:  # no blocks (a report from before they were kept): the point estimates
        return Criterion(PASS if saving >= policy.min_cost_saving else FAIL, reason, figure)
    ratio = float(mine / ref)
    interval = rescaled(spread, ratio)
    decision = decide(interval, -policy.min_cost_saving, "cost ratio")
    why = "its spread is that of the mean latency ratio over the same paired blocks: a job's cost is its time"
    return Criterion(
        decision.result, f"{reason}; {decision.reason} ({why})", f"{figure}; {interval.text('cost ratio')}"
    )


def _fault(state: PathState) -> str:
    """The performance problem of a path some of whose measured requests failed or stalled."""
    scenarios = state.performance.scenarios if state.performance else []
    if not any(s.failed or s.stalled for s in scenarios):
        return ""
    return state.errors.get("performance", "")


def _time_per_job(
    mine: ScenarioResult | None, theirs: ScenarioResult | None, policy: Policy
) -> RatioInterval | None:
    """The paired interval of the mean single-stream latency ratio, whose relative spread the
    cost ratio takes (None without blocks to bootstrap)."""
    if mine is None or theirs is None or not mine.blocks_ms or not theirs.blocks_ms:
        return None
    try:
        interval = ratio_interval(mine.blocks_ms, theirs.blocks_ms, level=policy.confidence, stat=mean)
    except ValueError:
        return None
    return dataclasses.replace(interval, samples=max(interval.samples, mine.iterations))


def _failed_figure(o: OutputVerdict) -> str:
    m, kind = o.metrics or {}, o.finding
    if kind == "non-deterministic":
        return f"non-deterministic: repeats differ by up to {m.get('candidate_repeat_max_abs', 0.0):.3g}"
    fails = [r for r in o.reasons if r.endswith("fail")]
    if fails and fails[0].startswith("shape"):
        text = fails[0].removesuffix(": fail")
    elif m and m.get("rmse", 0.0) > m.get("allowed_rmse", 0.0):
        text = f"rmse {m['rmse']:.3g} > allowed {m['allowed_rmse']:.3g}"
    else:
        text = fails[0].removesuffix(": fail") if fails else "differs from the reference"
    return f"{kind}: {text}" if kind else text


def _correctness_figure(outputs: list[OutputVerdict]) -> str:
    """The decisive figure of the correctness criterion: the first failed output's, else the
    output closest to its tolerance."""
    if not outputs:
        return "no outputs"
    failed = [o for o in outputs if not o.passed]
    if failed:
        return _failed_figure(failed[0])

    def margin(o: OutputVerdict) -> float:
        m = o.metrics or {}
        allowed = float(m.get("allowed_rmse") or 0.0)
        return float(m.get("rmse") or 0.0) / allowed if allowed else 0.0

    m = max(outputs, key=margin).metrics or {}
    if not m:
        return "passed"
    return f"rmse {m.get('rmse', 0.0):.3g} <= allowed {m.get('allowed_rmse', 0.0):.3g}"
