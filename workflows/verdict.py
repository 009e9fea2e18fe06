"""Verdicts: ADOPT / REJECT / INCONCLUSIVE per candidate path, with the reason per criterion.

Criteria in order: correctness (the evaluator's verdict, naming a non-deterministic candidate
apart from a wrong but stable one; a path that fails it gets no speed verdict), compatibility
(host-fallback ops, graph breaks, recompiles, unsupported dtypes, adaptations, judged by the
policy's maximums: see workflows/compatibility.py), latency (single-stream p95 against the
reference's, within the policy's allowed regression; compilation while measuring makes it
inconclusive; a regression that coincides with a host fallback names the op), training (when
a plan is given), and cost (cost per completed job from the ledger, at least the policy's
saving). Any failed criterion REJECTs; otherwise any criterion that could not be judged makes
the path INCONCLUSIVE; a warning leaves the verdict as it is. Each criterion carries its one
decisive figure, and `line` is the verdict readable alone.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from workflows.compatibility import fallback_summary, findings, judge_compatibility
from workflows.spec import Policy

PASS, WARN, FAIL, UNKNOWN, SKIPPED = "pass", "warn", "fail", "inconclusive", "skipped"


def _p95(state: dict[str, Any]) -> tuple[float, str] | None:
    scenarios = state.get("performance", {}).get("scenarios") or []
    single = [s for s in scenarios if s["scenario"] == "single-stream"]
    chosen = single or sorted(scenarios, key=lambda s: s["batch_size"])
    if not chosen:
        return None
    s = chosen[0]
    return float(s["p95_ms"]), f"{s['scenario']} batch {s['batch_size']}"


def cost_per_job(econ: dict[str, Any], policy: Policy) -> Fraction:
    """Cost per completed job in micro-units, exact: all cost / completed jobs, or with
    preparation spread over a job horizon. Exact, because a local trial's job can cost less
    than one micro-unit, and a rounded 0 would compare as "no cost" (or no jobs)."""
    jobs = int(econ.get("jobs_completed", 0))
    if not jobs:
        return Fraction(0)
    total, prepare = int(econ.get("total_micros", 0)), int(econ.get("prepare_micros", 0))
    if not policy.amortize_over_jobs:
        return Fraction(total, jobs)
    return Fraction(total - prepare, jobs) + Fraction(prepare, policy.amortize_over_jobs)


def judge(
    reference: dict[str, Any], candidate: dict[str, Any], policy: Policy, training: bool
) -> dict[str, Any]:
    """The verdict of one candidate path against the reference path (both PathState dicts)."""
    criteria: dict[str, dict[str, str]] = {}

    def put(name: str, result: str, reason: str, figure: str = "") -> None:
        criteria[name] = {"result": result, "reason": reason, "figure": figure}

    corr = candidate.get("correctness") or {}
    if "passed" not in corr:
        why = candidate["errors"].get("correctness") or candidate["errors"].get("prepare") or "did not run"
        put("correctness", UNKNOWN, f"not established: {why}", "not established")
    elif corr["passed"]:
        put(
            "correctness",
            PASS,
            "; ".join(r for o in corr["outputs"] for r in o["reasons"]),
            _correctness_figure(corr["outputs"]),
        )
    else:
        failed = [f"{o['output']}: {r}" for o in corr["outputs"] for r in o["reasons"] if r.endswith("fail")]
        kinds = [o.get("finding", "") for o in corr["outputs"] if not o["passed"]]
        kind = next((k for k in ("non-deterministic", "wrong but stable", "wrong") if k in kinds), "")
        reason = "; ".join(failed) or "outputs differ from the reference"
        figure = _correctness_figure(corr["outputs"])
        put("correctness", FAIL, f"{kind}: {reason}" if kind else reason, figure)

    put("compatibility", **judge_compatibility(candidate, policy))

    if criteria["correctness"]["result"] != PASS:
        put("latency", SKIPPED, "no speed verdict without correctness")
    elif candidate["errors"].get("performance"):
        problem = candidate["errors"]["performance"]
        put("latency", UNKNOWN, f"performance: {problem}", problem.split(";")[0])
    else:
        mine, theirs = _p95(candidate), _p95(reference)
        if mine is None or theirs is None or reference["errors"].get("performance"):
            put("latency", UNKNOWN, "no comparable measurement on both paths", "not comparable")
        else:
            limit = theirs[0] * (1 + policy.max_p95_regression)
            change = mine[0] / theirs[0] - 1 if theirs[0] else 0.0
            ok = mine[0] <= limit
            reason = (
                f"p95 {mine[0]:.3f} ms vs reference {theirs[0]:.3f} ms ({mine[1]}): {change:+.1%}, "
                f"allowed up to {policy.max_p95_regression:+.0%}"
            )
            host = fallback_summary(findings(candidate))
            if change > 0 and host:
                reason += f"; the regression coincides with host fallback: {host}"
            put(
                "latency",
                PASS if ok else FAIL,
                reason,
                f"p95 {change:+.1%} (allowed {policy.max_p95_regression:+.0%})"
                + (", with host fallback" if change > 0 and host else ""),
            )

    if training:
        tr = candidate.get("training") or {}
        comparison = tr.get("comparison") or {}
        if criteria["correctness"]["result"] != PASS:
            put("training", SKIPPED, "not run without correctness")
        elif candidate["errors"].get("training"):
            # training ran and failed (e.g. a rank died): not judged, so not adoptable either
            put("training", UNKNOWN, f"training failed: {candidate['errors']['training']}")
        elif "passed" not in comparison:
            why = tr.get("skipped") or "no loss comparison"
            put("training", UNKNOWN if policy.require_training else SKIPPED, why)
        else:
            put(
                "training",
                PASS if comparison["passed"] else FAIL,
                "; ".join(comparison["reasons"]),
                f"max loss deviation {comparison.get('max_relative_deviation', 0.0):.2%}",
            )

    econ, ref_econ = candidate.get("economics") or {}, reference.get("economics") or {}
    mine_cpj, ref_cpj = cost_per_job(econ, policy), cost_per_job(ref_econ, policy)
    basis = (
        f"preparation amortised over {policy.amortize_over_jobs} jobs"
        if policy.amortize_over_jobs
        else "all of the trial's cost in the ledger, preparation included"
    )
    if criteria["correctness"]["result"] != PASS:
        put("cost", SKIPPED, "no completed job within quality")
    elif econ.get("unpriced") or ref_econ.get("unpriced") or not econ:
        why = econ.get("problem") or ref_econ.get("problem") or "usage without a price in force"
        put("cost", UNKNOWN, f"unpriced: {why}", "unpriced")
    elif not int(econ.get("jobs_completed", 0)) or not int(ref_econ.get("jobs_completed", 0)):
        put("cost", UNKNOWN, "no completed job on one of the paths", "no completed job")
    elif not ref_cpj:
        why = "the reference path cost nothing in the ledger: no basis for a saving"
        put("cost", UNKNOWN, why, "no basis")
    else:
        saving = float(1 - mine_cpj / ref_cpj)
        ok = saving >= policy.min_cost_saving
        put(
            "cost",
            PASS if ok else FAIL,
            f"cost per completed job {float(mine_cpj):.4g} vs reference {float(ref_cpj):.4g} "
            f"{econ.get('currency', '')} "
            f"micro-units "
            f"({basis}): saving {saving:+.1%}, policy needs at least {policy.min_cost_saving:+.0%}",
            f"saving {saving:+.1%} (needs {policy.min_cost_saving:+.0%})",
        )

    results = [c["result"] for c in criteria.values()]
    if FAIL in results:
        verdict = "REJECT"
    elif UNKNOWN in results:
        verdict = "INCONCLUSIVE"
    else:
        verdict = "ADOPT"
    return {"verdict": verdict, "criteria": criteria, "line": verdict_line(verdict, criteria)}


def verdict_line(verdict: str, criteria: dict[str, dict[str, str]]) -> str:
    """The verdict readable alone: each criterion's result with its one decisive figure."""
    parts = [
        f"{name} {c['result']}" + (f" ({c['figure']})" if c.get("figure") else "")
        for name, c in criteria.items()
    ]
    return f"{verdict}: " + "; ".join(parts)


def _correctness_figure(outputs: list[dict[str, Any]]) -> str:
    """The decisive figure of the correctness criterion: the first failed output's, else the
    output closest to its tolerance."""
    if not outputs:
        return "no outputs"
    failed = [o for o in outputs if not o["passed"]]
    if failed:
        o = failed[0]
        m, kind = o.get("metrics") or {}, o.get("finding", "")
        if kind == "non-deterministic":
            return f"non-deterministic: repeats differ by up to {m.get('candidate_repeat_max_abs', 0.0):.3g}"
        fails = [r for r in o["reasons"] if r.endswith("fail")]
        if fails and fails[0].startswith("shape"):
            text = fails[0].removesuffix(": fail")
        elif m and m.get("rmse", 0.0) > m.get("allowed_rmse", 0.0):
            text = f"rmse {m['rmse']:.3g} > allowed {m['allowed_rmse']:.3g}"
        else:
            text = fails[0].removesuffix(": fail") if fails else "differs from the reference"
        return f"{kind}: {text}" if kind else text

    def margin(o: dict[str, Any]) -> float:
        m = o.get("metrics") or {}
        allowed = float(m.get("allowed_rmse") or 0.0)
        return float(m.get("rmse") or 0.0) / allowed if allowed else 0.0

    m = max(outputs, key=margin).get("metrics") or {}
    if not m:
        return "passed"
    return f"rmse {m.get('rmse', 0.0):.3g} <= allowed {m.get('allowed_rmse', 0.0):.3g}"


def overall_verdict(verdicts: dict[str, str]) -> str:
    """One keyword for the UI filter: ADOPT if some path may be adopted, else the weakest."""
    values = set(verdicts.values())
    for v in ("ADOPT", "INCONCLUSIVE", "REJECT"):
        if v in values:
            return v
    return "INCONCLUSIVE"
