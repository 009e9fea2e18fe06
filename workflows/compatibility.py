"""The compatibility criterion: what a path needed to run the model, judged by the policy.

Findings come from two places of a path's state: the prepare phase (LoadModel's report of the
load and warm-up: fallback ops, graph breaks, recompiles, unsupported dtypes, adaptations) and
the correctness phase, whose requests on the trial's fixed inputs are bracketed by the
executor's counters, so host-fallback ops have a call count per request and a compilation on
the trial's own inputs (a shape that depends on the data, or one not warmed) is seen. The
policy caps the number of distinct host-fallback ops and of graph breaks; beyond a cap the
criterion fails (REJECT) or warns, as `policy.compatibility_action` says. Pure: it runs inside
the workflow when the report is built.
"""

from __future__ import annotations

from typing import Any

from workflows.spec import Policy

PASS, WARN, FAIL, UNKNOWN = "pass", "warn", "fail", "inconclusive"


def findings(state: dict[str, Any]) -> dict[str, Any]:
    """One path's compatibility findings (a PathState dict), in the report's shape."""
    load = (state.get("prepare") or {}).get("compatibility") or {}
    inputs = state.get("compatibility_on_inputs") or {}
    per_request: dict[str, float] = inputs.get("fallback_ops_per_request") or {}
    at_load: dict[str, int] = load.get("fallback_ops") or {}
    ops = sorted(set(at_load) | set(per_request))
    return {
        "known": bool(load),
        "requests": int(inputs.get("requests", 0)),
        "per_request_unknown": inputs.get("unknown", "" if inputs else "the fixed inputs did not run"),
        "fallback_ops": [
            {"op": op, "calls_per_request": per_request.get(op, 0.0), "calls_at_load": at_load.get(op, 0)}
            for op in ops
        ],
        "graph_breaks": int(load.get("graph_breaks", 0)),
        "graph_break_reasons": list(load.get("graph_break_reasons") or []),
        "recompiles_at_load": int(load.get("recompiles", 0)),
        "compilations_on_inputs": int(inputs.get("compilations", 0)),
        "unsupported_dtypes": list(load.get("unsupported_dtypes") or []),
        "adaptations": list(load.get("adaptations") or []),
        "notes": list(load.get("notes") or []),
    }


def _op_text(op: dict[str, Any]) -> str:
    per = op["calls_per_request"]
    if per:
        return f"{op['op']} {per:g} call{'s' if per != 1 else ''} per request"
    return f"{op['op']} ({op['calls_at_load']} calls during load and warm-up, none on the inputs)"


def fallback_summary(found: dict[str, Any]) -> str:
    """The host-fallback ops that ran on the trial's inputs, for the latency reason ("" if none)."""
    ops = [op for op in found["fallback_ops"] if op["calls_per_request"]]
    return ", ".join(_op_text(op) for op in ops)


def judge_compatibility(state: dict[str, Any], policy: Policy) -> dict[str, str]:
    """The compatibility criterion of one candidate: result, reason and its decisive figure."""
    found = findings(state)
    if not found["known"]:
        why = (state.get("errors") or {}).get("prepare") or "the path did not finish its prepare phase"
        return {"result": UNKNOWN, "reason": f"no findings: {why}", "figure": "no findings"}
    ops = found["fallback_ops"]
    breaks = found["graph_breaks"]
    recompiled = found["compilations_on_inputs"]
    parts = [
        "host fallback: " + ("; ".join(_op_text(op) for op in ops) if ops else "none"),
        f"graph breaks: {breaks}"
        + (f" ({'; '.join(found['graph_break_reasons'])})" if found["graph_break_reasons"] else ""),
        f"recompiles: {found['recompiles_at_load']} at load, {recompiled} on the trial's inputs after warm-up"
        + (" (a shape that depends on the data, or one not warmed)" if recompiled else ""),
        "unsupported dtypes: " + (", ".join(found["unsupported_dtypes"]) or "none"),
        "adaptations: " + ("; ".join(found["adaptations"]) or "none"),
    ]
    if found["per_request_unknown"]:
        parts.append(f"calls per request unknown: {found['per_request_unknown']}")
    over = []
    if len(ops) > policy.max_fallback_ops:
        over.append(f"{len(ops)} host-fallback op(s), policy allows {policy.max_fallback_ops}")
    if breaks > policy.max_graph_breaks:
        over.append(f"{breaks} graph break(s), policy allows {policy.max_graph_breaks}")
    if over:
        result = FAIL if policy.compatibility_action == "reject" else WARN
        parts.append(f"{'; '.join(over)}: {policy.compatibility_action}")
    elif recompiled:
        result = WARN
    else:
        result = PASS
    if ops:
        figure = f"{len(ops)} host-fallback op{'s' if len(ops) != 1 else ''}: " + ", ".join(
            f"{op['op']} {op['calls_per_request']:g}/request" for op in ops
        )
    else:
        figure = "0 host-fallback ops"
    figure += f", {breaks} graph break{'s' if breaks != 1 else ''}"
    if recompiled:
        figure += f", {recompiled} recompile{'s' if recompiled != 1 else ''} on the inputs"
    return {"result": result, "reason": "; ".join(parts), "figure": figure}
