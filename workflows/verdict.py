"""Verdicts: ADOPT / REJECT / INCONCLUSIVE per candidate path, with the reason per criterion.

Criteria in order: correctness (the evaluator's verdict; a path that fails it gets no speed
verdict), compilation while measuring, latency (single-stream p95 against the reference's,
within the policy's allowed regression), training (when a plan is given), and cost (cost per
completed job from the ledger, at least the policy's saving). Any failed criterion REJECTs;
otherwise any criterion that could not be judged makes the path INCONCLUSIVE.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from workflows.spec import Policy

PASS, FAIL, UNKNOWN, SKIPPED = "pass", "fail", "inconclusive", "skipped"


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

    def put(name: str, result: str, reason: str) -> None:
        criteria[name] = {"result": result, "reason": reason}

    corr = candidate.get("correctness") or {}
    if "passed" not in corr:
        why = candidate["errors"].get("correctness") or candidate["errors"].get("prepare") or "did not run"
        put("correctness", UNKNOWN, f"not established: {why}")
    elif corr["passed"]:
        put("correctness", PASS, "; ".join(r for o in corr["outputs"] for r in o["reasons"]))
    else:
        failed = [f"{o['output']}: {r}" for o in corr["outputs"] for r in o["reasons"] if r.endswith("fail")]
        put("correctness", FAIL, "; ".join(failed) or "outputs differ from the reference")

    if criteria["correctness"]["result"] != PASS:
        put("latency", SKIPPED, "no speed verdict without correctness")
    elif candidate["errors"].get("performance"):
        put("latency", UNKNOWN, f"performance: {candidate['errors']['performance']}")
    else:
        mine, theirs = _p95(candidate), _p95(reference)
        if mine is None or theirs is None or reference["errors"].get("performance"):
            put("latency", UNKNOWN, "no comparable measurement on both paths")
        else:
            limit = theirs[0] * (1 + policy.max_p95_regression)
            change = mine[0] / theirs[0] - 1 if theirs[0] else 0.0
            ok = mine[0] <= limit
            put(
                "latency",
                PASS if ok else FAIL,
                f"p95 {mine[0]:.3f} ms vs reference {theirs[0]:.3f} ms ({mine[1]}): {change:+.1%}, "
                f"allowed up to {policy.max_p95_regression:+.0%}",
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
            put("training", PASS if comparison["passed"] else FAIL, "; ".join(comparison["reasons"]))

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
        put("cost", UNKNOWN, f"unpriced: {why}")
    elif not int(econ.get("jobs_completed", 0)) or not int(ref_econ.get("jobs_completed", 0)):
        put("cost", UNKNOWN, "no completed job on one of the paths")
    elif not ref_cpj:
        put("cost", UNKNOWN, "the reference path cost nothing in the ledger: no basis for a saving")
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
        )

    results = [c["result"] for c in criteria.values()]
    if FAIL in results:
        verdict = "REJECT"
    elif UNKNOWN in results:
        verdict = "INCONCLUSIVE"
    else:
        verdict = "ADOPT"
    return {"verdict": verdict, "criteria": criteria}


def overall_verdict(verdicts: dict[str, str]) -> str:
    """One keyword for the UI filter: ADOPT if some path may be adopted, else the weakest."""
    values = set(verdicts.values())
    for v in ("ADOPT", "INCONCLUSIVE", "REJECT"):
        if v in values:
            return v
    return "INCONCLUSIVE"
